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
"""

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from hydra import compose
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from .checkpoint.resume import config_at, config_of
from .components import RUNTIME
from .config import Config, check_resolved

COMPONENTS = tuple(RUNTIME)
# Which run, and where and how this command runs it, which this command line says whatever the
# checkpoint holds: its name (a checkpoint of another run is refused, compatibility.check_same_run),
# what it resumes, its home (where `resume=last` found the checkpoint), and the device and strategy
# (the launch: a ddp or fsdp run resumes in one process with plain `python run.py`, on any device).
OURS = {("name",), ("resume",), ("checkpoint", "dir"), ("device",), ("strategy",)}
ABSENT = object()  # a key that a config does not have


@dataclass(frozen=True)
class CommandLine:
    """What a command line said: its overrides, and the config they were applied to (the project's
    defaults, composed when asked for: a fresh start never needs them)."""

    overrides: tuple[str, ...]
    defaults: Callable[[], DictConfig]

    @classmethod
    def typed(cls) -> "CommandLine | None":
        """This process's, as Hydra read it (a sweep job's: its own); None where Hydra composed no config."""
        if not HydraConfig.initialized():
            return None
        hydra = HydraConfig.get()
        name = hydra.job.config_name
        return cls(tuple(hydra.overrides.task), lambda: compose(config_name=name, overrides=[]))

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
    saved = config_of(cfg.resume, Path(cfg.checkpoint.dir))
    return cfg if saved is None else merged(cfg, saved, said, cfg.keys())


def trained(cfg: Config, checkpoint: Path, said: CommandLine) -> Config:
    """The config eval.py and export.py build a checkpoint's model and data with: the components it
    was trained with, with what `said` changed; everything else (device, strategy, MLflow) is this
    command's. A checkpoint that does not read keeps `cfg` (the whole read then says why)."""
    saved = config_at(checkpoint)
    return cfg if saved is None else merged(cfg, saved, said, COMPONENTS)


def merged(cfg: Config, saved: dict, said: CommandLine, keys: Iterable[str]) -> Config:
    """`cfg` with the top-level `keys` as `saved` has them, but where `said` changed them. Checked
    after, as the command line's config would be (config.check_values): a key of another component
    typed with `++` (`++model.width=32` over the default MLP) is the checkpoint's component's."""
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
    return result


def picked(saved: object, now: object, before: object, path: tuple[str, ...], typed: set, root: dict) -> object:
    """The value at `path`: this command line's (`now`) where it typed or changed it (from the
    defaults, `before`), else the run's (`saved`, found in `root`)."""
    if path in typed or path in OURS or saved is ABSENT:
        return now
    if not (isinstance(saved, dict) and isinstance(now, dict)):
        return now if now != before or derived(now, saved, path, root) else saved
    defaults = before if isinstance(before, dict) else {}
    if before is not ABSENT and now.get("_target_") != defaults.get("_target_"):
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
    `saved` the run has at `path`: derived there, it is derived again here."""
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
