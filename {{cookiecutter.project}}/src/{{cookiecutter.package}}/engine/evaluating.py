"""eval.py's recipe: a checkpoint's model judged on the validation split, and on the data's `test`
split when it gives one; the metrics printed, and logged to an MLflow run of their own nested under
the run that trained the model, at the checkpoint's step. The training run's history, tags and
files are not touched, nor its checkpoints (saved_model.py).

The model, the data and the rest of the run's components are the checkpoint's own (the config it
was saved with), and so is how its numbers are computed (its precision, `amp`: remembered.TRAINED),
so that `val/loss` is the one the run logged at that step; the command line changes how they are
judged (`data.batch_size`, `device`, the strategy and number of processes, `amp` where typed), and
names the run (`name=`). The model is built as run.py builds it, placed, and only then given the
checkpoint's weights.
"""

import logging
from pathlib import Path

from . import distributed, strategies
from .checkpoint.initial import lineage, load_weights
from .checkpoint.initial import tags as lineage_tags
from .checkpoint.schema import Checkpoint
from .config import Config, check_values
from .data.contract import Data
from .data.loaders import evaluation_loader
from .devices import audit_placement, set_cpu_threads
from .distributed import World
from .errors import reported, shown
from .provenance import datasets, record
from .remembered import CommandLine
from .saved_model import check_trained_alike, find, settings
from .tracking.tracker import Tracker, check_tracking_uri
from .train import build
from .validation import check_wiring, evaluate

log = logging.getLogger(__name__)


def main(cfg: Config, which: str, spill_dir: Path) -> dict:
    """The entry point of eval.py: a problem the user can fix prints as one line, no traceback."""
    said = CommandLine.typed()
    return reported(lambda: evaluate_checkpoint(cfg, which, spill_dir, said))


def evaluate_checkpoint(cfg: Config, which: str, spill_dir: Path, said: CommandLine | None = None) -> dict:
    """The metrics of the model `checkpoint=<which>` holds, with the step it was saved at and the
    id of the MLflow run that records them (None untracked). `spill_dir`: where metrics MLflow
    could not take wait for `replay` (tracking/tracker.py). Built from the checkpoint's settings with what
    the command line `said` changed; without `said`, from `cfg`."""
    cfg = settings(cfg, which, said)
    check_values(cfg)
    with distributed.join(cfg) as world:
        set_cpu_threads(cfg.device)
        if cfg.mlflow.enabled:
            world.on_main(lambda: check_tracking_uri(cfg.mlflow))
        saved = find(cfg, world, which)
        check_trained_alike(cfg, saved)
        source = world.on_main(lambda: lineage(saved))  # now: retention may prune it once it is read
        # Device first, as in training: the model built and placed, then the weights copied in.
        built = build(cfg, world, strategies.choose(cfg, world))
        load_weights(built.model, saved, [], built.strategy.shards, fine_tuning=False)
        audit_placement(world.device, built.model)
        check_wiring(built)
        results = evaluate(built, built.val_loader)
        if built.data.test is not None:
            workers = cfg.data.get("num_workers", 0)
            test = evaluation_loader(built.data.test, cfg.data.batch_size, workers, cfg.device, world)
            results.update(evaluate(built, test, split="test"))
        run_id = world.on_main(lambda: track(cfg, saved, source, built.data, results, spill_dir, world))
    if world.is_main:
        scores = "\n".join(f"  {key} {value!r}" for key, value in results.items())
        log.info(f"{saved.path}, step {saved.step} of {shown(saved.run_name)}; MLflow run {run_id or 'off'}:\n{scores}")
    return {**results, "step": saved.step, "run_id": run_id}


def track(
    cfg: Config, saved: Checkpoint, source: dict, data: Data, results: dict[str, float], spill_dir: Path, world: World
) -> str | None:
    """The evaluation as an MLflow run of its own, nested under the run that trained the model (in
    that run's experiment, whatever this config's `name=`), its metrics at the checkpoint's step;
    its id."""
    cfg.mlflow.parent_run_id = source["run_id"]
    cfg.mlflow.experiment_name = saved.setting("mlflow", "experiment_name") or cfg.mlflow.experiment_name
    cfg.mlflow.run_name = cfg.mlflow.run_name or f"eval {shown(saved.run_name)} step {saved.step}"
    tracker = Tracker(cfg.mlflow, spill_dir)
    inputs = datasets(cfg.data, data, splits=("val", "test"))
    tracker.open(*record(cfg, world, lineage_tags(source, prefix="eval")), checkpoint=None, datasets=inputs)
    status = "FAILED"
    try:
        tracker.log_metrics(results, saved.step)
        status = "FINISHED"
    finally:
        tracker.finish(status)
    return tracker.run_id
