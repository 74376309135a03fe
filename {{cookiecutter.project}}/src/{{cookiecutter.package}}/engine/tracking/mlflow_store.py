"""The MLflow store, in the processes that talk to it: the URI checked, the client, the project's
experiment (its artifacts following a moved store), what a run records (origin, datasets, tags)
and its end; which run a leg writes into is mlflow_run.py's. Used by the sender process
(sender.py), the launching process of a sweep (its parent run) and `replay`. The training process
itself never imports this module, or MLflow: the import alone is 2 s of start-up (tracker.py is
its side).
"""

import contextlib
import json
import logging
import os
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, RunTag
from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException
from mlflow.utils.uri import get_uri_scheme
from sqlalchemy.engine import make_url

from ..config import MlflowConfig
from ..errors import RunError, first_line
from .origin import origin
from .unsent import replay_command, spill

try:  # MLflow's own table of store schemes, plugins included; private, so a newer MLflow may lack it
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry
except ImportError:
    _tracking_store_registry = None

log = logging.getLogger(__name__)

# MLflow's HTTP client retries with exponential backoff: with the server gone, one call could
# block for minutes. Bounded here; a user's own setting wins.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
# MLflow logs the traceback of a database error and then raises it; every store call here
# catches it and says it in one line, so the traceback would only bury that line.
logging.getLogger("mlflow.store.db.utils").addFilter(lambda record: record.exc_info is None)
# A new sqlite store's tables are made by MLflow as it opens it, each step said at INFO (MLflow's and
# alembic's): lines about MLflow's own schema, in the first run of every project. Warnings stay.
for _name in ("mlflow.store.db.utils", "alembic"):
    logging.getLogger(_name).setLevel(max(logging.getLogger(_name).getEffectiveLevel(), logging.WARNING))

FOLLOWS_STORE = "artifacts_follow_store"  # tags the experiments whose artifacts live beside the store
# MLflow 3's UI opens an experiment without a kind in its GenAI view (an empty traces page) and
# asks which kind it is; this tag opens this project's experiments on their runs and charts.
KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def check_uri(cfg: MlflowConfig) -> None:
    """tracking.check_tracking_uri, for a URI that needs MLflow to tell: refuses, in one line, one
    this MLflow cannot open (no store is opened, no network)."""
    uri = cfg.tracking_uri
    asked = f"mlflow.tracking_uri={uri}"
    instead = "use mlflow.tracking_uri=sqlite:///<folder>/mlflow.db or http://<host>:<port>, or mlflow.enabled=false"
    scheme = get_uri_scheme(uri)
    if scheme == "" and not MLFLOW_ALLOW_FILE_STORE.get():
        raise RunError(f"{asked} is not a URI (MLflow would take it for a file store folder); {instead}")
    if scheme == "file" and not MLFLOW_ALLOW_FILE_STORE.get():
        raise RunError(
            f"{asked} is a file store, which MLflow {mlflow.__version__} no longer opens (maintenance mode); "
            f"{instead} (`mlflow migrate-filestore` moves old runs into a database)"
        )
    try:
        if _tracking_store_registry is not None:  # without it, the sender warns when it cannot connect
            _tracking_store_registry.get_store_builder(uri)
    except UnsupportedModelRegistryStoreURIException:
        raise RunError(f"{asked}: MLflow {mlflow.__version__} knows no store at {scheme}://; {instead}") from None
    if scheme in ("http", "https") and not urlparse(uri).hostname:
        raise RunError(f"{asked} names no server; {instead}")


def connect(tracking_uri: str) -> MlflowClient:
    """A client of `tracking_uri`, after re-pointing the artifacts of a sqlite store that moved."""
    _follow_moved_store(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


# A resume's own origin tags, beside the first leg's: `resume.<n>.git.commit` (MLflow's own name,
# mlflow.source.git.commit, stays the first leg's, which the UI shows as the run's source).
LEG_TAGS = {"mlflow.source.git.commit": "git.commit"}


def record_origin(client: MlflowClient, run_id: str, resumes: int, untracked_content: bool) -> None:
    """What the run ran from (origin.py), from the folder this process started in, the trainer's:
    the tags `mlflow.source.git.commit`, `git.dirty` and `template.version`, and the artifacts
    `provenance/requirements.txt` and, from a tree with uncommitted changes, `provenance/git.diff`.
    Each leg keeps its own: a resume records its tags as `resume.<n>.template.version`,
    `resume.<n>.git.commit` and `resume.<n>.git.dirty`, and its files under `provenance/resume.<n>/`,
    so that the first leg's stay as they were (a `cruft update` or a commit between two legs shows).
    A failure costs a warning: the run goes on."""
    folder = "provenance" if resumes == 0 else f"provenance/resume.{resumes}"
    try:
        tags, files = origin(Path.cwd(), untracked_content)
        if resumes:
            tags = {f"resume.{resumes}.{LEG_TAGS.get(key, key)}": value for key, value in tags.items()}
        for name, text in files.items():
            client.log_text(run_id, text, f"{folder}/{name}")
        set_tags(client, run_id, tags)
    except Exception as error:
        log.warning(f"MLflow did not take what the run ran from, {folder}/ and its tags ({first_line(error)})")


def log_datasets(client: MlflowClient, run_id: str, datasets: list[dict]) -> None:
    """The data the run reads (provenance.datasets) as its dataset inputs, each split under its
    context; MLflow keeps one input per dataset and context, so a resume logs them again harmlessly."""
    inputs = [
        DatasetInput(
            Dataset(
                name=dataset["name"],
                digest=dataset["digest"],
                source_type="code",
                source=json.dumps({"tags": {"_target_": dataset["source"]}}),
                profile=json.dumps({"num_samples": dataset["samples"]}),
            ),
            tags=[InputTag("mlflow.data.context", dataset["context"])],
        )
        for dataset in datasets
    ]
    if inputs:
        client.log_inputs(run_id, datasets=inputs)


def set_tags(client: MlflowClient, run_id: str, tags: dict[str, str]) -> None:
    try:
        in_batches(client, run_id, tags=[RunTag(key, value) for key, value in tags.items()])
    except Exception as error:  # a store that is down must not end the run
        log.warning(f"could not tag MLflow run {run_id}: {first_line(error)}")


def in_batches(client: MlflowClient, run_id: str, **entities: list) -> None:
    """`log_batch` of the params or tags given, in calls of 100 at most: MLflow's limit per call."""
    for kind, items in entities.items():
        for start in range(0, len(items), 100):
            client.log_batch(run_id, **{kind: items[start : start + 100]})


def experiment_id(client: MlflowClient, cfg: MlflowConfig) -> str:
    """The id of `mlflow.experiment_name`, created on first use, of the model-training kind."""
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    if experiment is not None and experiment.lifecycle_stage == "deleted":  # its name is still taken
        raise RunError(deleted_experiment(experiment, cfg.tracking_uri))
    if experiment is not None:
        if KIND not in experiment.tags:  # created before this project set it, or by hand
            client.set_experiment_tag(experiment.experiment_id, KIND, MODEL_TRAINING)
        return experiment.experiment_id
    database = sqlite_file(cfg.tracking_uri)
    if database is None:  # a server decides for itself
        return client.create_experiment(cfg.experiment_name, tags={KIND: MODEL_TRAINING})
    # Beside the store, not in whatever folder the job started from.
    location = (database.parent / "mlruns").as_uri()
    tags = {KIND: MODEL_TRAINING, FOLLOWS_STORE: "true"}
    return client.create_experiment(cfg.experiment_name, artifact_location=location, tags=tags)


def deleted_experiment(experiment: Any, tracking_uri: str, what_else: str = "") -> str:
    return (
        f"the MLflow experiment {experiment.name!r} is deleted{what_else}; restore it with `MLFLOW_TRACKING_URI="
        f"{tracking_uri} mlflow experiments restore --experiment-id {experiment.experiment_id}`, or log to "
        f"another with mlflow.experiment_name=<name>"
    )


def sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of an embedded sqlite store; None for any other store."""
    if get_uri_scheme(tracking_uri) != "sqlite":
        return None
    database = make_url(tracking_uri).database
    if not database or database == ":memory:":
        return None
    return Path(database).absolute()


def _follow_moved_store(tracking_uri: str) -> None:
    """Points the artifacts of a sqlite store that was moved or copied to `<its folder>/mlruns`.

    MLflow keeps artifact locations as absolute URIs in the store: `create_experiment` resolves
    even a relative location against the working folder (`mlflow.utils.uri.resolve_uri_if_local`),
    and `create_run` fixes each run's `artifact_uri` as its experiment's location plus
    `<run id>/artifacts`. No MLflow call changes either, so after the project folder moves
    the store still names the old folder: new runs would recreate it, old artifacts would be
    out of reach. So the two columns are rewritten here, in the store's own tables
    (`experiments.artifact_location`, `runs.artifact_uri`), for the experiments this project
    created beside the store (tagged `artifacts_follow_store`) and only when their location
    is a `file:` URI of an `mlruns` folder: a location a user chose is never touched.
    """
    database = sqlite_file(tracking_uri)
    if database is None or not database.exists():  # a new store: nothing to re-point
        return
    here = (database.parent / "mlruns").as_uri()
    with contextlib.closing(sqlite3.connect(database, timeout=20)) as db, db:
        try:
            moved = db.execute(
                "SELECT experiments.experiment_id, artifact_location FROM experiments JOIN experiment_tags"
                " ON experiment_tags.experiment_id = experiments.experiment_id"
                " WHERE experiment_tags.key = ? AND artifact_location != ?",
                (FOLLOWS_STORE, here),
            ).fetchall()
        except sqlite3.OperationalError:  # no tables yet: MLflow creates them when it connects
            return
        for experiment, there in moved:
            if not (there.startswith("file:") and there.endswith("/mlruns")):
                continue
            db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?", (here, experiment))
            db.execute(
                "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?)"
                " WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                (here, len(there) + 1, experiment, len(there) + 1, there + "/"),
            )


def end_run(client: MlflowClient, run_id: str, end: dict, spill_file: Path) -> None:
    """Ends the run with `end` (status, end time, resumes so far); if the store refuses, appends
    the end to `spill_file` for `replay`. The caller must be the only writer of `spill_file`."""
    try:
        client.set_terminated(run_id, status=end["status"], end_time=end["end_time"])
    except Exception as error:
        try:
            written = spill(spill_file, [{"run_id": run_id, **end}])
        except OSError as failure:
            log.warning(
                f"could not mark MLflow run {run_id} {end['status']}, nor record that in {spill_file} ({failure.strerror})"
            )
            return
        log.warning(
            f"could not mark MLflow run {run_id} {end['status']} ({first_line(error)}); that is recorded in "
            f"{written}, and `{replay_command(written)}` ends the run when the store is back"
        )
