"""Fine-tuning's start: what `init.checkpoint` names, found and checked as a resume's checkpoint is,
and its model weights loaded into the model this run built and placed. Weights only: the
optimizer, schedule, data position, random state, step and MLflow run all start fresh.

Every key of the model and of the checkpoint must meet its twin in name and shape, but those that
`init.ignore` matches, which keep the values the model was built with (a new head). A mismatch is
refused whole, naming the keys: a source of another model is caught, not half loaded.
"""

import fnmatch
from pathlib import Path

from omegaconf import DictConfig
from torch import nn

from ..config import NAME, home_of
from ..errors import RunError, listed
from . import onefile
from .compatibility import mismatches, saved_shapes, shapes_of
from .home import has_checkpoints
from .resume import at
from .schema import STATE, Checkpoint


def find(cfg: DictConfig) -> Checkpoint:
    """The checkpoint `init.checkpoint` names (`locate`), loaded and, with checkpoint.verify, checked."""
    asked = f"init.checkpoint={cfg.init.checkpoint}"
    return at(locate(cfg), cfg.checkpoint.verify, asked, "the name of a run with checkpoints")


def locate(cfg: DictConfig) -> Path:
    """Where `init.checkpoint` points: a plain name is a run's, its home (its newest valid
    checkpoint), when that run has saved; else, and for any other text, a path: a checkpoint file,
    a folder of shards, a home, or a home's `latest`."""
    named = cfg.init.checkpoint
    if "/" not in named and NAME.fullmatch(named) and has_checkpoints(home := home_of(cfg, named)):
        return home
    return Path(named).expanduser().absolute()


def check_apart(cfg: DictConfig) -> None:
    """Refuses a source among this run's own checkpoints: it would resume them, not start from them,
    and its saves would prune them."""
    if cfg.init.checkpoint is None:
        return
    home, source = Path(cfg.checkpoint.dir).resolve(), locate(cfg).resolve()
    if source == home or home in source.parents:
        raise RunError(
            f"init.checkpoint={cfg.init.checkpoint} names this run's own checkpoints ({home}); a fine-tune is a run "
            f"of its own: give it name=<new name>, or continue this run with resume=last without init.checkpoint"
        )


def load_weights(model: nn.Module, saved: Checkpoint, ignore: list[str], shards: bool) -> list[str]:
    """The model weights of `saved`, but the keys `ignore` matches, copied into `model` where it
    is (a collective step where the model is sharded or the checkpoint is); returns the keys left
    as built. Refuses, naming them, keys that do not meet their twin."""
    built, stored = shapes_of(model), saved_shapes(saved)
    for glob in ignore:
        if not any(fnmatch.fnmatchcase(key, glob) for key in built.keys() | stored.keys()):
            raise RunError(
                f"init.ignore: {glob} matches no key of the model or of {saved.path} (the model has "
                f"{listed(list(built))}); fix the glob"
            )
    ignored = {key for key in built.keys() | stored.keys() if any(fnmatch.fnmatchcase(key, glob) for glob in ignore)}
    if not built.keys() - ignored:
        raise RunError(
            f"init.ignore keeps every key of the model as built: nothing of {saved.path} would load; ignore fewer "
            f"keys, or train without init.checkpoint"
        )
    problems, keys = mismatches(built, stored, ignored)
    if problems:
        modules = sorted({key.rsplit(".", 1)[0] + ".*" if "." in key else key for key in keys})
        raise RunError(
            f"{saved.path} does not fit this model ({problems}); if those layers are new, keep them as built with "
            f"'init.ignore=[{', '.join(modules)}]'; else init.checkpoint names a checkpoint of another model"
        )
    if saved.sharded or shards:
        from . import sharded  # torch.distributed.checkpoint only where a model or a checkpoint is in shards

        sharded.load_model(model, saved, ignored)
    else:
        model.load_state_dict(saved.weights(leaving=ignored), strict=False)
    return sorted(ignored & built.keys())


def lineage(saved: Checkpoint, ignored: list[str], frozen: int) -> dict:
    """Where this run's weights came from, kept in each of its checkpoints and tagged in MLflow."""
    return {
        "run_id": saved.part("tracker")["run_id"],
        "run_name": saved.run_name,
        "checkpoint": str(saved.path),
        "step": saved.step,
        "checksum": onefile.seal(saved.path / STATE if saved.sharded else saved.path),
        "ignored": len(ignored),
        "frozen": frozen,
    }


def tags(source: dict | None) -> dict[str, str]:
    """The MLflow tags of a run's lineage: `init.source_run_id` finds every fine-tune of a run."""
    if source is None:
        return {}
    found = {
        "init.source_run_id": source["run_id"],
        "init.source_run_name": source["run_name"],
        "init.source_checkpoint": source["checkpoint"],
        "init.source_step": source["step"],
        "init.source_checksum": source["checksum"],
        "init.ignored": source["ignored"],
        "init.frozen": source["frozen"],
    }
    return {key: str(value) for key, value in found.items() if value is not None}
