"""The MLflow store, in the processes that talk to it: the URI checked, the client, the run opened
or continued (and the project's experiment, its artifacts following a moved store), what a run
records (origin, datasets, tags) and its end. Used by the sender process (sender.py), the
launching process of a sweep (its parent run) and `replay`. The training process itself never
imports this module, or MLflow: the import alone is 2 s of start-up (tracking.py is its side).
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
from mlflow.entities import Dataset, DatasetInput, InputTag, Param
from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
from mlflow.exceptions import MlflowException
from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException
from mlflow.utils.uri import get_uri_scheme
from sqlalchemy.engine import make_url

from .config import MlflowConfig
from .errors import RunError, first_line
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


class RunOpener:
    """Opens the job's run: a new one, with the flattened config as params and the resolved config
    as an artifact; or, resuming, the run that wrote the checkpoint, so its curves stay one line in
    the UI. Params are immutable in MLflow: what changed since the run began goes into tags named
    `resume.<n>.<key>`. A run missing from this store (a copied checkpoint, a new store) gets a
    new run, tagged with the checkpoint it continues."""

    def __init__(self, client: MlflowClient, cfg: MlflowConfig) -> None:
        self.client, self.cfg = client, cfg
        self.parent_tags = {"mlflow.parentRunId": cfg.parent_run_id} if cfg.parent_run_id else {}
        self.run_id: str | None = None
        self.resumes = 0

    def create(self, params: dict[str, str], tags: dict[str, str], config_yaml: str, started: int | None) -> None:
        """A new run, started at `started` (ms since the epoch): when the training process set it up,
        not when this process got to it, which may be seconds later (MLflow's Duration)."""
        experiment = self._parents_experiment() or experiment_id(self.client, self.cfg)
        tags = {**tags, **self.parent_tags}
        run = self.client.create_run(experiment, start_time=started, run_name=self.cfg.run_name, tags=tags)
        self.run_id = run.info.run_id
        self._log_params(params)
        self.client.log_text(self.run_id, config_yaml, "config.yaml")

    def continue_(
        self,
        run_id: str | None,
        params: dict[str, str],
        tags: dict[str, str],
        config_yaml: str,
        checkpoint: str,
        started: int | None,
    ) -> None:
        try:
            run = self.client.get_run(run_id) if run_id else None
        except MlflowException:
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            if run_id is None:
                log.info("the checkpoint was written untracked; continuing in a new MLflow run")
            elif run is None:
                log.info(f"MLflow run {run_id} is not in {self.cfg.tracking_uri}; continuing in a new run")
            else:
                experiment = self.client.get_experiment(run.info.experiment_id)
                gone = experiment.lifecycle_stage == "deleted"  # with its runs
                if gone and experiment.name == self.cfg.experiment_name:  # where the new run would go
                    raise RunError(_deleted(experiment, self.cfg.tracking_uri, f", and run {run_id} with it"))
                restore = (
                    f"experiments restore --experiment-id {experiment.experiment_id}"
                    if gone
                    else f"runs restore --run-id {run_id}"
                )
                log.info(
                    f"MLflow run {run_id} is deleted; continuing in a new run (`MLFLOW_TRACKING_URI="
                    f"{self.cfg.tracking_uri} mlflow {restore}` brings the old one back)"
                )
            self.create(params, {**tags, "resumed_from_checkpoint": checkpoint}, config_yaml, started)
            return
        self.run_id = run_id
        self.client.update_run(run_id, status="RUNNING")
        self.resumes = int(run.data.tags.get("resumes", "0")) + 1
        resumes, old = self.resumes, run.data.params
        # Params keep their first values; what a resume changed, set or made null is tagged.
        changed = {f"resume.{resumes}.{key}": value for key, value in params.items() if old.get(key) != value}
        changed.update({f"resume.{resumes}.{key}": "None" for key in old.keys() - params.keys() if old[key] != "None"})
        self._log_params({key: value for key, value in params.items() if key not in old})
        resume_tags = {"resumes": str(resumes), f"resume.{resumes}.checkpoint": checkpoint}
        set_tags(self.client, run_id, {**tags, **self.parent_tags, **changed, **resume_tags})

    def _parents_experiment(self) -> str | None:
        """The experiment of the run this one nests under (a sweep's, or the run an evaluation
        judges): MLflow shows a child under its parent only within one experiment, and a parent
        started under another grouping (one experiment per `name`, before) stays where it is."""
        try:
            parent = self.client.get_run(self.cfg.parent_run_id) if self.cfg.parent_run_id else None
        except MlflowException:  # not in this store: the run goes where the config says
            return None
        return parent.info.experiment_id if parent is not None and parent.info.lifecycle_stage == "active" else None

    def _log_params(self, params: dict[str, str]) -> None:
        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            self.client.log_batch(self.run_id, params=items[start : start + 100])


def open_run(cfg: MlflowConfig, asked: dict) -> RunOpener | None:
    """The run `asked` describes (tracking.Tracker.open), opened; None, after a one-line warning,
    when the store fails: training does not depend on it. A run opened and then failed is ended
    FAILED, not left RUNNING."""
    opener = None
    try:
        opener = RunOpener(connect(cfg.tracking_uri), cfg)
        described = asked["params"], asked["tags"], asked["config_yaml"]
        if asked["checkpoint"] is None:
            opener.create(*described, asked["started"])
        else:
            opener.continue_(asked["run_id"], *described, asked["checkpoint"], asked["started"])
        try:
            log_datasets(opener.client, opener.run_id, asked["datasets"])
        except Exception as error:  # the run is open: it goes on, without its Dataset column
            log.warning(f"MLflow did not take the run's datasets ({first_line(error)})")
        return opener
    except Exception as error:
        log.warning(f"MLflow at {cfg.tracking_uri} failed ({first_line(error)}); training goes on without tracking")
        if opener is not None and opener.run_id is not None:
            with contextlib.suppress(Exception):  # the store is failing already; said above
                opener.client.set_terminated(opener.run_id, status="FAILED")
        return None


def attach_run(cfg: MlflowConfig, run_id: str) -> RunOpener | None:
    """The run `run_id` as it is, for a resume with nothing left to train: not marked RUNNING, no
    resume counted, nothing tagged; only the models it lacks are logged to it (logged_models.py).
    None, after a one-line warning, when the store fails or does not have it."""
    try:
        opener = RunOpener(connect(cfg.tracking_uri), cfg)
        opener.client.get_run(run_id)
    except Exception as error:
        log.warning(
            f"MLflow at {cfg.tracking_uri} cannot give run {run_id} ({first_line(error)}); its models are not logged"
        )
        return None
    opener.run_id = run_id
    return opener


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
        for key, value in tags.items():
            client.set_tag(run_id, key, value)
    except Exception as error:  # a store that is down must not end the run
        log.warning(f"could not tag MLflow run {run_id}: {first_line(error)}")


def experiment_id(client: MlflowClient, cfg: MlflowConfig) -> str:
    """The id of `mlflow.experiment_name`, created on first use, of the model-training kind."""
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    if experiment is not None and experiment.lifecycle_stage == "deleted":  # its name is still taken
        raise RunError(_deleted(experiment, cfg.tracking_uri))
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


def _deleted(experiment: Any, tracking_uri: str, what_else: str = "") -> str:
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
