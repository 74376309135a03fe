"""Everything that talks to the MLflow store, in the processes that do: the sender process
a training run starts (`drain`, run as `python -m <package>.engine.tracking drain`), which opens or
continues the run and then delivers its metrics and files; the launching process of a sweep
(its parent run); and `replay`. The training process itself never imports this module, or
MLflow: the import alone is 2 s of start-up (tracking.py is its side).
"""

import contextlib
import json
import logging
import os
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelStatus, Metric, Param
from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
from mlflow.exceptions import MlflowException
from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException
from mlflow.utils.uri import get_uri_scheme
from sqlalchemy.engine import make_url

from .checkpoint.files import read_regular
from .config import MlflowConfig
from .errors import RunError, first_line
from .origin import origin
from .unsent import discard, replay_command, spill, spill_path, staged

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

BATCH_LIMIT = 1000  # metrics per log_batch call, MLflow's own limit
# How long metrics gather before they are sent: a log_batch call costs the store milliseconds of
# CPU whatever its size, taken from training on a machine with few cores (bench/logging_overhead.py).
SEND_EVERY_SECONDS = 1.0
RETRY_SECONDS = 2.0  # how long metrics wait before the next try at a store that failed
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

    def create(self, params: dict[str, str], tags: dict[str, str], config_yaml: str) -> None:
        experiment = self._parents_experiment() or experiment_id(self.client, self.cfg)
        run = self.client.create_run(experiment, run_name=self.cfg.run_name, tags={**tags, **self.parent_tags})
        self.run_id = run.info.run_id
        self._log_params(params)
        self.client.log_text(self.run_id, config_yaml, "config.yaml")

    def continue_(
        self, run_id: str | None, params: dict[str, str], tags: dict[str, str], config_yaml: str, checkpoint: str
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
            self.create(params, {**tags, "resumed_from_checkpoint": checkpoint}, config_yaml)
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
        if asked["checkpoint"] is None:
            opener.create(asked["params"], asked["tags"], asked["config_yaml"])
        else:
            opener.continue_(asked["run_id"], asked["params"], asked["tags"], asked["config_yaml"], asked["checkpoint"])
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


def record_origin(client: MlflowClient, run_id: str, resumes: int) -> None:
    """What the run ran from (origin.py), from the folder this process started in, the trainer's:
    the tags `mlflow.source.git.commit`, `git.dirty` and `template.version`, and the artifacts
    `provenance/requirements.txt` and, from a tree with uncommitted changes, `provenance/git.diff`.
    A resume records its own beside them, under `provenance/resume.<n>/`, and its tags replace the
    first's, as every tag of a resume does. A failure costs a warning: the run goes on."""
    folder = "provenance" if resumes == 0 else f"provenance/resume.{resumes}"
    try:
        tags, files = origin(Path.cwd())
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


def deliver_file(client: MlflowClient, run_id: str, folder: Path, what: dict) -> bool:
    """Logs the file that `what` describes (handed over, or a row of the spill file): its `path` in
    the checkpoint folder `folder`, and its `artifact_path`, or, for an image, the `key`, `step`
    and `timestamp` it is logged at; then deletes it. False where nothing was logged: the file is
    gone (delivered by a sender killed before it confirmed it), or is refused, with a warning, and
    left as it is (a link, a file outside `unsent-files/`, an image that cannot be read). A store
    that fails raises, and the file stays."""
    try:
        path = staged(folder, what["path"])
        image = _read_image(path) if "key" in what else None
    except FileNotFoundError:
        return False
    except Exception as error:  # whatever a damaged image raises
        log.warning(f"{first_line(error)}; not logged to MLflow")
        return False
    if image is None:
        client.log_artifact(run_id, str(path), what["artifact_path"])
    else:
        client.log_image(run_id, image, key=what["key"], step=what["step"], timestamp=what["timestamp"])
    discard(folder, what["path"])
    return True


def _read_image(path: Path) -> Any:
    import PIL.Image  # only in a sender that logs an image

    with PIL.Image.open(path) as image:
        return image.copy()  # read whole: the file closes here


class _Sender:
    """The sender process's side: batches from `incoming` into `log_batch` calls, in order, each
    holding what arrived over `SEND_EVERY_SECONDS` (or `BATCH_LIMIT` metrics); files go with them.

    When the store fails, metrics and files stay pending and are retried every `RETRY_SECONDS`.
    `incoming` holds lists of metric rows, files ({"file": ..., "id": <number>}), tags ({"tags":
    ...}) and the end of the run ({"end": ...}), then None; or None alone when the trainer died.
    Then the system metrics monitor (if any) stops, what is still pending goes to `spill_file`, a
    JSON-lines file (a file stays on disk, named there), and the run is ended. Each time metrics
    are delivered or spilled, `confirm` is told how many have been, counted from the start; each
    time a file is, {"file": <its number>}; once the run is ended (or its end spilled), "ended".
    """

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        spill_file: Path,
        incoming: queue.Queue,
        confirm: Callable[[int | str], None],
        monitor: Any = None,
        model_logging: threading.Thread | None = None,
    ) -> None:
        self._client, self._run_id, self._spill_file, self._incoming = client, run_id, spill_file, incoming
        self._confirm, self._monitor, self._model_logging = confirm, monitor, model_logging
        self._received = 0  # metrics, counted from the start
        self._pending: list[Metric] = []
        self._files: list[dict] = []  # handed over, not yet delivered: {"file": ..., "id": ...}
        self._gathering_since = 0.0  # when the oldest pending metric or file arrived
        self._retry_at: float | None = None  # set while the store is failing

    def run(self) -> None:
        end, models = None, None
        while True:
            try:
                item = self._incoming.get(timeout=self._until_due())
            except queue.Empty:  # pending metrics are due: gathered long enough, or to be tried again
                self._send()
                continue
            if item is None:
                if self._monitor is not None:
                    self._monitor.finish()
                self._send(force=True)
                self._spill_pending()
                if end is not None:  # a trainer that died said nothing: the run is left as it is
                    end_run(self._client, self._run_id, end, self._spill_file)
                    self._confirm("ended")
                if models is not None:  # last: a sender killed while it copies weights loses no metric, nor the end
                    if self._model_logging is not None:
                        self._model_logging.join()
                    log_models(self._client, self._run_id, models)
                return
            if not (self._pending or self._files) and (isinstance(item, list) or "file" in item):
                self._gathering_since = time.monotonic()
            if isinstance(item, list):
                self._pending.extend(Metric(*row) for row in item)
                self._received += len(item)
                if len(self._pending) >= BATCH_LIMIT:
                    self._send()
            elif "file" in item:
                self._files.append(item)
            elif "tags" in item:
                set_tags(self._client, self._run_id, item["tags"])
            elif "models" in item:
                models = item["models"]
            else:
                end = item["end"]

    def _until_due(self) -> float | None:
        """Seconds until the pending metrics and files are to be sent; None (no limit) when none are."""
        if not (self._pending or self._files):
            return None
        due = self._retry_at if self._retry_at is not None else self._gathering_since + SEND_EVERY_SECONDS
        return max(due - time.monotonic(), 0.0)

    def _send(self, force: bool = False) -> None:
        if self._retry_at is not None and time.monotonic() < self._retry_at and not force:
            return
        try:
            while self._pending:
                batch = self._pending[:BATCH_LIMIT]
                self._client.log_batch(self._run_id, metrics=batch)
                del self._pending[: len(batch)]
                self._confirm(self._received - len(self._pending))
            while self._files:
                deliver_file(self._client, self._run_id, self._spill_file.parent, self._files[0]["file"])
                self._confirm({"file": self._files.pop(0)["id"]})
        except Exception as error:  # any failure of the store: keep the metrics and files, try again later
            if self._retry_at is None:
                log.warning(f"MLflow is not taking metrics ({first_line(error)}); training goes on, metrics are kept")
            self._retry_at = time.monotonic() + RETRY_SECONDS
            return
        if self._retry_at is not None:
            log.warning("MLflow is taking metrics again; the ones kept meanwhile are sent")
            self._retry_at = None

    def _spill_pending(self) -> None:
        if not (self._pending or self._files):
            return
        rows = [
            {"run_id": self._run_id, "key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step}
            for m in self._pending
        ] + [{"run_id": self._run_id, "file": item["file"]} for item in self._files]
        counts = ((len(self._pending), "metrics"), (len(self._files), "files"))
        left = " and ".join(f"{count} {what}" for count, what in counts if count)
        try:
            written = spill(self._spill_file, rows)
        except OSError as error:
            log.warning(f"{left} could not reach MLflow, nor {self._spill_file} ({error.strerror})")
            return
        self._confirm(self._received)
        for item in self._files:
            self._confirm({"file": item["id"]})
        log.warning(
            f"{left} could not reach MLflow; they are in {written}. Send them when the store is back: "
            f"{replay_command(written)}"
        )


def unlogged(client: MlflowClient, run_id: str, checkpoints: list[dict]) -> list[dict]:
    """Of `checkpoints` (name, path, step), those the run has no READY model of. A model of the run
    still PENDING is one its sender died logging (only the run's sender logs its models, and only as
    it ends): it is marked FAILED, as MLflow marks one whose logging raised, not shown in progress
    for good."""
    experiment = client.get_run(run_id).info.experiment_id
    logged = client.search_logged_models(experiment_ids=[experiment], filter_string=f"source_run_id = '{run_id}'")
    for model in logged:
        if model.status == LoggedModelStatus.PENDING:
            client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
    ready = {model.tags.get("checkpoint") for model in logged if model.status == LoggedModelStatus.READY}
    return [checkpoint for checkpoint in checkpoints if checkpoint["path"] not in ready]


def prepare_model_logging() -> threading.Thread:
    """What logging a model needs that the model does not: torch, MLflow's PyTorch flavor and
    torch.export's first trace (3 s on a CPU), in a thread of the sender while the run trains, on
    the core training leaves free (devices.set_cpu_threads), so that the end of a run waits only
    for its own model's trace and files."""

    def warm_up() -> None:
        with contextlib.suppress(Exception):  # whatever fails here fails again in log_models, which says so
            import mlflow.pytorch  # noqa: F401
            import torch

            torch.set_num_threads(1)  # beside training; a model's trace is not arithmetic
            torch.export.export(torch.nn.Linear(1, 1), (torch.zeros(1, 1),))

    thread = threading.Thread(target=warm_up, daemon=True)
    thread.start()
    return thread


def log_models(client: MlflowClient, run_id: str, asked: dict) -> None:
    """Each checkpoint `asked` names as an MLflow model of the run (a LoggedModel: the Models tab,
    `search_logged_models`, `models:/<id>`), at its step, with the run's metrics of that step,
    unless the run has a model of that checkpoint already (a resume that did not change the best;
    one whose logging failed, which MLflow lists as FAILED, or that a killed sender left PENDING,
    is tried again: see `unlogged`).
    The model is built from its description, given the checkpoint's weights through the project's
    own loaders, on the CPU, and saved as a graph traced by `torch.export` ("pt2"), which loads
    without this project's code; an example of two samples leaves its batch size free. Whatever
    fails warns: the checkpoints stay, and the run's metrics and end are delivered already."""
    try:
        if not (left := unlogged(client, run_id, asked["checkpoints"])):
            return
        import mlflow.pytorch  # torch and its flavor (3 s) only in a sender that logs a model
        import torch
        from hydra.utils import instantiate

        from .checkpoint.initial import load_weights
        from .checkpoint.resume import load

        experiment = client.get_run(run_id).info.experiment_id
        mlflow.set_experiment(experiment_id=experiment)  # MLflow files a model under the active one
        # The model is traced on the CPU, where it loads on any machine; MLflow checks its example
        # through pyfunc, which would place it on a GPU wherever one is, and refuse it there.
        os.environ["MLFLOW_DEFAULT_PREDICTION_DEVICE"] = "cpu"
        example = torch.tensor(asked["example"]["values"], dtype=getattr(torch, asked["example"]["dtype"]))
        requirements = [f"torch=={torch.__version__.split('+')[0]}"]  # a local build tag (+cpu) is no pip version
    except Exception as error:
        log.warning(f"no model was logged to MLflow ({first_line(error)}); the checkpoints stay: export.py writes one")
        return
    for checkpoint in left:
        try:
            model = instantiate(asked["model"])
            # Written and sealed by this run moments ago: read without checking every byte again.
            load_weights(model, load(Path(checkpoint["path"]), verify=False), [], shards=False, fine_tuning=False)
            mlflow.pytorch.log_model(
                model.eval(),
                name=checkpoint["name"],
                step=checkpoint["step"],
                run_id=run_id,
                input_example=example.numpy(),  # numpy: MLflow infers a TensorSpec signature from it
                serialization_format="pt2",
                pip_requirements=requirements,
                tags={"checkpoint": checkpoint["path"]},
            )
        except Exception as error:
            log.warning(
                f"the {checkpoint['name']} model was not logged to MLflow ({first_line(error)}); its checkpoint "
                f"{checkpoint['path']} stays, and export.py writes its weights"
            )


def drain() -> None:
    """The sender process: waits for the first line on stdin, which asks for a run, opens it and
    answers its id on stdout, then delivers what follows until stdin ends. Started ahead of the
    run, it may see stdin end first: the run was not tracked."""
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever MLflow prints stays off the answer
    incoming: queue.Queue = queue.Queue()

    def read() -> None:  # a thread, so that retries go on while no new line comes
        for line in sys.stdin:
            incoming.put(json.loads(line))
        incoming.put(None)

    threading.Thread(target=read, daemon=True).start()
    if (first := incoming.get()) is None:
        return
    asked = first["open"]
    cfg = MlflowConfig(**asked["mlflow"])
    opened = open_run(cfg, asked)

    def say(value: object) -> None:
        """A line to the trainer, which reads each as it comes; once it is gone (killed, or done
        waiting for this process), nothing: the metrics are delivered all the same."""
        nonlocal answering
        if answering:
            try:
                answer.write(json.dumps(value) + "\n")
                answer.flush()
            except OSError:
                answering = False

    answering = True
    try:
        say({"run_id": opened and opened.run_id, "resumes": opened.resumes if opened else 0})
        if opened is None:  # untracked: what the trainer hands over has nowhere to go, its files deleted
            while (item := incoming.get()) is not None:
                if isinstance(item, dict) and "file" in item:
                    discard(Path(asked["spill_dir"]), item["file"]["path"])
            return
        monitor = None
        if cfg.system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(
                opened.run_id, resume_logging=opened.resumes > 0, tracking_uri=cfg.tracking_uri
            )
            monitor.start()
        mlflow.set_tracking_uri(cfg.tracking_uri)  # where mlflow.pytorch.log_model writes (log_models)
        # Now, with the run's id answered: git and the package list cost the trainer nothing, and the
        # metrics that arrive meanwhile wait in `incoming`.
        model_logging = prepare_model_logging() if cfg.log_models != "none" else None
        record_origin(opened.client, opened.run_id, opened.resumes)
        spill_file = spill_path(Path(asked["spill_dir"]), opened.run_id)
        _Sender(opened.client, opened.run_id, spill_file, incoming, say, monitor, model_logging).run()
    finally:
        with contextlib.suppress(OSError):  # the trainer takes the end of this output for the sender's exit
            answer.close()


def replay(path: Path, tracking_uri: str) -> tuple[int, int, dict[str, str]]:
    """Sends a file of unsent metrics to `tracking_uri`, and the files it names (deleting each
    once sent), then ends the runs it records the end of; returns how many metrics and files were
    sent, and what became of each recorded end, by run. A file named twice (spilled by a sender
    that died before it confirmed, and again by the trainer) is sent once: it is gone after."""
    client, metrics_by_run, files, ends = connect(tracking_uri), {}, [], {}
    for line in read_regular(path).decode(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # the last line of a writer killed mid-write: what it held is lost
            log.warning(f"skipping a line of {path} that was cut short: {line[:60]}")
            continue
        if "status" in row:
            ends[row["run_id"]] = row  # a run resumed and stopped again: its last end counts
        elif "file" in row:
            files.append(row)
        else:
            metric = Metric(row["key"], row["value"], row["timestamp"], row["step"])
            metrics_by_run.setdefault(row["run_id"], []).append(metric)
    for run_id, metrics in metrics_by_run.items():
        for start in range(0, len(metrics), BATCH_LIMIT):
            client.log_batch(run_id, metrics=metrics[start : start + BATCH_LIMIT])
    sent_files = sum(deliver_file(client, row["run_id"], path.parent, row["file"]) for row in files)
    outcomes = {run_id: _replay_end(client, end) for run_id, end in ends.items()}
    return sum(len(metrics) for metrics in metrics_by_run.values()), sent_files, outcomes


def _replay_end(client: MlflowClient, end: dict) -> str:
    run = client.get_run(end["run_id"])
    if run.info.status != "RUNNING":
        return f"left {run.info.status}: it was ended since"
    # A run resumed after this end was recorded may be training now: its own job ends it.
    if run.data.tags.get("resumes", "0") != str(end["resumes"]):
        return "left RUNNING: it was resumed since"
    client.set_terminated(end["run_id"], status=end["status"], end_time=end["end_time"])
    return f"ended {end['status']}"
