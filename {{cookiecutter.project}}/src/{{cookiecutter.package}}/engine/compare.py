"""`python -m {{cookiecutter.package}}.engine.compare <run> <run> [key=value ...]`, from the project's folder: two
runs side by side, the settings in which they differ, which is better by `optimized_metric`, then the
final metrics of each.

A run is named as it was trained (`name=`: its checkpoint home, else the one MLflow run of that
name) or by its MLflow run id. Its settings are those its newest checkpoint holds (the resolved
config, with what each resume changed), else its MLflow params with their `resume.<n>.<key>`
tags; either way as MLflow shows them (provenance.record), each component by its short name
(`optimizer: AdamW | SGD`, then the keys in which the two differ); a sweep's job, asked for by its
MLflow id, is labelled by its overrides. The runs are judged by the optimized_metric and
optimized_mode they trained with (the first's, where they differ): each run's best value and its
final one, each at its step, from MLflow's history of the metric, or, untracked, from the scores
its `best` and newest checkpoints hold; the better run is the one of the better best. Its metrics
are MLflow's (train/loss and val/*, the last logged, and the last step of train/loss); a run
trained with `mlflow.enabled=false` has only its checkpoint's step and score. Numbers are written
as a sweep's summary writes them (sweeps.figure). The store and the homes are the project's;
`key=value` arguments change them as they would a run's (`mlflow.tracking_uri=...`).
Nothing is written: no checkpoint is claimed or read past its checksum and pickle, and MLflow is only read.
"""

import atexit
import gc
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from mlflow import MlflowClient
from mlflow.entities import Run as Logged
from mlflow.exceptions import MlflowException
from omegaconf import DictConfig, open_dict
from sqlalchemy.exc import SQLAlchemyError

from .checkpoint.home import BEST, score_of, steps
from .checkpoint.resume import state_at
from .config import NAME, home_of
from .errors import RunError, first_line, listed, reported, shown
from .provenance import flatten
from .remembered import check_stored
from .sweeps import figure
from .tracking.mlflow_store import sqlite_file

# What names a run and where it keeps things, which differ between any two runs; global_batch is
# MLflow's alone (data.batch_size times the processes).
WHERE = ("name", "resume", "checkpoint.dir", "global_batch")
WIDEST = 40  # characters of a value shown; a longer one (a dict of globs) is cut
MODES = ("min", "max")

Point = tuple[int, float]  # a metric's value at a step


@dataclass
class Run:
    label: str  # its column's heading
    found: str  # where its settings and metrics were read
    settings: dict[str, str]
    metrics: dict[str, str]
    run_id: str | None = None  # the MLflow run whose history of optimized_metric judges it
    home: Path | None = None  # its checkpoints, whose scores judge it where MLflow has no history
    newest: dict | None = None  # what its newest checkpoint holds


def main() -> None:
    runs = [argument for argument in sys.argv[1:] if "=" not in argument]
    if len(runs) != 2:
        raise SystemExit(f"usage: python -m {__package__}.compare <run> <run> [key=value ...] (by name or MLflow id)")
    # The last thing at exit, as run.py's: the interpreter's shutdown need not search torch's and
    # MLflow's objects for garbage (0.7 s of a 6 s compare on 2 cores).
    atexit.register(gc.freeze)
    overrides = [argument for argument in sys.argv[1:] if "=" in argument]
    print(reported(lambda: compare(project_config(overrides), *runs)))


def project_config(overrides: list[str]) -> DictConfig:
    """configs/config.yaml of the project in the working folder, composed as run.py composes it."""
    folder = Path("configs").absolute()
    if not (folder / "config.yaml").is_file():
        raise RunError(f"{folder} holds no config.yaml; run this from the project's folder, where run.py is")
    try:
        with initialize_config_dir(config_dir=str(folder), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
    except HydraException as error:
        raise RunError(f"{first_line(error).rstrip('.')}; fix the key=value arguments") from None
    HydraConfig.instance().set_config(cfg)  # what ${project_root:} reads
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def compare(cfg: DictConfig, first: str, second: str) -> str:
    database = sqlite_file(cfg.mlflow.tracking_uri)
    try:
        client = None  # MLflow off, or an embedded store never made (a client would make one)
        if cfg.mlflow.enabled and (database is None or database.exists()):
            client = MlflowClient(cfg.mlflow.tracking_uri)  # opens a sqlite store: it may be locked, or no database
        runs = find(cfg, client, first), find(cfg, client, second)
        return table(*runs, judged(cfg, client, *runs))
    except (MlflowException, SQLAlchemyError) as error:
        raise RunError(unreadable(cfg.mlflow.tracking_uri, database, error)) from None


def unreadable(uri: str, database: Path | None, error: Exception) -> str:
    """The refusal of a store that failed: a server to start, a sqlite file that another process
    holds locked, or one that is no MLflow store."""
    reason = first_line(getattr(error, "orig", None) or error)  # SQLAlchemy's own error keeps sqlite's as `orig`
    alone = "or pass mlflow.enabled=false to compare the runs' checkpoints alone"
    if database is None:
        return f"MLflow at {uri} failed ({reason}); start it, {alone}"
    if "is locked" in reason:  # sqlite's SQLITE_BUSY, once its wait for the lock is over
        return f"MLflow's store {database} is locked by another process; run this again once that is done, {alone}"
    return (
        f"MLflow's store {database} could not be read ({reason}); name the store the runs logged to with "
        f"mlflow.tracking_uri=sqlite:///<path>, {alone}"
    )


def find(cfg: DictConfig, client: MlflowClient | None, asked: str) -> Run:
    """The run `asked` names: a checkpoint home, an MLflow run id, or the name of one MLflow run."""
    plain = NAME.fullmatch(asked) is not None  # a name a run may have: nothing a query or a path would misread
    home = home_of(cfg, asked) if plain else None
    if home is not None and (found := state_at(home, verify=True)) is not None:
        check_stored(found[1]["config"], found[0])  # data from anywhere: plain, or refused in one line
        return from_checkpoint(cfg, client, asked, home, found[1])
    runs = []
    if client is not None:
        run = logged(client, asked)
        runs = [run] if run else named(client, asked) if plain else []
    if len(runs) == 1:
        return from_mlflow(cfg, client, asked, runs[0])
    if runs:
        ids = [f"{run.info.run_id} ({run.info.run_name})" for run in runs]
        raise RunError(f"{len(runs)} MLflow runs are named {asked!r}: {listed(ids)}; pass one of their ids")
    raise RunError(unknown(cfg, client, asked, home))


def unknown(cfg: DictConfig, client: MlflowClient | None, asked: str, home: Path | None) -> str:
    """The refusal of a run that is nowhere, naming the runs there are: homes with checkpoints, and
    the names of MLflow's training runs."""
    homes = home_of(cfg, "-").parent  # where every run's home is made
    found = {path.name for path in homes.iterdir() if steps(path)} if homes.is_dir() else set()
    found |= {run.data.params["name"] for run in named(client, None)} if client else set()
    store = f"no MLflow run of that name or id in {cfg.mlflow.tracking_uri}" if cfg.mlflow.enabled else "MLflow is off"
    known = f"runs found: {listed(sorted(found))}" if found else "no run found"
    return f"no run {asked!r}: no checkpoint in {home or homes}, {store}; {known}"


def from_checkpoint(cfg: DictConfig, client: MlflowClient | None, asked: str, home: Path, state: dict) -> Run:
    """A run's settings from its newest checkpoint; its metrics from the MLflow run that wrote it,
    or, untracked, the checkpoint's step and score (its optimized_metric there, with keep_best)."""
    run_id = state["tracker"].get("run_id") if isinstance(state.get("tracker"), dict) else None
    if (run := logged(client, run_id)) is not None:
        where, metrics = f"MLflow run {run_id}", final_metrics(client, run)
    else:
        where = "untracked"
        if run_id is not None:
            where = f"MLflow run {run_id}, not in {cfg.mlflow.tracking_uri}" if cfg.mlflow.enabled else "MLflow off"
        score = score_of(state)
        metrics = {"step": str(state["step"])} | ({score[0]: figure(score[2])} if score else {})
    place = home.relative_to(Path.cwd()) if home.is_relative_to(Path.cwd()) else home
    found = f"{place}, step {state['step']}; {where}"
    tracked = run_id if run is not None else None
    return Run(asked, found, settings(flatten(state["config"])), metrics, tracked, home, state)


def from_mlflow(cfg: DictConfig, client: MlflowClient, asked: str, run: Logged) -> Run:
    """A run's settings from its MLflow params, each changed as its resumes' tags say (those of a
    setting: not a resume's checkpoint, nor what it ran from, `resume.<n>.git.commit`); its metrics."""
    params = dict(run.data.params)
    for resume in range(1, int(run.data.tags.get("resumes", "0")) + 1):
        prefix = f"resume.{resume}."
        params |= {
            key.removeprefix(prefix): value
            for key, value in run.data.tags.items()
            if key.startswith(prefix) and key != f"{prefix}checkpoint" and key.split(".")[2] in cfg
        }
    label = asked
    if asked == run.info.run_id:  # a sweep's job by its run name, its overrides: its `name` is its sweep's
        job = "mlflow.parentRunId" in run.data.tags and "eval.source_checkpoint" not in run.data.tags
        label = run.info.run_name if job else f"{params.get('name', '?')} ({asked[:8]})"
    return Run(label, f"MLflow run {run.info.run_id}", settings(params), final_metrics(client, run), run.info.run_id)


def logged(client: MlflowClient | None, run_id: str | None) -> Logged | None:
    """The MLflow run of `run_id`; None without a store or an id, or where the store has none such."""
    try:
        return client.get_run(run_id) if client is not None and run_id else None
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise  # a store that fails


def named(client: MlflowClient, name: str | None) -> list[Logged]:
    """The training runs named `name` (None: all), by their `name` param or as MLflow's run name; not
    the evaluations of a run (eval.py), which carry its name too."""
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    queries = [f"params.name = '{name}'", f"attributes.run_name = '{name}'"] if name else ["params.name != ''"]
    runs = {run.info.run_id: run for query in queries for run in client.search_runs(experiments, query)}
    return [run for run in runs.values() if "name" in run.data.params and "eval.source_checkpoint" not in run.data.tags]


def settings(flat: dict[str, str]) -> dict[str, str]:
    """A run's flattened settings as its MLflow params show them (provenance.record): a component by
    its short name, a null setting absent, amp.dtype only with amp on; less WHERE and mlflow.*."""
    params = {
        key.removesuffix("._target_"): value.rsplit(".", 1)[-1] if key.endswith("._target_") else value
        for key, value in flat.items()
        if value != "None" and key not in WHERE and not key.startswith("mlflow.")
    }
    if params.get("amp.enabled") == "False":
        params.pop("amp.dtype", None)
    return params


def final_metrics(client: MlflowClient, run: Logged) -> dict[str, str]:
    """train/loss and val/*, each its last value, and the last step train/loss was logged at."""
    history = client.get_metric_history(run.info.run_id, "train/loss")
    metrics = {
        key: figure(value) for key, value in run.data.metrics.items() if key == "train/loss" or key.startswith("val/")
    }
    return {"step": str(max(metric.step for metric in history)) if history else "-", **metrics}


def judged(cfg: DictConfig, client: MlflowClient | None, first: Run, second: Run) -> tuple[list[list[str]], list[str]]:
    """The two runs by optimized_metric and optimized_mode, the first's where they differ (said in a
    line): each run's best and final value, each at its step, in rows; then a line naming the better
    by best value."""
    (metric, mode), theirs = (optimized_by(cfg, run) for run in (first, second))
    notes = []
    if theirs != (metric, mode):
        notes.append(
            f"the runs optimize {shown(metric)} ({mode}) and {shown(theirs[0])} ({theirs[1]}): judged by the first's"
        )
    (best, final), (other_best, other_final) = (best_and_final(client, run, metric, mode) for run in (first, second))
    rows = [
        cells(f"{metric} ({mode})", first.label, second.label),
        cells("best", at(best), at(other_best)),
        cells("final", at(final), at(other_final)),
    ]
    said = f"better by best {shown(metric)} ({mode}): "
    if best is None or other_best is None:
        lacking = [shown(run.label) for run, point in ((first, best), (second, other_best)) if point is None]
        notes.append(f"{said}unknown: {' and '.join(lacking)} has no finite value of it")
    elif best[1] == other_best[1]:
        notes.append(f"{said}neither, a tie at {figure(best[1])}")
    else:
        first_wins = (best[1] < other_best[1]) == (mode == "min")
        (winner, won), lost = ((first, best), other_best) if first_wins else ((second, other_best), best)
        notes.append(f"{said}{shown(winner.label)}, {at(won)} against {at(lost)}")
    return rows, notes


def optimized_by(cfg: DictConfig, run: Run) -> tuple[str, str]:
    """The optimized_metric and optimized_mode `run` trained with; the project's where it says none."""
    metric, mode = run.settings.get("optimized_metric"), run.settings.get("optimized_mode")
    return (metric, mode) if metric and mode in MODES else (cfg.optimized_metric, cfg.optimized_mode)


def best_and_final(client: MlflowClient | None, run: Run, metric: str, mode: str) -> tuple[Point | None, Point | None]:
    """`run`'s best value of `metric` by `mode` (the earliest of equals) and its final one, each with
    its step: from its MLflow run's history of it; without one, from the scores its checkpoints hold
    (the `best` one's, the newest's), where they are scores by `metric` and `mode`."""
    history = client.get_metric_history(run.run_id, metric) if client is not None and run.run_id else []
    if history:
        logged = sorted((entry.step, entry.timestamp, entry.value) for entry in history)
        finite = [(step, value) for step, _, value in logged if math.isfinite(value)]
        best = (min if mode == "min" else max)(finite, key=lambda point: point[1]) if finite else None
        return best, (logged[-1][0], logged[-1][2])
    best = state_at(run.home / BEST, verify=True) if run.home is not None else None
    return scored(best and best[1], metric, mode), scored(run.newest, metric, mode)


def scored(state: dict | None, metric: str, mode: str) -> Point | None:
    """The step of a checkpoint and the score it holds, if that is a score by `metric` and `mode`."""
    score = score_of(state) if state is not None else None
    return (state["step"], score[2]) if score is not None and score[:2] == (metric, mode) else None


def at(point: Point | None) -> str:
    return f"{figure(point[1])} at step {point[0]}" if point is not None else "-"


def table(first: Run, second: Run, judgement: tuple[list[list[str]], list[str]]) -> str:
    """Where each run was read, then the settings that differ, the runs judged by optimized_metric
    (`judged`) and the final metrics, in columns."""
    differ = sorted(key for key in first.settings.keys() | second.settings.keys()
                    if first.settings.get(key) != second.settings.get(key))  # fmt: skip
    metrics = ["step", *sorted((first.metrics.keys() | second.metrics.keys()) - {"step"})]
    differing = [cells(key, first.settings.get(key, "-"), second.settings.get(key, "-")) for key in differ]
    judging, notes = judgement
    blocks = [
        [cells("setting", first.label, second.label), *(differing or [cells("(all the same)", "", "")])],
        judging,
        [cells("metric", first.label, second.label)]
        + [cells(key, first.metrics.get(key, "-"), second.metrics.get(key, "-")) for key in metrics],
    ]
    widths = [max(len(row[column]) for block in blocks for row in block) for column in range(3)]
    lines = [f"{run.label}: {run.found}" for run in (first, second)]
    for block in blocks:
        lines.append("")
        lines += [
            " | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in block
        ]
        lines += notes if block is judging else []
    return "\n".join(lines)


def cells(*texts: str) -> list[str]:
    """The texts of a row, each without control characters (a checkpoint's values are data from
    anywhere) and cut to WIDEST."""
    return [text if len(text) <= WIDEST else text[: WIDEST - 3] + "..." for text in map(shown, texts)]


if __name__ == "__main__":
    main()
