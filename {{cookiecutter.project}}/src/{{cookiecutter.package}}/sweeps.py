"""Multirun sweeps (`python run.py -m optimizer=adamw,sgd optimizer.lr=1e-3,3e-3`).

Each sweep gets a parent MLflow run, and each job a child run named by its overrides, so the UI
groups and compares them. The parent is made by `SweepCallback` in the launching process, and
jobs find its id in a file in the sweep folder: that works for launchers that run jobs in this
process, in local worker processes, or on SLURM nodes. Each job also writes its result there,
and the callback turns the results into a summary table at the end.

A job fails alone: its error is recorded and the other jobs run. Each job's checkpoints live in
`checkpoint.dir/<its overrides>`, so the same sweep run again with `resume=auto` continues every
job that had started and starts the others.
"""

import atexit
import json
import logging
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .checkpoint.files import read_regular, write_text
from .errors import RunError, first_line
from .preemption import Stopped
from .tracking import check_tracking_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient

log = logging.getLogger(__name__)

PARENT_RUN_FILE = "mlflow_parent_run_id"
RESULT_FILE = "job_result.json"
# The table's columns; every val/<metric> the jobs report, then their throughput over the whole
# job in the task's unit (train/mean_samples_per_s, train/mean_tokens_per_s), go between these two groups.
FIRST_COLUMNS = ("job", "status", "train/loss")
LAST_COLUMNS = ("continuity", "run_id", "error")


@dataclass
class Job:
    """One job of a sweep, as the job sees itself."""

    key: str  # its overrides, less those that do not change what it trains (resume, device, ...)
    parent_run_id: str | None
    output_dir: Path

    def run(self, train: Callable[[DictConfig], dict], cfg: DictConfig) -> float | None:
        """Trains in the job's own checkpoint folder and MLflow child run, records the result,
        and returns the job's `optimized_metric`: the value a search sweeper minimizes or maximizes
        (`optimized_mode`). An error is recorded, not raised, so the other jobs still run."""
        if cfg.init.checkpoint is not None:  # a run's name: its home, not one under this job's
            from .checkpoint.resume import locate  # torch: not in the launching process

            cfg.init.checkpoint = str(locate(cfg, cfg.init.checkpoint))
        cfg.checkpoint.dir = str(Path(cfg.checkpoint.dir) / self.key)
        cfg.mlflow.run_name = cfg.mlflow.run_name or self.key
        cfg.mlflow.parent_run_id = self.parent_run_id
        try:
            result = {"status": "FINISHED", **train(cfg)}
        except Stopped as stopped:
            self._record({"status": "REQUEUED" if stopped.comeback else "KILLED", "error": stopped.received.name})
            # A job requeued leaves submitit no result, so the sweep waits for its comeback; in a
            # sweep of its own process the signal stops the sweep. Only a SLURM job that will not
            # come back by itself returns, with its row, as a failing job does.
            if stopped.comeback or os.environ.get("SUBMITIT_EXECUTOR") is None:
                raise
            return None
        except RunError as error:
            log.error(f"error: {error}")
            result = {"status": "FAILED", "error": str(error)}
        except Exception as error:  # a bug in one job must not cost the others their runs
            log.error(f"job {self.key} failed:\n{traceback.format_exc()}")
            result = {"status": "FAILED", "error": f"{type(error).__name__}: {error}"}
        self._record(result)
        return result.get(cfg.optimized_metric)

    def _record(self, result: dict) -> None:
        if os.environ.get("RANK", "0") == "0":  # a job of several SLURM tasks has one result
            write_text(self.output_dir / RESULT_FILE, json.dumps({"job": self.key, **result}))


def current_job() -> Job | None:
    """The sweep job this process is running, or None outside a multirun."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra = HydraConfig.get()
    parent_file = Path(hydra.sweep.dir) / PARENT_RUN_FILE
    return Job(
        key=hydra.job.override_dirname.replace("/", "_") or "defaults",
        parent_run_id=read_regular(parent_file).decode().strip() if parent_file.exists() else None,
        output_dir=Path(hydra.runtime.output_dir),
    )


class SweepCallback(Callback):
    """Opens the sweep's parent MLflow run before the first job and closes it after the last,
    with the summary table as its artifact `summary.md`.

    A sweep stopped early ends the parent KILLED: by an exception or SIGINT through `atexit`,
    by SIGTERM through a handler of its own, since a signal's death skips `atexit`. During a job,
    train.py's `Preemption` holds SIGTERM instead (the job saves, then the sweep stops) and puts
    this handler back after.
    """

    def __init__(self) -> None:
        self._client: MlflowClient | None = None
        self._parent_run_id: str | None = None
        self._previous_sigterm = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        HydraConfig.instance().set_config(config)  # lets `${project_root:}` resolve out here too
        direction = OmegaConf.select(config, "hydra.sweeper.direction")
        if isinstance(direction, str) and direction != f"{config.optimized_mode}imize":
            print(
                f"error: hydra.sweeper.direction={direction} disagrees with optimized_mode={config.optimized_mode}, "
                f"which also names the winner and the best checkpoint; set optimized_mode alone",
                file=sys.stderr,
            )
            raise SystemExit(2)
        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not config.mlflow.enabled:
            return
        try:  # before any job: each would fail on it alone
            check_tracking_uri(config.mlflow)
        except RunError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        from .mlflow_store import connect, experiment_id  # MLflow in the launching process only, not in each job's

        try:
            self._client = connect(config.mlflow.tracking_uri)
            experiment = experiment_id(self._client, config.mlflow)
            run = self._client.create_run(
                experiment, run_name=f"sweep {sweep_dir.name}", tags={"sweep.dir": str(sweep_dir)}
            )
        except Exception as error:  # the jobs can still run, and each tries MLflow itself
            log.warning(f"MLflow failed ({first_line(error)}); the sweep runs without a parent run")
            return
        self._parent_run_id = run.info.run_id
        write_text(sweep_dir / PARENT_RUN_FILE, self._parent_run_id)
        atexit.register(self._end_parent, "KILLED")
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._stop)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = [
            json.loads(read_regular(path)) for path in sorted(sweep_dir.glob(f"*/{RESULT_FILE}"), key=_job_number)
        ]
        table = summary_table(results)
        log.info(f"sweep summary ({sweep_dir}):\n{table}")
        failed = [result["job"] for result in results if result["status"] != "FINISHED"]
        if self._parent_run_id is not None:
            self._client.log_text(self._parent_run_id, table, "summary.md")
            self._name_the_best(results, config.optimized_metric, config.optimized_mode)
            self._end_parent("FAILED" if failed else "FINISHED")
        if failed:
            raise SystemExit(f"{len(failed)} of {len(results)} jobs failed: {', '.join(failed)}")

    def _name_the_best(self, results: list[dict], metric: str, mode: str) -> None:
        """The parent's row in the UI says who won: the best job by `optimized_metric` and
        `optimized_mode`, its value and its overrides."""
        scored = [
            result for result in results if isinstance(result.get(metric), float) and math.isfinite(result[metric])
        ]
        if not scored:
            return
        best = (min if mode == "min" else max)(scored, key=lambda result: result[metric])
        try:
            self._client.log_metric(self._parent_run_id, f"best/{metric}", best[metric])
            self._client.set_tag(self._parent_run_id, "best.job", best["job"])
            self._client.set_tag(self._parent_run_id, "best.run_id", best.get("run_id") or "")
        except Exception as error:  # the store may be down; the summary table already says it
            log.warning(f"could not name the best job on the sweep's MLflow run: {first_line(error)}")

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        log.warning("SIGTERM received between jobs: the sweep stops, its MLflow run ends KILLED")
        self._end_parent("KILLED")
        raise SystemExit(128 + signum)

    def _end_parent(self, status: str) -> None:
        if self._parent_run_id is None:
            return
        atexit.unregister(self._end_parent)
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        try:
            self._client.set_terminated(self._parent_run_id, status=status)
        except Exception as error:  # the jobs' own runs are what matter; the store may be down
            log.warning(f"could not mark the sweep's MLflow run {self._parent_run_id} {status}: {first_line(error)}")
        self._parent_run_id = None


def summary_table(results: list[dict]) -> str:
    """A Markdown table, one row a job: readable on the console and in the MLflow UI."""

    def cell(result: dict, column: str) -> str:
        value = result.get(column, "")
        if isinstance(value, float):
            return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4f}"
        return str(value)

    scores = sorted({key for result in results for key in result if key.startswith("val/")})
    rates = sorted(
        {key for result in results for key in result if key.endswith("_per_s") and key != "train/mean_steps_per_s"}
    )
    columns = (*FIRST_COLUMNS, *scores, *rates, *LAST_COLUMNS)
    rows = [columns, *([cell(result, column) for column in columns] for result in results)]
    widths = [max(len(row[index]) for row in rows) for index in range(len(columns))]
    lines = [
        "| " + " | ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)) + " |" for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (width + 2) for width in widths) + "|")
    return "\n".join(lines)


def _job_number(path: Path) -> int:
    return int(path.parent.name) if path.parent.name.isdigit() else 0
