"""The two config roots: your `configs/` and the engine's (`engine/configs/`), which
config.yaml's defaults list and `hydra.searchpath` join, yours winning; which folders a run was
composed from, and what run.py, eval.py and export.py check of them before Hydra reads either.
"""

import importlib.resources
import itertools
import sys
from pathlib import Path

from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .errors import RunError, reported


def config_roots() -> tuple[Path, ...]:
    """The folders this command's config is composed from, the first one's files winning: the
    project's `configs/`, then what its `hydra.searchpath` adds (the engine's configs, a package
    found where it is installed). Hydra's own configs and the schemas are none of them."""
    roots = []
    for source in HydraConfig.get().runtime.config_sources:
        if source.provider != "main" and not source.provider.startswith("hydra.searchpath"):
            continue
        if source.schema == "file":
            roots.append(Path(source.path))
        elif source.schema == "pkg":
            roots.append(Path(str(importlib.resources.files(source.path))))
    return tuple(roots)


PACKAGE = __name__.partition(".")[0]
ENGINE_CONFIGS = f"pkg://{PACKAGE}.engine.configs"  # the engine's root, as config.yaml's hydra.searchpath names it
SCHEMA = "config_schema"  # engine.yaml's first default: config.py's dataclasses, in Hydra's ConfigStore


def before_hydra(script: str) -> None:
    """What a command (run.py, eval.py, export.py: `script` is its __file__) checks before Hydra
    composes its config, said in one line, exit 2: the roots (check_roots) of the folder Hydra reads
    the config from (configs/ beside the script, or the one `--config-path` names), with the one
    `--config-dir` adds, and the config `--config-name` names. The command calls
    checkpoint.remote.url.refuse_typed first, before Hydra prints what it cannot parse."""
    # Hydra's own parser of its command line: its options read as Hydra reads them (`-c` is --cfg's,
    # `-cn` --config-name's), and a command line it refuses refused as Hydra would, by it.
    typed = get_args_parser().parse_args(sys.argv[1:])
    if (typed.config_path or "").startswith("pkg://"):
        return  # a package's configs, none of yours
    configs = Path(script).parent / (typed.config_path or "configs")
    yours = [configs, *([Path(typed.config_dir).absolute()] if typed.config_dir else [])]
    config = configs / f"{(typed.config_name or 'config').removesuffix('.yaml')}.yaml"
    reported(lambda: check_roots(yours, config, typed.overrides))


def check_roots(yours: list[Path], config: Path, overrides: list[str]) -> None:
    """Refuses, in one line naming your file, config folders of yours (`yours`: configs/, and the
    one `--config-dir` adds) that hide the engine's root, or a primary `config` that drops it,
    before Hydra composes from them: a file of yours named as one at the top of the engine's root
    (engine.yaml) is read in its place, a defaults list without `engine` reads none of its settings,
    a search path without the engine's package none of its groups, and Hydra said each with a
    traceback or its search path. The command line's `overrides` may replace the search path."""
    engine = Path(str(importlib.resources.files(f"{PACKAGE}.engine.configs")))
    for configs, name in itertools.product(yours, sorted([SCHEMA, *(path.stem for path in engine.glob("*.yaml"))])):
        if (configs / f"{name}.yaml").is_file():
            theirs = "the schema every setting merges into" if name == SCHEMA else f"{engine / name}.yaml"
            raise RunError(
                f"{configs / name}.yaml hides the engine's {name} ({theirs}): Hydra reads yours in its place, and the "
                f"run would get none of the engine's settings; rename yours (an experiment goes in configs/experiment/), "
                f"or move its settings into config.yaml (docs/configuration.md names the engine's files)"
            )
    try:
        choices = OmegaConf.to_container(OmegaConf.load(config))
    except (OSError, OmegaConfBaseException, ValueError):
        return  # no config.yaml, or no YAML: Hydra's own line says so
    if not isinstance(choices, dict):
        return
    # Each config the defaults list names, as Hydra reads it: `/engine`, `engine.yaml`, `engine@_here_` are the engine's.
    named = {str(entry).lstrip("/").partition("@")[0].removesuffix(".yaml") for entry in choices.get("defaults") or []}
    if "engine" not in named:
        raise RunError(
            f"{config}'s defaults list drops engine, the engine's {engine / 'engine.yaml'} (every setting with its "
            f"default): put `- engine` first in that list (docs/configuration.md)"
        )
    _check_search_path(config, choices.get("hydra"), overrides, engine)


def _check_search_path(config: Path, hydra: object, overrides: list[str], engine: Path) -> None:
    """Refuses the search path of `config` (its `hydra` node) or of the command line's `overrides`,
    which replaces it, where it leaves out the engine's root `engine`, however that is spelled."""
    given = [override for override in overrides if override.lstrip("+").startswith("hydra.searchpath=")]
    if given:
        try:
            typed = OverridesParser.create().parse_override(given[-1]).value()
        except HydraException:
            return  # Hydra's own line says what it cannot parse
        if not any(_is_engines(entry, engine) for entry in (typed if isinstance(typed, list) else [typed])):
            raise RunError(
                f"{given[-1]} replaces the search path of {config} and leaves out the engine's configs, "
                f"{ENGINE_CONFIGS}: name it in that list too"
            )
        return
    searched = (hydra.get("searchpath") if isinstance(hydra, dict) else None) or []
    if not any(_is_engines(entry, engine) for entry in searched):
        raise RunError(
            f"{config}'s hydra.searchpath ({', '.join(map(str, searched)) or 'none'}) leaves out the engine's configs, "
            f"{ENGINE_CONFIGS}, where every group and option is: add it to that list, after your own folders"
        )


def _is_engines(entry: object, engine: Path) -> bool:
    """Whether the search path's `entry` names the engine's root (the folder `engine`) as Hydra
    reads it: `pkg://` with dots or slashes, a trailing one, or `file://` its folder."""
    scheme, _, where = str(entry).partition("://")
    if scheme == "pkg":
        return where.replace("/", ".").rstrip(".") == ENGINE_CONFIGS.removeprefix("pkg://")
    return scheme == "file" and Path(where).resolve() == engine.resolve()
