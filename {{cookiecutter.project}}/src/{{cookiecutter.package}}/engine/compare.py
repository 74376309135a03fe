"""`python -m {{cookiecutter.package}}.engine.compare <run> <run> [key=value ...]`, from the project's folder: two
runs side by side, the settings in which they differ, then the final metrics of each.

A run is named as it was trained (`name=`: its checkpoint home, else the one MLflow run of that
name) or by its MLflow run id. Its settings are those its newest checkpoint holds (the resolved
config, with what each resume changed), else its MLflow params with their `resume.<n>.<key>`
tags; either way as MLflow shows them (provenance.record), each component by its short name
(`optimizer: AdamW | SGD`, then the keys in which the two differ). Its metrics are MLflow's
(train/loss and val/*, the last logged, and the last step of train/loss); a run trained with
`mlflow.enabled=false` has only its checkpoint's step and score. The store and the homes are the
project's; `key=value` arguments change them as they would a run's (`mlflow.tracking_uri=...`).
Nothing is written: no checkpoint is claimed or read past its pickle, and MLflow is only read.
"""

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

from .checkpoint.files import load_restricted
from .checkpoint.home import steps
from .checkpoint.schema import STATE
from .config import NAME, home_of
from .errors import CheckpointError, RunError, first_line, listed, reported
from .mlflow_store import sqlite_file
from .provenance import flatten

# What names a run and where it keeps things, which differ between any two runs; global_batch is
# MLflow's alone (data.batch_size times the processes).
WHERE = ("name", "resume", "checkpoint.dir", "global_batch")
WIDEST = 40  # characters of a value shown; a longer one (a dict of globs) is cut


@dataclass
class Run:
    label: str  # its column's heading
    found: str  # where its settings and metrics were read
    settings: dict[str, str]
    metrics: dict[str, str]


def main() -> None:
    runs = [argument for argument in sys.argv[1:] if "=" not in argument]
    if len(runs) != 2:
        raise SystemExit(f"usage: python -m {__package__}.compare <run> <run> [key=value ...] (by name or MLflow id)")
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
    client = None  # MLflow off, or an embedded store never made (a client would make one)
    if cfg.mlflow.enabled and (database is None or database.exists()):
        client = MlflowClient(cfg.mlflow.tracking_uri)
    try:
        return table(find(cfg, client, first), find(cfg, client, second))
    except MlflowException as error:
        raise RunError(
            f"MLflow at {cfg.mlflow.tracking_uri} failed ({first_line(error)}); start it, or pass "
            f"mlflow.enabled=false to compare the runs' checkpoints alone"
        ) from None


def find(cfg: DictConfig, client: MlflowClient | None, asked: str) -> Run:
    """The run `asked` names: a checkpoint home, an MLflow run id, or the name of one MLflow run."""
    plain = NAME.fullmatch(asked) is not None  # a name a run may have: nothing a query or a path would misread
    home = home_of(cfg, asked) if plain else None
    if home is not None and (state := newest_state(home)) is not None:
        return from_checkpoint(cfg, client, asked, home, state)
    runs = []
    if client is not None:
        run = logged(client, asked)
        runs = [run] if run else named(client, asked) if plain else []
    if len(runs) == 1:
        return from_mlflow(client, asked, runs[0])
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
        score = state.get("score") or {}
        metrics = {"step": str(state["step"])} | ({score["metric"]: f"{score['value']:.4f}"} if score else {})
    shown = home.relative_to(Path.cwd()) if home.is_relative_to(Path.cwd()) else home
    return Run(asked, f"{shown}, step {state['step']}; {where}", settings(flatten(state["config"])), metrics)


def from_mlflow(client: MlflowClient, asked: str, run: Logged) -> Run:
    """A run's settings from its MLflow params, each changed as its resumes' tags say; its metrics."""
    params = dict(run.data.params)
    for resume in range(1, int(run.data.tags.get("resumes", "0")) + 1):
        prefix = f"resume.{resume}."
        params |= {
            key.removeprefix(prefix): value
            for key, value in run.data.tags.items()
            if key.startswith(prefix) and key != f"{prefix}checkpoint"
        }
    label = f"{params.get('name', '?')} ({asked[:8]})" if asked == run.info.run_id else asked
    return Run(label, f"MLflow run {run.info.run_id}", settings(params), final_metrics(client, run))


def newest_state(home: Path) -> dict | None:
    """What the newest readable checkpoint in `home` holds besides its tensors; None without one."""
    for _, path in sorted(steps(home), reverse=True):
        try:
            state = load_restricted(path / STATE if path.is_dir() else path, path, device="meta")
        except CheckpointError:
            continue
        if isinstance(state, dict) and isinstance(state.get("config"), dict) and isinstance(state.get("step"), int):
            return state
    return None


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
    shown = {
        key.removesuffix("._target_"): value.rsplit(".", 1)[-1] if key.endswith("._target_") else value
        for key, value in flat.items()
        if value != "None" and key not in WHERE and not key.startswith("mlflow.")
    }
    if shown.get("amp.enabled") == "False":
        shown.pop("amp.dtype", None)
    return shown


def final_metrics(client: MlflowClient, run: Logged) -> dict[str, str]:
    """train/loss and val/*, each its last value, and the last step train/loss was logged at."""
    history = client.get_metric_history(run.info.run_id, "train/loss")
    metrics = {
        key: f"{value:.4f}" for key, value in run.data.metrics.items() if key == "train/loss" or key.startswith("val/")
    }
    return {"step": str(max(metric.step for metric in history)) if history else "-", **metrics}


def table(first: Run, second: Run) -> str:
    """Where each run was read, then the settings that differ and the final metrics, in columns."""
    differ = sorted(key for key in first.settings.keys() | second.settings.keys()
                    if first.settings.get(key) != second.settings.get(key))  # fmt: skip
    metrics = ["step", *sorted((first.metrics.keys() | second.metrics.keys()) - {"step"})]
    differing = [cells(key, first.settings.get(key, "-"), second.settings.get(key, "-")) for key in differ]
    blocks = [
        [cells("setting", first.label, second.label), *(differing or [cells("(all the same)", "", "")])],
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
    return "\n".join(lines)


def cells(*texts: str) -> list[str]:
    return [text if len(text) <= WIDEST else text[: WIDEST - 3] + "..." for text in texts]


if __name__ == "__main__":
    main()
