"""Fine-tuning's start: what `init.checkpoint` names, found and checked as a resume's checkpoint is,
and its model weights loaded into the model this run built and placed. Weights only: the
optimizer, schedule, data position, random state, step and MLflow run all start fresh.

Every key of the model and of the checkpoint must meet its twin in name and shape, but those that
`init.ignore` matches, which keep the values the model was built with (a new head). A mismatch is
refused whole, naming the keys: a source of another model is caught, not half loaded.
"""

import fnmatch
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from torch import nn

from ..errors import RunError
from . import onefile
from .compatibility import mismatches, saved_shapes, shapes_of
from .resume import home_named, load, newest_valid
from .schema import STATE, Checkpoint


def find(cfg: DictConfig) -> Checkpoint:
    """The checkpoint `init.checkpoint` names, loaded and (with checkpoint.verify) checked: a file
    or a folder of shards; `<home>/latest` or a home folder, its newest valid checkpoint; a run's
    name, the newest valid checkpoint of that run's home (checkpoint.dir with name=<that name>)."""
    named = cfg.init.checkpoint
    path, verify = home_named(Path(named).expanduser().absolute()), cfg.checkpoint.verify
    if not path.exists():
        path = Path(OmegaConf.merge(cfg, {"name": named}).checkpoint.dir)
        if path == Path(cfg.checkpoint.dir):  # checkpoint.dir=<a fixed path>: no home by name
            raise RunError(
                f"init.checkpoint={named}: no such file or folder, and checkpoint.dir does not depend on name, so "
                f"no run's home can be found by it; pass a checkpoint's path"
            )
        if not path.is_dir():
            raise RunError(
                f"init.checkpoint={named}: no such file or folder, and no run of that name has saved into {path}; "
                f"pass a checkpoint's path or the name of a run with checkpoints"
            )
    if path.is_file() or (path / STATE).exists():
        return load(path, verify)
    if (found := newest_valid(path, verify)) is None:
        raise RunError(f"init.checkpoint={named}: {path} holds no valid checkpoint; pass a checkpoint file or folder")
    return found


def load_weights(model: nn.Module, saved: Checkpoint, ignore: list[str], shards: bool) -> list[str]:
    """The model weights of `saved`, but the keys `ignore` matches, copied into `model` where it
    is (a collective step where the model is sharded or the checkpoint is); returns the keys left
    as built. Refuses, naming them, keys that do not meet their twin."""
    built, stored = shapes_of(model), saved_shapes(saved)
    for glob in ignore:
        if not any(fnmatch.fnmatchcase(key, glob) for key in built.keys() | stored.keys()):
            raise RunError(
                f"init.ignore: {glob} matches no key of the model or of {saved.path} (the model has "
                f"{', '.join(list(built)[:4])}, ...); fix the glob"
            )
    ignored = {key for key in built.keys() | stored.keys() if any(fnmatch.fnmatchcase(key, glob) for glob in ignore)}
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
        model.load_state_dict(
            {key: value for key, value in saved.part("model").items() if key not in ignored}, strict=False
        )
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
