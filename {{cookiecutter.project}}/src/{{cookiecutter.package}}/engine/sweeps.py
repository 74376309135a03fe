"""Multirun sweeps (`python run.py -m optimizer=adamw,sgd optimizer.lr=1e-3,3e-3`).

Each sweep gets a parent MLflow run, and each job a child run named by its overrides (a path by
its last part), so the UI groups and compares them. The parent is made by `SweepCallback` in the
launching process, and jobs find its id in a file in the sweep folder: that works for launchers
that run jobs in this process, in local worker processes, or on SLURM nodes. Each job also writes its result there,
and the callback turns the results into a summary table at the end, which names the best job.

A job fails alone: its error is recorded and the other jobs run. Each job's checkpoints live in
`checkpoint.dir/<its overrides>`, less the settings a continuation changes (configs/config.yaml lists
them: trainer.max_steps, cadences, device, ...), so the same sweep run again with `resume=auto`, and
a larger `trainer.max_steps` if it likes, continues every job that had started, in its own MLflow
run, and starts the others; the sweep's own MLflow run takes the new summary. So does a sweep whose
grid has grown (`optimizer.lr=1e-3,3e-3` then `optimizer.lr=1e-3,3e-3,1e-2`): its new jobs join
the same sweep run; one that drops values, or sweeps other settings, is a sweep of its own.
"""

import atexit
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Set
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, ValueType
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .errors import RunError, first_line, listed
from .files import read_regular, write_text
from .signals import Stopped
from .tracking.tracker import check_tracking_uri

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

log = logging.getLogger(__name__)

PARENT_RUN_FILE = "mlflow_parent_run_id"
SWEPT_FILE = "swept_keys.json"  # settings that continue a job, but that this sweep sweeps: they name its jobs
RESULT_FILE = "job_result.json"
GRID = "<grid>"  # stands in a sweep's key for the values its grid lists, which its run's `sweep.grid` tag holds
# The table's columns; every val/<metric> the jobs report, then their throughput over the whole
# job in the task's unit (train/mean_samples_per_s, train/mean_tokens_per_s), go between these two groups.
FIRST_COLUMNS = ("job", "status", "train/loss")
LAST_COLUMNS = ("continuity", "run_id", "error")


@dataclass
class Job:
    """One job of a sweep, as the job sees itself."""

    key: str  # its overrides, less those that a continuation changes (resume, trainer.max_steps, device, ...)
    title: str  # the same, each path by its last part: its MLflow run's name and its row in the summary
    parent_run_id: str | None
    output_dir: Path
    continuing: frozenset[str] = frozenset()  # the settings left out of the key

    def run(self, train: Callable[[DictConfig], dict], cfg: DictConfig) -> float | None:
        """Trains in the job's own checkpoint folder and MLflow child run, records the result,
        and returns the job's `optimized_metric`: the value a search sweeper minimizes or maximizes
        (`optimized_mode`). An error is recorded, not raised, so the other jobs still run."""
        if cfg.init.checkpoint is not None:  # a run's name: its home, not one under this job's
            from .checkpoint.resume import locate  # torch: not in the launching process

            cfg.init.checkpoint = str(locate(cfg, cfg.init.checkpoint))
        cfg.checkpoint.dir = str(self._home(Path(cfg.checkpoint.dir), cfg.resume))
        cfg.mlflow.run_name = cfg.mlflow.run_name or self.title
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
            log.error(f"job {self.title} failed:\n{traceback.format_exc()}")
            result = {"status": "FAILED", "error": f"{type(error).__name__}: {error}"}
        self._record(result)
        return result.get(cfg.optimized_metric)

    def _home(self, root: Path, resume: str | None) -> Path:
        """`root/<key>`; or, continuing a job whose checkpoints are only in a folder named before
        the settings a continuation changes left its name (`...,trainer.max_steps=30`), that one."""
        from .checkpoint.home import has_checkpoints  # torch: not in the launching process

        home = root / self.key
        if resume is None or has_checkpoints(home) or not root.is_dir():
            return home
        old = [
            folder for folder in sorted(root.iterdir())
            if folder != home and has_checkpoints(folder) and _less(folder.name, self.continuing) == self.key
        ]  # fmt: skip
        if len(old) > 1:
            raise RunError(
                f"the checkpoints of job {self.key} are in {len(old)} folders named the old way: "
                f"{', '.join(map(str, old))}; rename the one to continue to {home}"
            )
        if old:
            log.info(f"continuing job {self.key} in {old[0]}, named the old way (`mv` it to {home} to rename it)")
            return old[0]
        return home

    def _record(self, result: dict) -> None:
        if os.environ.get("RANK", "0") == "0":  # a job of several SLURM tasks has one result
            write_text(self.output_dir / RESULT_FILE, json.dumps({"job": self.title, **result}))


def current_job() -> Job | None:
    """The sweep job this process is running, or None outside a multirun."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    from .provenance import titled  # torch: in the job's process, not the launching one

    hydra = HydraConfig.get()
    parent_file, swept_file = Path(hydra.sweep.dir) / PARENT_RUN_FILE, Path(hydra.sweep.dir) / SWEPT_FILE
    swept = json.loads(read_regular(swept_file)) if swept_file.exists() else []
    continuing = frozenset(hydra.job.config.override_dirname.exclude_keys) - set(swept)
    return Job(
        key=named(hydra.overrides.task, continuing),
        title=titled(hydra.overrides.task, continuing) or "defaults",
        parent_run_id=read_regular(parent_file).decode().strip() if parent_file.exists() else None,
        output_dir=Path(hydra.runtime.output_dir),
        continuing=continuing,
    )


def named(overrides: list[str], continuing: Set[str]) -> str:
    """A job's key, as Hydra's override_dirname: its sorted overrides, less those that continue a
    job; its checkpoint folder's and its MLflow run's name."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    return ",".join(_naming(parsed, continuing)).replace("/", "_") or "defaults"


def _naming(parsed: list[Override], continuing: Set[str]) -> list[str]:
    """The overrides that name a job or a sweep, sorted as Hydra's override_dirname sorts them."""
    return sorted(override.input_line for override in parsed if override.key_or_group not in continuing)


def _less(name: str, continuing: Set[str]) -> str:
    """A job folder's name without the settings that continue a job (split where a `key=` starts,
    since a value may hold commas)."""
    items = re.split(r",(?=[+~]*[\w.@-]+=)", name)
    return ",".join(item for item in items if item.split("=", 1)[0].lstrip("+~") not in continuing) or "defaults"


def swept_keys(config: DictConfig) -> tuple[list[Override], list[str]]:
    """The sweep line's parsed overrides, and the settings it sweeps (a list of values, a range, or a
    sweeper's `params`)."""
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    return parsed, sorted({override.key_or_group for override in parsed if override.is_sweep_override()} | set(params))


def sweep_key(config: DictConfig) -> tuple[str, dict[str, list[str]]]:
    """What names a sweep, so that the same sweep continued (`resume=auto`, a larger
    `trainer.max_steps`, more values in its grid) finds its MLflow run again: its `name`, and its
    sweep line and sweeper overrides, less the settings that continue a job, each list or range of
    values by its key alone (`optimizer.lr=<grid>`); and those values, key by key (its grid). A sweep
    that Hydra expands otherwise (`glob(...)`, a search's `interval(...)`) is named as typed."""
    parsed, swept = swept_keys(config)
    continuing = set(config.hydra.job.config.override_dirname.exclude_keys) - set(swept)
    grid, task = {}, []
    for override in parsed:
        if override.key_or_group in continuing:
            continue
        if override.value_type in (ValueType.SIMPLE_CHOICE_SWEEP, ValueType.CHOICE_SWEEP, ValueType.RANGE_SWEEP):
            grid[override.key_or_group] = sorted(set(override.sweep_string_iterator()))
            task.append(f"{override.input_line.split('=', 1)[0]}={GRID}")
        else:
            task.append(override.input_line)
    sweeper = sorted(
        line for line in config.hydra.overrides.hydra if line.startswith(("hydra/sweeper", "hydra.sweeper."))
    )
    return " ".join([f"name={config.name}", *sorted(task), *sweeper]), grid


def dropped(before: dict[str, list[str]], now: dict[str, list[str]]) -> list[str]:
    """The values of the grid `before` that the grid `now` lacks, as `key=value`: none where `now`
    extends `before` (the same keys, each with the values it had and maybe more)."""
    return [f"{key}={value}" for key, values in before.items() for value in values if value not in now.get(key, ())]


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
        # `-m trainer.max_steps=100,200` compares lengths: two jobs, each named by its max_steps.
        write_text(sweep_dir / SWEPT_FILE, json.dumps(swept_keys(config)[1]))
        if not config.mlflow.enabled:
            return
        try:  # before any job: each would fail on it alone
            check_tracking_uri(config.mlflow)
        except RunError as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        from .tracking.mlflow_store import (  # MLflow in the launching process only, not in each job's
            connect,
            experiment_id,
        )

        try:
            self._client = connect(config.mlflow.tracking_uri)
            experiment = experiment_id(self._client, config.mlflow)
            key, grid = sweep_key(config)
            tags = {"sweep.dir": str(sweep_dir), "sweep.key": key, "sweep.grid": json.dumps(grid)}
            asked = f"resume={config.resume}"
            run = self._continued(experiment, key, grid, asked) if config.resume is not None else None
            if run is None:
                run = self._client.create_run(experiment, run_name=f"sweep {sweep_dir.name}", tags=tags)
            else:
                self._client.update_run(run.info.run_id, status="RUNNING")
                for tag, value in tags.items():
                    self._client.set_tag(run.info.run_id, tag, value)
        except Exception as error:  # the jobs can still run, and each tries MLflow itself
            log.warning(f"MLflow failed ({first_line(error)}); the sweep runs without a parent run")
            return
        self._parent_run_id = run.info.run_id
        write_text(sweep_dir / PARENT_RUN_FILE, self._parent_run_id)
        atexit.register(self._end_parent, "KILLED")
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._stop)

    def _continued(self, experiment: str, key: str, grid: dict[str, list[str]], asked: str) -> "Run | None":
        """The newest MLflow run of the sweep `key` names, where `grid` holds every value its grid
        held: its jobs' runs are its children, so a continued sweep, its grid grown or not, reports to
        it rather than leave it with a stale summary. A grid that drops some of them, or a sweep of
        other settings, is another sweep: None, said in one line. (MLflow's filter has no escapes: a
        key with both quotes in it gets a new run.)"""
        quote = next((quote for quote in "\"'" if quote not in key), None)
        if quote is None:
            return None
        runs = self._client.search_runs(
            [experiment],
            f"tags.`sweep.key` = {quote}{key}{quote}",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not runs:
            log.info(f"{asked}: no sweep in MLflow has this line's settings ({key}): a new sweep run holds its jobs")
            return None
        run = runs[0]
        before = json.loads(run.data.tags.get("sweep.grid", "{}"))
        if lacking := dropped(before, grid):
            log.info(
                f"{asked}: this line drops {listed(lacking)} of the sweep MLflow run {run.info.run_id} "
                f"({run.info.run_name}) swept: a new sweep run holds its jobs; add them back to continue that one"
            )
            return None
        added = dropped(grid, before)
        more = f", its grid grown by {listed(added)}" if added else ""
        log.info(f"continuing the sweep's MLflow run {run.info.run_id} ({run.info.run_name}){more}")
        return run

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = [
            json.loads(read_regular(path)) for path in sorted(sweep_dir.glob(f"*/{RESULT_FILE}"), key=_job_number)
        ]
        metric, mode = config.optimized_metric, config.optimized_mode
        table = summary_table(results, metric, mode)
        log.info(f"sweep summary ({sweep_dir}):\n{table}")
        failed = [result["job"] for result in results if result["status"] != "FINISHED"]
        if self._parent_run_id is not None:
            self._client.log_text(self._parent_run_id, table, "summary.md")
            self._name_the_best(winner(results, metric, mode), metric)
            self._end_parent("FAILED" if failed else "FINISHED")
        if failed:
            raise SystemExit(f"{len(failed)} of {len(results)} jobs failed: {', '.join(failed)}")

    def _name_the_best(self, best: dict | None, metric: str) -> None:
        """The parent's row in the UI says who won (`winner`): its value and its overrides."""
        if best is None:
            return
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


def winner(results: list[dict], metric: str, mode: str) -> dict | None:
    """The result of the best job by `metric` (optimized_metric) and `mode` (optimized_mode), the first
    of equals; None where no job reported a finite value of it."""
    scored = [result for result in results if isinstance(result.get(metric), float) and math.isfinite(result[metric])]
    return (min if mode == "min" else max)(scored, key=lambda result: result[metric]) if scored else None


def figure(value: float) -> str:
    """A metric's value as a person reads it here and in compare.py: four significant digits in plain
    notation (0.2046, 559.2), whole from 1000 up (2038, 14157 tokens/s); no thousands separator, no
    1.416e+04."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def summary_table(results: list[dict], metric: str, mode: str) -> str:
    """A Markdown table, one row a job, and under it the best job by `metric` and `mode` (`winner`):
    readable on the console and in the MLflow UI."""

    def cell(result: dict, column: str) -> str:
        value = result.get(column, "")
        return figure(value) if isinstance(value, float) else str(value)

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
    best = winner(results, metric, mode)
    said = f"{best['job']}, {figure(best[metric])}" if best else f"none: no job reported a finite {metric}"
    return "\n".join([*lines, "", f"best by {metric} ({mode}): {said}"])


def _job_number(path: Path) -> int:
    return int(path.parent.name) if path.parent.name.isdigit() else 0
