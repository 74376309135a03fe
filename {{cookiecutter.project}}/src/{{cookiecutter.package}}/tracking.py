"""MLflow: one run per training job across any number of resumes, with metrics sent by another
process.

Writing a metric into the embedded sqlite store costs about 0.5 ms of Python even in batches,
a third of a demo training step; a thread in the training process would take that time from the
training thread through the GIL. So the training process only hands metrics over, and a child
process (`python -m <package>.tracking drain`) sends them in batches and then ends the run. It
runs in its own session, so Ctrl-C and a killed trainer leave it to finish delivering what it was
handed.

A store that is down costs a warning, never the run: metrics wait and are retried, and those that
never got through are written to a file, with the status the run should have ended with, that
`python -m <package>.tracking replay` sends later.
"""

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import queue
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
from mlflow.exceptions import MlflowException
from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException
from mlflow.utils.uri import get_uri_scheme
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from .config import MlflowConfig
from .errors import RunError

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
HAND_OVER_EVERY = 100  # metrics the training process gathers before passing them on
RETRY_SECONDS = 2.0  # how long metrics wait before the next try at a store that failed
CLOSE_SECONDS = 60.0  # how long the end of a run waits for the sender to deliver the rest
FOLLOWS_STORE = "artifacts_follow_store"  # tags the experiments whose artifacts live beside the store
# MLflow 3's UI opens an experiment without a kind in its GenAI view (an empty traces page) and
# asks which kind it is; this tag opens this project's experiments on their runs and charts.
KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def check_tracking_uri(cfg: MlflowConfig) -> None:
    """Refuses, in one line, a tracking URI this MLflow cannot open; MLflow itself says so only
    seconds into the run, in a traceback. Reads the URI and nothing else (no store is opened, no
    network): a well-formed store that is down is left to `Tracker`, which trains on untracked."""
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
        if _tracking_store_registry is not None:  # without it, Tracker warns when it cannot connect
            _tracking_store_registry.get_store_builder(uri)
    except UnsupportedModelRegistryStoreURIException:
        raise RunError(f"{asked}: MLflow {mlflow.__version__} knows no store at {scheme}://; {instead}") from None
    if scheme in ("http", "https") and not urlparse(uri).hostname:
        raise RunError(f"{asked} names no server; {instead}")


def connect(tracking_uri: str) -> MlflowClient:
    """A client of `tracking_uri`, after re-pointing the artifacts of a sqlite store that moved."""
    _follow_moved_store(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


class Tracker:
    """The MLflow run of this job; every method is a no-op when `mlflow.enabled=false`, in any
    process but rank 0 (`main=False`: one run, each step logged once), or once the store has
    proved unreachable at the start."""

    def __init__(self, cfg: MlflowConfig, spill_dir: Path, main: bool = True) -> None:
        if cfg.enabled and cfg.system_metrics and importlib.util.find_spec("psutil") is None:
            raise RunError(
                "mlflow.system_metrics=true needs psutil: pip install -e '.[system-metrics]', "
                "or drop mlflow.system_metrics"
            )
        self.run_id: str | None = None
        self._cfg, self._spill_dir, self._main = cfg, spill_dir, main
        self._parent_tags = {"mlflow.parentRunId": cfg.parent_run_id} if cfg.parent_run_id else {}
        self._resumed_run_id: str | None = None  # the run a restored checkpoint was written by
        self._resumes = 0
        self._client: MlflowClient | None = None
        self._sender: _Handover | None = None
        self._monitor = None

    def state_dict(self) -> dict:
        """A checkpoint part: the run to continue after a resume."""
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state.get("run_id"), str | None):
            raise ValueError(f"an MLflow run id is a string; found {state.get('run_id')!r}")
        self._resumed_run_id = state["run_id"]

    def open(self, params: dict[str, str], tags: dict[str, str], config_yaml: str, checkpoint: Path | None) -> None:
        """Starts a run, with the flattened config as params and the resolved config as an
        artifact; or, resuming from `checkpoint`, continues the run that wrote it, so its curves
        stay one line in the UI.

        Params are immutable in MLflow: what changed since the run began goes into tags named
        `resume.<n>.<key>`. A run missing from this store (a copied checkpoint, a new store)
        gets a new run, tagged with the checkpoint it continues.
        """
        if checkpoint is None:
            self._open(self._create, params, tags, config_yaml)
        else:
            self._open(self._continue, self._resumed_run_id, params, tags, config_yaml, str(checkpoint))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queues metrics; returns at once."""
        if self._sender is not None:
            self._sender.put(metrics, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.run_id is not None:
            try:
                for key, value in tags.items():
                    self._client.set_tag(self.run_id, key, value)
            except Exception as error:  # a store that is down must not end the run
                log.warning(f"could not tag MLflow run {self.run_id}: {first_line(error)}")

    def flush(self) -> None:
        """Hands every metric so far to the sender process, which delivers them even if this
        process dies next; does not wait for the store."""
        if self._sender is not None:
            self._sender.flush()

    def finish(self, status: str) -> None:
        """Ends the run as FINISHED, KILLED or FAILED, after the metrics still queued.

        The sender process ends it, so that the run is not over in the UI while metrics still
        arrive; and, if the store refuses, it records the end in the spill file after the
        metrics it could not send, alone at that file, so `replay` ends the run later.
        """
        if self.run_id is None:
            return
        if self._monitor is not None:
            self._monitor.finish()
        end = {"status": status, "end_time": int(time.time() * 1000), "resumes": self._resumes}
        if not self._sender.close(end):  # the sender died: no one else writes the spill file now
            _end_run(self._client, self.run_id, end, self._sender.spill)

    def _open(self, open_run, *args) -> None:
        """Connects and opens the run. The store is opened only when a run starts, so a run that
        fails its preflight leaves no trace; whatever it raises, training does not depend on it."""
        if not (self._cfg.enabled and self._main):
            return
        try:
            self._client = connect(self._cfg.tracking_uri)
            open_run(*args)
        except Exception as error:
            log.warning(
                f"MLflow at {self._cfg.tracking_uri} failed ({first_line(error)}); training goes on without tracking"
            )
            if self.run_id is not None:  # opened, then failed: not to be left RUNNING
                with contextlib.suppress(Exception):  # the store is failing already; said above
                    self._client.set_terminated(self.run_id, status="FAILED")
            self.run_id, self._client = None, None

    def _create(self, params: dict[str, str], tags: dict[str, str], config_yaml: str) -> None:
        experiment = experiment_id(self._client, self._cfg)
        run = self._client.create_run(experiment, run_name=self._cfg.run_name, tags={**tags, **self._parent_tags})
        self.run_id = run.info.run_id
        self._log_params(params)
        self._client.log_text(self.run_id, config_yaml, "config.yaml")
        self._start_logging(resumed=False)

    def _continue(
        self, run_id: str | None, params: dict[str, str], tags: dict[str, str], config_yaml: str, checkpoint: str
    ) -> None:
        try:
            run = self._client.get_run(run_id) if run_id else None
        except MlflowException:
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            log.info(f"MLflow run {run_id} is not in {self._cfg.tracking_uri}; continuing in a new run")
            self._create(params, {**tags, "resumed_from_checkpoint": checkpoint}, config_yaml)
            return
        self.run_id = run_id
        self._client.update_run(run_id, status="RUNNING")
        self._resumes = int(run.data.tags.get("resumes", "0")) + 1
        resumes, old = self._resumes, run.data.params
        changed = {f"resume.{resumes}.{key}": value for key, value in params.items() if old.get(key, value) != value}
        self._log_params({key: value for key, value in params.items() if key not in old})
        resume_tags = {"resumes": str(resumes), f"resume.{resumes}.checkpoint": checkpoint}
        self.set_tags({**tags, **self._parent_tags, **changed, **resume_tags})
        self._start_logging(resumed=True)

    def _start_logging(self, resumed: bool) -> None:
        spill = self._spill_dir / f"unsent-metrics-{self.run_id}.jsonl"
        self._sender = _Handover(self._cfg.tracking_uri, self.run_id, spill)
        if self._cfg.system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(
                self.run_id, resume_logging=resumed, tracking_uri=self._cfg.tracking_uri
            )
            self._monitor.start()

    def _log_params(self, params: dict[str, str]) -> None:
        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            self._client.log_batch(self.run_id, params=items[start : start + 100])


def experiment_id(client: MlflowClient, cfg: MlflowConfig) -> str:
    """The id of `mlflow.experiment_name`, created on first use, of the model-training kind."""
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    if experiment is not None:
        if KIND not in experiment.tags:  # created before this project set it, or by hand
            client.set_experiment_tag(experiment.experiment_id, KIND, MODEL_TRAINING)
        return experiment.experiment_id
    database = _sqlite_file(cfg.tracking_uri)
    if database is None:  # a server decides for itself
        return client.create_experiment(cfg.experiment_name, tags={KIND: MODEL_TRAINING})
    # Beside the store, not in whatever folder the job started from.
    location = (database.parent / "mlruns").as_uri()
    tags = {KIND: MODEL_TRAINING, FOLLOWS_STORE: "true"}
    return client.create_experiment(cfg.experiment_name, artifact_location=location, tags=tags)


def _sqlite_file(tracking_uri: str) -> Path | None:
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
    database = _sqlite_file(tracking_uri)
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


def first_line(error: Exception) -> str:
    """What `error` says, in one line."""
    # SQLAlchemy puts its own notes ("raised as a result of Query-invoked autoflush") before
    # what the database said.
    if isinstance(error.__cause__, DBAPIError):
        error = error.__cause__.orig
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _replay_command(spill: Path) -> str:
    return f"python -m {__spec__.name} replay {spill} --tracking-uri <uri>"


def _end_run(client: MlflowClient, run_id: str, end: dict, spill: Path) -> None:
    """Ends the run with `end` (status, end time, resumes so far); if the store refuses, appends
    the end to `spill` for `replay`. The caller must be the only writer of `spill`."""
    try:
        client.set_terminated(run_id, status=end["status"], end_time=end["end_time"])
    except Exception as error:
        spill.parent.mkdir(parents=True, exist_ok=True)
        with open(spill, "a") as file:
            file.write(json.dumps({"run_id": run_id, **end}) + "\n")
        log.warning(
            f"could not mark MLflow run {run_id} {end['status']} ({first_line(error)}); that is recorded in "
            f"{spill}, and `{_replay_command(spill)}` ends the run when the store is back"
        )


class _Handover:
    """The training process's side: gathers metrics and hands them, as JSON lines, to the sender
    process through a pipe, from a thread of its own, so a full pipe never blocks training."""

    def __init__(self, tracking_uri: str, run_id: str, spill: Path) -> None:
        self.spill = spill
        command = [sys.executable, "-m", __name__, "drain", tracking_uri, run_id, str(spill)]
        self._child = subprocess.Popen(command, stdin=subprocess.PIPE, text=True, start_new_session=True)
        self._gathered: list[list] = []
        self._batches: queue.Queue = queue.Queue()
        self._handed_over = True  # until the pipe breaks
        self._writer = threading.Thread(target=self._write, name="mlflow-hand-over", daemon=True)
        self._writer.start()

    def put(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        self._gathered.extend([key, float(value), timestamp, step] for key, value in metrics.items())
        if len(self._gathered) >= HAND_OVER_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._gathered:
            self._batches.put(self._gathered)
            self._gathered = []

    def close(self, end: dict) -> bool:
        """Hands over the rest and the end of the run, then waits for the sender to deliver
        them, up to `CLOSE_SECONDS`. False when the sender died without ending the run."""
        self.flush()
        self._batches.put(end)
        self._batches.put(None)
        self._writer.join()
        try:
            returncode = self._child.wait(timeout=CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning(
                f"MLflow is slow: process {self._child.pid} goes on delivering the last metrics, then ends the run"
            )
            return self._handed_over
        if returncode != 0:
            log.warning(f"the MLflow sender process exited with code {returncode}")
        return self._handed_over and returncode == 0

    def _write(self) -> None:
        try:
            while (item := self._batches.get()) is not None:
                self._child.stdin.write(json.dumps(item) + "\n")
                self._child.stdin.flush()
            self._child.stdin.close()  # end of input: the sender delivers the rest and exits
        except OSError as error:  # the sender died: nothing left to hand over to
            self._handed_over = False
            log.warning(f"the MLflow sender process stopped: {error}")


class _Sender:
    """The sender process's side: batches from `incoming` into `log_batch` calls, in order.

    When the store fails, metrics stay pending and are retried every `RETRY_SECONDS`. `incoming`
    ends with the end of the run (a dict) and None, or with None alone when the trainer died;
    then what is still pending goes to `spill`, a JSON-lines file, and the run is ended.
    """

    def __init__(self, client: MlflowClient, run_id: str, spill: Path, incoming: queue.Queue) -> None:
        self._client, self._run_id, self._spill, self._incoming = client, run_id, spill, incoming
        self._pending: list[Metric] = []
        self._retry_at: float | None = None  # set while the store is failing

    def run(self) -> None:
        end = None
        while True:
            try:
                item = self._incoming.get(timeout=RETRY_SECONDS if self._pending else None)
            except queue.Empty:  # nothing new, but metrics still wait for the store to come back
                self._send()
                continue
            if item is None:
                self._send(force=True)
                self._spill_pending()
                if end is not None:  # a trainer that died said nothing: the run is left as it is
                    _end_run(self._client, self._run_id, end, self._spill)
                return
            if isinstance(item, dict):
                end = item
                continue
            self._pending.extend(Metric(*row) for row in item)
            if self._incoming.empty() or len(self._pending) >= BATCH_LIMIT:
                self._send()

    def _send(self, force: bool = False) -> None:
        if self._retry_at is not None and time.monotonic() < self._retry_at and not force:
            return
        while self._pending:
            batch = self._pending[:BATCH_LIMIT]
            try:
                self._client.log_batch(self._run_id, metrics=batch)
            except Exception as error:  # any failure of the store: keep the metrics, try again later
                if self._retry_at is None:
                    log.warning(
                        f"MLflow is not taking metrics ({first_line(error)}); training goes on, metrics are kept"
                    )
                self._retry_at = time.monotonic() + RETRY_SECONDS
                return
            del self._pending[: len(batch)]
        if self._retry_at is not None:
            log.warning("MLflow is taking metrics again; the ones kept meanwhile are sent")
            self._retry_at = None

    def _spill_pending(self) -> None:
        if not self._pending:
            return
        self._spill.parent.mkdir(parents=True, exist_ok=True)
        with open(self._spill, "a") as file:
            for metric in self._pending:
                row = {"run_id": self._run_id, "key": metric.key, "value": metric.value, "step": metric.step}
                file.write(json.dumps({**row, "timestamp": metric.timestamp}) + "\n")
        log.warning(
            f"{len(self._pending)} metrics could not reach MLflow; they are in {self._spill}. Send them "
            f"when the store is back: {_replay_command(self._spill)}"
        )


def drain(tracking_uri: str, run_id: str, spill: Path) -> None:
    """The sender process: JSON lines from stdin to the store until stdin ends."""
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    incoming: queue.Queue = queue.Queue()

    def read() -> None:  # a thread, so that retries go on while no new line comes
        for line in sys.stdin:
            incoming.put(json.loads(line))
        incoming.put(None)

    threading.Thread(target=read, daemon=True).start()
    _Sender(MlflowClient(tracking_uri=tracking_uri), run_id, spill, incoming).run()


def replay(path: Path, tracking_uri: str) -> tuple[int, dict[str, str]]:
    """Sends a file of unsent metrics to `tracking_uri`, then ends the runs it records the end
    of; returns how many metrics were sent, and what became of each recorded end, by run."""
    client, metrics_by_run, ends = connect(tracking_uri), {}, {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "status" in row:
            ends[row["run_id"]] = row  # a run resumed and stopped again: its last end counts
        else:
            metric = Metric(row["key"], row["value"], row["timestamp"], row["step"])
            metrics_by_run.setdefault(row["run_id"], []).append(metric)
    for run_id, metrics in metrics_by_run.items():
        for start in range(0, len(metrics), BATCH_LIMIT):
            client.log_batch(run_id, metrics=metrics[start : start + BATCH_LIMIT])
    outcomes = {run_id: _replay_end(client, end) for run_id, end in ends.items()}
    return sum(len(metrics) for metrics in metrics_by_run.values()), outcomes


def _replay_end(client: MlflowClient, end: dict) -> str:
    run = client.get_run(end["run_id"])
    if run.info.status != "RUNNING":
        return f"left {run.info.status}: it was ended since"
    # A run resumed after this end was recorded may be training now: its own job ends it.
    if run.data.tags.get("resumes", "0") != str(end["resumes"]):
        return "left RUNNING: it was resumed since"
    client.set_terminated(end["run_id"], status=end["status"], end_time=end["end_time"])
    return f"ended {end['status']}"


def main() -> None:
    parser = argparse.ArgumentParser(description="MLflow delivery for training runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    sender = commands.add_parser("drain", help="internal: the sender process a training run starts")
    sender.add_argument("tracking_uri")
    sender.add_argument("run_id")
    sender.add_argument("spill", type=Path)
    resend = commands.add_parser("replay", help="send metrics that a run could not deliver, and end the run")
    resend.add_argument("file", type=Path, help="an unsent-metrics-<run id>.jsonl file from the checkpoint folder")
    resend.add_argument("--tracking-uri", required=True, help="the store the run logs to, e.g. http://127.0.0.1:5000")
    arguments = parser.parse_args()
    if arguments.command == "drain":
        drain(arguments.tracking_uri, arguments.run_id, arguments.spill)
    else:
        try:
            sent, ends = replay(arguments.file, arguments.tracking_uri)
        except Exception as error:  # the store is still down, or is not the run's store
            raise SystemExit(
                f"error: could not replay {arguments.file} into {arguments.tracking_uri} ({first_line(error)}); "
                f"run the same command once the run's store is back: a metric sent twice is stored once"
            ) from None
        print(f"sent {sent} metrics to {arguments.tracking_uri}")
        for run_id, outcome in ends.items():
            print(f"run {run_id}: {outcome}")


if __name__ == "__main__":
    main()
