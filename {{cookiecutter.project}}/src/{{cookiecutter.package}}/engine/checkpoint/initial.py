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

from ..config import continuing
from ..errors import RunError, listed
from . import onefile
from .compatibility import mismatches, saved_shapes, shapes_of
from .resume import at, locate
from .schema import STATE, Checkpoint


def find(cfg: DictConfig) -> Checkpoint:
    """The checkpoint `init.checkpoint` names (resume.locate), loaded and, with checkpoint.verify, checked."""
    asked = f"init.checkpoint={cfg.init.checkpoint}"
    return at(locate(cfg, cfg.init.checkpoint), cfg.checkpoint.verify, asked, "the name of a run with checkpoints")


def check_apart(cfg: DictConfig) -> None:
    """Refuses a source among this run's own checkpoints: it would resume them, not start from them,
    and its saves would prune them."""
    if cfg.init.checkpoint is None:
        return
    home, source = Path(cfg.checkpoint.dir).resolve(), locate(cfg, cfg.init.checkpoint).resolve()
    if source == home or home in source.parents:
        raise RunError(
            f"init.checkpoint={cfg.init.checkpoint} names this run's own checkpoints ({home}); a fine-tune is a run "
            f"of its own: give it name=<new name>, or continue this run with {continuing(cfg)} without init.checkpoint"
        )


def load_weights(
    model: nn.Module, saved: Checkpoint, ignore: list[str], shards: bool, fine_tuning: bool = True
) -> list[str]:
    """The model weights of `saved`, but the keys `ignore` matches, copied into `model` where it
    is (a collective step where the model is sharded or the checkpoint is); returns the keys left
    as built. Refuses, naming them, keys that do not meet their twin; the fix it offers is
    init.ignore when `fine_tuning` (a model with new layers), else the config `saved` was trained with."""
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
        fix = (
            f"if those layers are new, keep them as built with 'init.ignore=[{', '.join(modules)}]'; else "
            f"init.checkpoint names a checkpoint of another model"
            if fine_tuning
            else f"give the overrides it was trained with (its model: {saved.setting('model', '_target_')})"
        )
        raise RunError(f"{saved.path} does not fit this model ({problems}); {fix}")
    if saved.sharded or shards:
        from . import sharded  # torch.distributed.checkpoint only where a model or a checkpoint is in shards

        sharded.load_model(model, saved, ignored)
    else:
        model.load_state_dict(saved.weights(leaving=ignored), strict=False)
    return sorted(ignored & built.keys())


def lineage(saved: Checkpoint) -> dict:
    """Where a model's weights came from: kept in each checkpoint of a fine-tune (with the keys
    it left as built and the parameters it froze), tagged in MLflow, written beside an export."""
    return {
        "run_id": saved.part("tracker")["run_id"],
        "run_name": saved.run_name,
        "checkpoint": str(saved.path),
        "step": saved.step,
        "checksum": onefile.seal(saved.path / STATE if saved.sharded else saved.path),
    }


CHOSEN = ("ignored", "frozen")  # a fine-tune's own choices, counted beside its source


def tags(source: dict | None, prefix: str = "init") -> dict[str, str]:
    """The MLflow tags of a lineage, `<prefix>.source_<key>`: `init.source_run_id` finds every
    fine-tune of a run, `eval.source_run_id` every evaluation of it."""
    if source is None:
        return {}
    return {
        f"{prefix}.{key}" if key in CHOSEN else f"{prefix}.source_{key}": str(value)
        for key, value in source.items()
        if value is not None
    }
