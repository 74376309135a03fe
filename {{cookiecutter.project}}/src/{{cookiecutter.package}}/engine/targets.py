"""Which `_target_` a checkpoint's config may name: a checkpoint is data from anywhere, and each
`_target_` in the config it was saved with is a class or function that a resume, eval.py or export.py
would build (hydra.utils.instantiate: at any depth, in `_args_` lists too). So one is built only
where this project could have named it itself: a `_target_` of its own `configs/` (read as YAML,
nothing imported), one of this command's own config (what its configs and its command line give: a
target typed is one accepted knowingly), or a class or function defined in the project's package
outside the engine (models, datasets, tasks, callbacks, schedulers and the modules a user adds).
Anything else is refused before anything is imported or built.
"""

import inspect
from collections.abc import Iterator, Sequence
from importlib import import_module
from pathlib import Path

import yaml

from .errors import RunError, shown, typed

ENGINE = __name__.rpartition(".")[0]
PACKAGE = ENGINE.partition(".")[0]


def check(config: dict, own: dict, roots: Sequence[Path], source: Path) -> None:
    """Refuses, in one line, the first `_target_` of `config` (what a command builds from, with the
    values of the checkpoint `source`) that neither `own` (this command's config), the project's
    `configs/` folder, nor its package names."""
    allowed = {found for _, found in named(own)}
    in_configs: set[str] | None = None  # read only when a target is not this command's own
    for key, target in named(config):
        if target in allowed:
            continue
        if in_configs is None:
            in_configs = set().union(*(targets_in(root) for root in roots))
        if target in in_configs or defined_here(target):
            allowed.add(target)
            continue
        raise RunError(
            f"{shown(source)} holds a config that names {shown(key)}={shown(target)}, which neither configs/ nor this "
            f"project's package names: a checkpoint from elsewhere runs no code of its choosing; if you trust it, "
            f"type {typed(f'++{key}={target}')} on the command line"
        )


def named(node: object, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str]]:
    """Each `_target_` in `node`, nested dicts and lists, with its key: `loss._args_.0._target_`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_":
                yield ".".join((*path, key)), (value if isinstance(value, str) else repr(value))
            else:
                yield from named(value, (*path, str(key)))
    elif isinstance(node, list):
        for number, value in enumerate(node):
            yield from named(value, (*path, str(number)))


def targets_in(configs: Path) -> set[str]:
    """Every `_target_` in the YAML files of `configs/`, at any depth."""
    found = set()
    for file in sorted(configs.rglob("*.yaml")):
        try:
            node = yaml.load(file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except (OSError, yaml.YAMLError):  # a file Hydra cannot read either names nothing
            continue
        found |= {target for _, target in named(node)}
    return found


def defined_here(target: str) -> bool:
    """Whether `target` is `<module>.<name>` of a class or function that a module of the package,
    outside the engine, defines: `my_trainer.models.WideMLP` of yours, not `my_trainer.models.nn.Linear`
    (torch's, reached through the module's import). Found as Hydra finds it (an attribute, else a submodule),
    but only through the package's own modules and classes, so nothing outside it is imported."""
    parts = target.split(".")
    if parts[0] != PACKAGE or not all(parts) or ".".join(parts[:2]) == ENGINE:
        return False
    try:
        found = import_module(PACKAGE)
        for depth, part in enumerate(parts[1:], start=2):
            if not ours(found):
                return False
            step = getattr(found, part, None)
            if step is None and inspect.ismodule(found):
                step = import_module(".".join(parts[:depth]))
            found = step
    except Exception:  # whatever the package's module raised, or a name it does not have
        return False
    return not inspect.ismodule(found) and ours(found) and f"{found.__module__}.{found.__qualname__}" == target


def ours(found: object) -> bool:
    """Whether `found` is a module of the package, or a class or function one defines, outside the engine."""
    if inspect.ismodule(found):
        name = found.__name__
    elif inspect.isclass(found) or inspect.isfunction(found):
        name = found.__module__
    else:
        return False
    inside = isinstance(name, str) and (name == PACKAGE or name.startswith(f"{PACKAGE}."))
    return inside and not (name == ENGINE or name.startswith(f"{ENGINE}."))
