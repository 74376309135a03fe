"""Components by `_target_`: the data, task, model, loss, metrics, optimizer, scheduler and
callbacks are each a class (or a function) that its YAML file names, built with
`hydra.utils.instantiate`.

A component's schema is its signature. Before anything is built, every setting is checked against
the parameters of its `_target_`: a key it does not take is refused with the nearest name, a value
of the wrong type with the type it needs, a parameter without default that no setting gives is
named (for the groups given the data's facts, once the data is built and its facts are known). So adding a model is one class with type-annotated parameters and one YAML file. What only
the run knows is passed at build time, to the parameters that ask for it by name: the data's facts
(`input_shape`, `num_classes`, `vocab_size`: whatever the data component reports) to the task,
model, loss and metrics, and the parameters to optimize to the optimizer (RUNTIME).
"""

import collections.abc
import dataclasses
import difflib
import inspect
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import RunError, first_line

# Per group, what the runner passes at build time to a constructor that names it.
RUNTIME = {
    "data": (),
    "task": (),
    "model": (),
    "loss": (),
    "metrics": (),
    "optimizer": ("params",),  # the model's trainable parameters, already on the device
    "scheduler": ("optimizer",),
    "callbacks": (),  # hooks.py
}
# The groups that map names to components, metrics.<name> and callbacks.<name>.
MAPPINGS = ("metrics", "callbacks")
# The groups given the data's facts (data.Data), which are known only once the data is built: a
# parameter without default that no setting gives may be one of them, checked at build time.
GIVEN_FACTS = ("task", "model", "loss", "metrics")
# Keys the runner reads itself, not the `_target_`: the DataLoader's (batch_size is required), the
# lanes a stream is read in (streams.py), and the optimizer's parameter groups (param_groups.py).
RESERVED = {
    "data": {"batch_size": int, "num_workers": int, "lanes": int | None},
    "optimizer": {"lr_multipliers": dict[str, float] | None},
}
METRIC_NAME = re.compile(r"[A-Za-z0-9_]+")


def build(group: str, node: DictConfig, **runtime: object) -> Any:
    """The component `node` describes, given those of `runtime` that its constructor names. A
    constructor that refuses a value (ValueError, or RunError) stops the run in one line."""
    settings, given = _arguments(group, node, runtime)
    try:
        return instantiate(settings, _convert_="all", **given)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ValueError | RunError):
            raise RunError(f"{group} ({node._target_}): {first_line(cause)}") from None
        raise


def described(group: str, node: DictConfig, **facts: object) -> dict:
    """The component as plain values: its `_target_`, its settings and the facts its constructor
    takes, which `hydra.utils.instantiate` builds again anywhere (export.py's sidecar)."""
    settings, given = _arguments(group, node, facts)
    try:
        return OmegaConf.to_container(OmegaConf.create({**settings, **given}))
    except OmegaConfBaseException as error:
        raise RunError(f"{group} ({node._target_}) takes a value that is not plain data: {first_line(error)}") from None


def _arguments(group: str, node: DictConfig, runtime: dict[str, object]) -> tuple[dict, dict]:
    """What `node` gives its constructor, with its `_target_`, checked; and those of `runtime`
    that the constructor names."""
    settings = _settings(node, group)
    named = _parameters(get_object(node._target_))
    if group.split(".")[0] in GIVEN_FACTS:
        _check_facts(group, node._target_, named, settings, runtime)
    return {"_target_": node._target_, **settings}, {key: value for key, value in runtime.items() if key in named}


def _check_facts(
    group: str, target: str, named: dict[str, inspect.Parameter], settings: dict, facts: dict[str, object]
) -> None:
    """A setting that the data also gives is refused (two sources for one number), and so is a
    required parameter that neither gives."""
    if clash := [key for key in facts if key in named and key in settings]:
        raise RunError(
            f"{group}.{clash[0]} is given by the data ({facts[clash[0]]!r}) when {group} is built; remove it from "
            f"the config"
        )
    if missing := [name for name in _required(named) if name not in settings and name not in facts]:
        raise RunError(
            f"{group}.{missing[0]} is required by {target} and neither its config nor the data gives it (the "
            f"data's facts: {', '.join(facts) or 'none'}); set {group}.{missing[0]}=<value>, or report it from the data"
        )


def problems(cfg: DictConfig) -> list[str]:
    """Every setting of every component that its `_target_` would refuse, in one line each."""
    found = []
    for group in RUNTIME:
        node = cfg[group]
        if group not in MAPPINGS:
            found += _check(group, node, RUNTIME[group])
            continue
        if not isinstance(node, DictConfig):
            found.append(f"{group} must map names to components, e.g. {group}.<name>._target_=...")
            continue
        for name, component in node.items():
            if group == "metrics" and not METRIC_NAME.fullmatch(str(name)):
                found.append(f"metrics.{name}: a metric's name is logged as val/<name>; use letters, digits and _")
            found += _check(f"{group}.{name}", component, RUNTIME[group])
    return found


def _check(path: str, node: object, runtime: tuple[str, ...]) -> list[str]:
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return [f"{path} names no _target_; give the class or function that builds it (see configs/)"]
    try:
        target = get_object(node._target_)
    except Exception as error:  # whatever the import raised: the name is what the user can fix
        return [f"{path}._target_={node._target_} cannot be imported ({first_line(error.__cause__ or error)})"]
    named = _parameters(target)
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in named.values())
    hints = _type_hints(target)
    settings = _settings(node, path)
    where = f"{node._target_}"
    found = []
    reserved = RESERVED.get(path, {})
    found += _check_types(path, {key: node[key] for key in reserved if key in node}, reserved)
    if path == "data":
        found += (
            []
            if "batch_size" in node
            else ["data.batch_size is required by the loader; set it in the data's YAML file"]
        )
    for key in settings:
        if key in runtime:
            found.append(f"{path}.{key} is given by the run when {path} is built; remove it from the config")
        elif key not in named and not takes_any:
            options = [name for name in named if name not in runtime]
            near = difflib.get_close_matches(key, options, n=1)
            hint = f"did you mean {path}.{near[0]}?" if near else f"it takes: {', '.join(options) or 'nothing'}"
            found.append(f"{path}.{key} is not a setting of {where} ({hint})")
    found += _check_types(path, {key: settings[key] for key in settings if key in named}, hints)
    found += [
        f"{path}.{key}={value} must be a finite number"
        for key, value in settings.items()
        if isinstance(value, float) and not math.isfinite(value)
    ]
    if path.split(".")[0] not in GIVEN_FACTS:
        found += [
            f"{path}.{name} is required by {where}; set it in its YAML file or with {path}.{name}=<value>"
            for name in _required(named)
            if name not in settings and name not in runtime
        ]
    return found


def _required(named: dict[str, inspect.Parameter]) -> list[str]:
    """The parameters a call must give: no default, and not *args or **kwargs."""
    return [
        name
        for name, parameter in named.items()
        if parameter.default is inspect.Parameter.empty
        and parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]


def _check_types(path: str, values: dict[str, object], hints: dict[str, object]) -> list[str]:
    """Each value against its parameter's annotation, as OmegaConf would type a dataclass field."""
    found = []
    for key, value in values.items():
        kind = _config_type(hints.get(key, inspect.Parameter.empty))
        if kind is Any:
            continue
        field = dataclasses.field(default=MISSING)
        try:
            schema = OmegaConf.structured(dataclasses.make_dataclass("Setting", [("value", kind, field)]))
        except OmegaConfBaseException:  # a type OmegaConf cannot hold: not checked
            continue
        try:
            OmegaConf.merge(schema, {"value": value})
        except OmegaConfBaseException:
            found.append(f"{path}.{key}={value!r} is not {_type_name(kind)}")
    return found


def _config_type(annotation: object) -> object:
    """The annotation as a config can hold it: Tensor dropped from unions (`float | Tensor` is a
    float in YAML), tuples and sequences as lists; Any for what YAML cannot say."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return Any
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        known = [kind for arg in args if arg is not type(None) and (kind := _config_type(arg)) is not Any]
        if len(known) != 1:
            return Any
        return known[0] | None if type(None) in args else known[0]
    if origin in (list, tuple, collections.abc.Sequence):
        items = {_config_type(arg) for arg in args if arg is not Ellipsis}
        return list[items.pop()] if len(items) == 1 else list
    if origin is dict:
        return dict[str, _config_type(args[1])] if args else dict
    if annotation in (int, float, bool, str, Path):
        return annotation
    return Any


def _type_name(kind: object) -> str:
    if type(None) in typing.get_args(kind):
        (inner,) = (arg for arg in typing.get_args(kind) if arg is not type(None))
        return f"{_type_name(inner)} or null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(kind, f"a {kind}")


def _parameters(target: object) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(target).parameters)
    except (TypeError, ValueError):  # no signature to read (a builtin): anything goes
        return {"kwargs": inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)}


def _type_hints(target: object) -> dict[str, object]:
    try:
        return typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:  # unresolvable annotations leave the values unchecked, not the run stopped
        return {}


def _settings(node: DictConfig, group: str) -> dict[str, object]:
    """The keys that go to the constructor: not Hydra's own (`_target_`; `_partial_`, which
    lightning-hydra-template writes for optimizers, is not needed, since the run passes what it
    would defer), and not those the runner reads itself (RESERVED)."""
    reserved = RESERVED.get(group, {})
    values = OmegaConf.to_container(node, resolve=True)
    return {key: value for key, value in values.items() if not key.startswith("_") and key not in reserved}
