"""A run's checkpoint used after training, by eval.py and export.py: the `checkpoint=` they take
(best, last, a run's name or a path), found and checked as a resume's is; the config they build its
model and data with, the checkpoint's own (remembered.py); and the check that what the command line
changed of it leaves the model and the data the checkpoint was trained with.

The run's home is read, never claimed: a run still training there goes on saving, and nothing in
it is written, moved or set aside. A checkpoint is written whole before any name points at it, so
what is read is whole; one that retention deletes while it is read fails its checks, in one line.
On a machine where the run's home holds no checkpoint, a `checkpoint.remote=` typed fills it first
from the run's remote folder (the newest checkpoint that checks, and its best: checkpoint/fetch.py),
without a claim either: a run training elsewhere goes on.
"""

import inspect
import typing
from pathlib import Path

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

from .checkpoint.home import BEST, has_checkpoints
from .checkpoint.remote.run_folder import fetched_to_read
from .checkpoint.resume import at, found_by_main, locate, run_named
from .checkpoint.schema import Checkpoint
from .components import RESERVED
from .config import Config, check_resolved, home_of
from .distributed import World, launcher_number
from .errors import RunError, listed, shown
from .provenance import flatten
from .remembered import CommandLine, trained

CHOICES = "checkpoint=best, checkpoint=last"


def take(argv: list[str], **defaults: str) -> dict[str, str]:
    """The `key=value` arguments of `defaults`' keys, taken out of `argv` before Hydra reads it (to
    Hydra, `checkpoint=best` would choose the option `best` of the config group `checkpoint`);
    a key not given keeps its default."""
    taken = dict(defaults)
    for argument in argv[1:]:
        key, equals, value = argument.partition("=")
        if equals and key in defaults:
            taken[key] = value
    argv[1:] = [argument for argument in argv[1:] if argument.partition("=")[0] not in defaults]
    return taken


def settings(cfg: Config, which: str, said: CommandLine | None) -> Config:
    """The config that builds the model and the data of the checkpoint `checkpoint=<which>` names:
    the run's own, with what the command line `said` changed (remembered.trained); without `said`, `cfg`."""
    if said is None:
        return cfg
    check_resolved(cfg)  # the home is read before config.check_values, which checks what is merged
    return trained(cfg, where(cfg, which), said)


def find(cfg: DictConfig, world: World, which: str) -> Checkpoint:
    """The checkpoint `checkpoint=<which>` names, found and checked by rank 0 and read by every
    process."""
    return found_by_main(world, lambda: at(where(cfg, which), cfg.checkpoint.verify, f"checkpoint={which}", CHOICES))


def where(cfg: DictConfig, which: str) -> Path:
    """What `checkpoint=<which>` names: `best` and `last` are the run's (`name=`), anything else a
    run's name or a path."""
    home, asked = Path(cfg.checkpoint.dir), f"checkpoint={which}"
    if which in ("best", "last"):
        fetched(cfg, cfg.name, home, asked)
    elif run_named(which) and not Path(which).expanduser().exists():
        fetched(cfg, which, home_of(cfg, which), asked)
    if which in ("best", "last") and not has_checkpoints(home):
        remote = cfg.checkpoint.get("remote")
        nor = f", nor checkpoint.remote={remote} one that checks" if remote is not None else ""
        raise RunError(
            f"{asked}: {home} holds no checkpoint of {cfg.name}{nor}; train it first (python run.py "
            f"name={cfg.name}), or pass checkpoint=<a checkpoint's path>"
        )
    if which == "best" and not (home / BEST).exists():
        raise RunError(
            f"{asked}: {home} names no best checkpoint (it was trained with checkpoint.keep_best=false); pass "
            f"checkpoint=last or a checkpoint's path"
        )
    return {"best": home / BEST, "last": home}.get(which) or locate(cfg, which)


def fetched(cfg: DictConfig, run: str, home: Path, asked: str) -> None:
    """With `checkpoint.remote`, the run `run`'s newest checkpoint that checks, and its best, fetched
    into its `home` where that holds no checkpoint (run_folder.fetched_to_read). Not under torchrun:
    each of its processes reads the home before they meet, and none would wait for another's fetch."""
    if cfg.checkpoint.get("remote") is None or has_checkpoints(home):
        return
    if launcher_number("WORLD_SIZE", 1) > 1:
        raise RunError(
            f"{asked}: {home} holds no checkpoint of {run}, and processes of torchrun fetch none from "
            f"checkpoint.remote: run the same command with python in place of torchrun first (it fetches them "
            f"into {home}), then under torchrun"
        )
    fetched_to_read(cfg, run, home)


def check_trained_alike(cfg: DictConfig, saved: Checkpoint) -> None:
    """Refuses a config whose model or data settings differ from those `saved` was trained with:
    weights of the same shapes load into a model of other settings (more attention heads), and
    another split of the data would judge samples the model trained on. A setting the checkpoint
    does not hold (added to the project since) is not compared, nor a location given in place of
    another (`locations`): data that moved is read where it is now."""
    differ, asked = [], []
    for group in ("model", "data"):
        now = flatten(OmegaConf.to_container(cfg[group], resolve=True), f"{group}.")
        before = flatten(saved.config.get(group) or {}, f"{group}.")
        moved = locations(cfg[group])
        for key in sorted(now.keys() & before.keys()):
            setting = key.removeprefix(f"{group}.")
            loader = group == "data" and setting in RESERVED["data"]  # changes no sample
            elsewhere = setting in moved and "None" not in (now[key], before[key])  # null: the built-in example
            if not (loader or elsewhere) and now[key] != before[key]:
                differ.append(f"{key}={shown(before[key])}")
                asked.append(f"{key}={now[key]}")
    if differ:
        raise RunError(
            f"{saved.path} was trained with {listed(differ)}, and this command asks for {listed(asked)}: another "
            f"model, or other data, than the one to judge; leave those overrides out (the run's own come from its "
            f"checkpoint)"
        )


def locations(node: DictConfig) -> set[str]:
    """The settings of the component `node` that say where its files are, not what they hold: those
    its constructor annotates as a Path (text_folder's `dir`)."""
    try:
        parameters = inspect.signature(get_object(node._target_), eval_str=True).parameters
    except (TypeError, ValueError, NameError):  # no signature to read, or annotations that do not resolve
        return set()
    return {
        name
        for name, parameter in parameters.items()
        if parameter.annotation is Path or Path in typing.get_args(parameter.annotation)
    }
