"""A run's settings, remembered by its checkpoints: each holds the config it was saved with, so that
a run is resumed (`resumed`), and its model evaluated or exported (`trained`), by its name alone.
The command line changes what it names, and nothing else.

What it names: each key it types (a group, `model=cnn`, names the whole group), and each setting it
changes without naming it (`experiment=char_lm` changes the data, the model and more): those where
the config it composed differs from the project's defaults, composed without it. The rest is the
checkpoint's: the settings key by key (one added to the project since keeps its default), and each
component (data, model, ...) with the keys its run gave it. A setting the project derives from
another (`scheduler.total_steps: ${trainer.max_steps}`) is derived again where the run had derived
it, so that `trainer.max_steps=60` moves it too; a value the run was given stays.

So what a resume or an evaluation refuses (another model's shapes, other freeze globs:
checkpoint/compatibility.py; another model or data to judge: saved_model.py) is what was typed.

A checkpoint is data from anywhere, and its config is read as such: only once its checksum holds
(checkpoint/resume.py), only as plain nested values (an interpolation in it, `${oc.env:TOKEN}`, is
refused: this project stores its configs resolved, and nothing of a checkpoint's is resolved), and
what it would build only where this project could name it (targets.py). Where the run writes and
where it is tracked are never the checkpoint's (OURS).
"""

import copy
import functools
import reprlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, is_dataclass
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from . import targets
from .checkpoint.resume import config_at, config_of
from .components import RUNTIME
from .config import Config, check_resolved
from .config_roots import config_roots
from .errors import RunError, shown

COMPONENTS = tuple(RUNTIME)
# Which run, and where and how this command runs it, which this command line says whatever the
# checkpoint holds: its name (a checkpoint of another run is refused, compatibility.check_same_run),
# what it resumes and whether it stands by for it (standby.py), its home (where `resume=last` found
# the checkpoint) and its remote copy (checkpoint.remote, and how long that is waited for and held),
# whether the storage is trusted (checkpoint.verify), where it is tracked (a project copied
# elsewhere logs to its own store, and a checkpoint sends no run to a store of its choosing), and
# the device and strategy (the launch: a ddp or fsdp run resumes in one process with plain
# `python run.py`, on any device).
OURS = {
    ("name",),
    ("resume",),
    ("standby",),
    ("checkpoint", "dir"),
    ("checkpoint", "remote"),
    ("checkpoint", "remote_wait_s"),
    ("checkpoint", "remote_lease_s"),
    ("checkpoint", "verify"),
    ("mlflow",),
    ("device",),
    ("strategy",),
}
# What a checkpoint's model is judged with, as it was validated while it trained: its components,
# its precision (amp) and the trainer's settings (the memory layout, trainer.channels_last): an
# evaluation by the run's name alone gives the val/loss the run logged at that step.
TRAINED = (*COMPONENTS, "amp", "trainer")
ABSENT = object()  # a key that a config does not have
DEPTH = 32  # levels of nesting a stored config may have; the project's have fewer than 8
SIZE = 5_000  # keys and list items a stored config may hold; the project's hold about 110


@dataclass(frozen=True)
class CommandLine:
    """What a command line said: its overrides, the config they were applied to (the project's
    defaults, composed once, when first asked for: a fresh start never needs them), and the
    folders it was composed from (config_roots)."""

    overrides: tuple[str, ...]
    defaults: Callable[[], DictConfig]
    roots: tuple[Path, ...]

    @classmethod
    def typed(cls) -> "CommandLine | None":
        """This process's, as Hydra read it (a sweep job's: its own); None where Hydra composed no config."""
        if not HydraConfig.initialized():
            return None
        hydra = HydraConfig.get()
        name = hydra.job.config_name
        defaults = functools.cache(lambda: compose(config_name=name, overrides=[]))
        return cls(tuple(hydra.overrides.task), defaults, config_roots())

    def paths(self) -> set[tuple[str, ...]]:
        """The keys typed, `model` (a group) or `optimizer.lr`, `+key` and `~key` alike."""
        parsed = OverridesParser.create().parse_overrides(list(self.overrides))
        return {tuple(override.key_or_group.split(".")) for override in parsed}


def resumed(cfg: Config, said: CommandLine | None) -> Config:
    """The config a resume runs with: the settings of the checkpoint `resume=` names, with what
    `said` changed. A fresh start keeps `cfg`, as does a config a program composed (`said` None:
    nothing tells what was typed from what was not) or a checkpoint that does not read (the restore
    then says why)."""
    if said is None or cfg.resume is None:
        return cfg
    check_resolved(cfg)  # its home is read before config.check_values, which checks what is merged
    saved = config_of(cfg.resume, Path(cfg.checkpoint.dir), cfg.checkpoint.verify)
    return cfg if saved is None else merged(cfg, *saved, said, cfg.keys())


def trained(cfg: Config, checkpoint: Path, said: CommandLine) -> Config:
    """The config eval.py and export.py build a checkpoint's model and data with: the components it
    was trained with, and the settings its numbers were computed with (TRAINED), with what `said`
    changed; everything else (device, strategy, MLflow) is this command's. A checkpoint that does
    not read keeps `cfg` (the whole read then says why)."""
    saved = config_at(checkpoint, cfg.checkpoint.verify)
    return cfg if saved is None else merged(cfg, *saved, said, TRAINED)


def merged(cfg: Config, source: Path, saved: dict, said: CommandLine, keys: Iterable[str]) -> Config:
    """`cfg` with the top-level `keys` as `saved` (the config of the checkpoint `source`) has them,
    but where `said` changed them; refused in one line unless `saved` is what this project writes
    (check_stored) and names only what the project could build (targets.py). Checked
    after, as the command line's config would be (config.check_values): a key of another component
    typed with `++` (`++model.width=32` over the default MLP) is the checkpoint's component's."""
    check_stored(saved, source)
    now, typed = OmegaConf.to_container(cfg, resolve=False), said.paths()
    before = OmegaConf.to_container(said.defaults(), resolve=False)
    result = copy.deepcopy(cfg)
    with open_dict(result):
        for key in keys:
            if key not in saved or (key,) in OURS:
                continue
            value = picked(saved[key], now[key], before.get(key, ABSENT), (key,), typed, saved)
            if key in COMPONENTS:  # a component whole: its keys may be other than the defaults'
                result[key] = value
            else:  # a setting, or a group of them: the project's keys, each with its value
                result.merge_with({key: value})
    targets.check(OmegaConf.to_container(result, resolve=False), now, said.roots, source)
    return result


def check_stored(saved: dict, source: Path) -> None:
    """Refuses, in one line, a stored config that is not what this project writes (check_plain), or
    whose settings are not of the types this project's have (config.Config), or whose components
    are not mappings: every reader of a checkpoint's config (compatibility.py, continuity.py, ...)
    may then take it for one this project wrote."""
    check_plain(saved, source)
    where = f"{shown(source)} holds a config whose"
    if odd := [key for key in COMPONENTS if not isinstance(saved.get(key, {}), dict)]:
        raise RunError(f"{where} {odd[0]} is not a mapping, as a component is; pass a checkpoint this project wrote")
    if found := misfit(saved, Config):
        key, value, kind = found
        expected = "a mapping" if is_dataclass(kind) else f"of type {kind.__name__ if isinstance(kind, type) else kind}"
        raise RunError(
            f"{where} {shown(key)} is a {type(value).__name__} ({shown(reprlib.repr(value))}), where this project's "
            f"setting is {expected}; pass a checkpoint this project wrote"
        )


def misfit(saved: dict, schema: type, path: tuple[str, ...] = ()) -> tuple[str, object, object] | None:
    """The first setting of `saved` whose value is not of its type in `schema` (a key, its value and
    the type), or None. A setting the project has dropped since is no matter."""
    for name, kind in get_type_hints(schema).items():
        if name not in saved:
            continue
        key, value = ".".join((*path, name)), saved[name]
        if not fits(value, kind):
            return key, value, kind
        if is_dataclass(kind) and (found := misfit(value, kind, (*path, name))):
            return found
    return None


def fits(value: object, kind: object) -> bool:
    """Whether `value` is of the type `kind`, exactly: as OmegaConf's merge would not, which reads the
    string "300" as the number 300 (a config this project writes holds numbers as numbers). An
    integer is a float's value too, as YAML's `30` is `30.0`."""
    if kind is Any:
        return True
    if is_dataclass(kind):  # a group of settings, whose own are checked by misfit
        return isinstance(value, dict)
    if get_origin(kind) in (Union, UnionType):
        return any(fits(value, option) for option in get_args(kind))
    if get_origin(kind) is list:
        return isinstance(value, list) and all(fits(item, get_args(kind)[0]) for item in value)
    if get_origin(kind) is dict:
        return isinstance(value, dict)
    if kind is float:
        return type(value) in (int, float)
    return type(value) is kind


def check_plain(saved: dict, source: Path) -> None:
    """Refuses, in one line, a stored config that is not plain data as this project writes it: at
    most SIZE keys and list items (counted before anything else reads them: OmegaConf takes about
    0.1 ms a value, minutes for a crafted 300,000), nested dicts of named keys and lists, of
    strings, numbers, booleans and nulls, at most DEPTH levels deep, and resolved
    (checkpoint/manager.py saves `OmegaConf.to_container(cfg, resolve=True)`), so that no `${...}`
    of a checkpoint's is ever resolved, `${oc.env:TOKEN}` included."""
    pending: list[tuple[tuple[str, ...], object]] = [((), saved)]
    size = 0
    while pending:
        path, value = pending.pop()
        where = f"{shown(source)} holds a config whose {shown('.'.join(path))}"
        if len(path) > DEPTH:
            raise RunError(f"{where} lies deeper than {DEPTH} levels; pass a checkpoint this project wrote")
        if isinstance(value, dict | list) and (size := size + len(value)) > SIZE:
            raise RunError(
                f"{shown(source)} holds a config of more than {SIZE} keys and list items; pass a checkpoint this "
                f"project wrote"
            )
        if isinstance(value, dict):
            if odd := [key for key in value if not isinstance(key, str)]:
                raise RunError(
                    f"{where} has a key {shown(repr(odd[0]))} that is not a name; pass a checkpoint this project wrote"
                )
            pending += [((*path, key), item) for key, item in value.items()]
        elif isinstance(value, list):
            pending += [((*path, str(number)), item) for number, item in enumerate(value)]
        elif isinstance(value, str) and "${" in value:
            raise RunError(
                f"{where} is an interpolation ({shown(value)}), which this project never stores and never "
                f"resolves from a checkpoint; pass a checkpoint this project wrote"
            )
        elif not (value is None or isinstance(value, str | int | float | bool)):
            raise RunError(f"{where} is a {type(value).__name__}, not plain data; pass a checkpoint this project wrote")


def picked(saved: object, now: object, before: object, path: tuple[str, ...], typed: set, root: dict) -> object:
    """The value at `path`: this command line's (`now`) where it typed or changed it (from the
    defaults, `before`), else the run's (`saved`, found in `root`)."""
    if path in typed or path in OURS or saved is ABSENT:
        return now
    if not (isinstance(saved, dict) and isinstance(now, dict)):
        return now if now != before or derived(now, saved, path, root) else saved
    defaults, chosen = (before if isinstance(before, dict) else {}), now.get("_target_")
    # The checkpoint's own target, typed to accept it (targets.py), keeps the checkpoint's component.
    accepted = path + ("_target_",) in typed and chosen == saved.get("_target_")
    if before is not ABSENT and chosen != defaults.get("_target_") and not accepted:
        return now  # another component, chosen by a group typed (`experiment=...`)
    # A component's keys are its run's (the arguments it was built with); a group of settings', the project's.
    kept = saved if path[0] in COMPONENTS else now
    added = [key for key in now if key not in defaults or path + (key,) in typed]
    value = {}
    for key in dict.fromkeys([*kept, *added]):
        if key not in now and (key in defaults or path + (key,) in typed):
            continue  # removed by this command line (`~key`, or a group without it)
        value[key] = picked(
            saved.get(key, ABSENT), now.get(key, ABSENT), defaults.get(key, ABSENT), path + (key,), typed, root
        )
    return value


def derived(now: object, saved: object, path: tuple[str, ...], root: dict) -> bool:
    """Whether `now` is an interpolation that gives, in the run's own config `root`, the value
    `saved` the run has at `path`: derived there, it is derived again here. `now` is this command's;
    `root` holds no interpolation (check_plain), so it resolves nothing of the checkpoint's."""
    if not (isinstance(now, str) and "${" in now):
        return False
    node = OmegaConf.create(root)
    for key in path[:-1]:  # by key: a glob of optimizer.lr_multipliers holds dots
        node = node[key]
    node[path[-1]] = now
    try:
        return node[path[-1]] == saved
    except OmegaConfBaseException:  # it names what the run's config does not have
        return False
