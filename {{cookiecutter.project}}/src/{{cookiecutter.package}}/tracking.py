"""MLflow: one run per training job across any number of resumes, with metrics sent by another
process.

Writing a metric into the embedded sqlite store costs about 0.5 ms of Python even in batches,
a third of a demo training step; a thread in the training process would take that time from the
training thread through the GIL. So the training process only hands metrics over, and a child
process (`python -m <package>.tracking drain`) sends them in batches. It runs in its own
session, so Ctrl-C and a killed trainer leave it to finish delivering what it was handed.

A store that is down costs a warning, never the run: metrics wait and are retried, and those that
never got through are written to a file that `python -m <package>.tracking replay` sends later.
"""

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from .config import MlflowConfig
from .errors import RunError

log = logging.getLogger(__name__)

# MLflow's HTTP client retries with exponential backoff: with the server gone, one call could
# block for minutes. Bounded here; a user's own setting wins.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")

BATCH_LIMIT = 1000  # metrics per log_batch call, MLflow's own limit
HAND_OVER_EVERY = 100  # metrics the training process gathers before passing them on
RETRY_SECONDS = 2.0  # how long metrics wait before the next try at a store that failed
CLOSE_SECONDS = 60.0  # how long the end of a run waits for the sender to deliver the rest


class Tracker:
    """The MLflow run of this job; every method is a no-op when `mlflow.enabled=false`, or once
    the store has proved unreachable at the start."""

    def __init__(
        self, cfg: MlflowConfig, spill_dir: Path, parent_run_id: str | None = None, run_name: str | None = None
    ) -> None:
        if cfg.enabled and cfg.system_metrics and importlib.util.find_spec("psutil") is None:
            raise RunError(
                "mlflow.system_metrics=true needs psutil: pip install -e '.[system-metrics]', "
                "or drop mlflow.system_metrics"
            )
        self.run_id: str | None = None
        self._cfg, self._spill_dir = cfg, spill_dir
        # A sweep job's run is a child of the sweep's run, named by the job's overrides.
        self._sweep_tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else {}
        self._run_name = cfg.run_name or run_name
        self._client: MlflowClient | None = None
        self._sender: _Handover | None = None
        self._monitor = None

    def start(self, params: dict[str, str], tags: dict[str, str], config_yaml: str) -> None:
        """A new run, with the flattened config as params and the resolved config as an artifact."""
        if self._connect():
            self._guarded(self._create, params, tags, config_yaml)

    def reattach(
        self, run_id: str | None, params: dict[str, str], tags: dict[str, str], config_yaml: str, checkpoint: str
    ) -> None:
        """Continues the run a checkpoint was written by, so its curves stay one line in the UI.

        Params are immutable in MLflow: what changed since the run began goes into tags named
        `resume.<n>.<key>`. A run missing from this store (a copied checkpoint, a new store)
        gets a new run, tagged with the checkpoint it continues.
        """
        if self._connect():
            self._guarded(self._continue, run_id, params, tags, config_yaml, checkpoint)

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
                log.warning(f"could not tag MLflow run {self.run_id}: {_first_line(error)}")

    def flush(self) -> None:
        """Hands every metric so far to the sender process, which delivers them even if this
        process dies next; does not wait for the store."""
        if self._sender is not None:
            self._sender.flush()

    def finish(self, status: str) -> None:
        """Sends what is queued and ends the run as FINISHED, KILLED or FAILED."""
        if self.run_id is None:
            return
        if self._monitor is not None:
            self._monitor.finish()
        self._sender.close()
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as error:  # the server may be gone; the run itself is done
            log.warning(f"could not mark MLflow run {self.run_id} {status}: {_first_line(error)}")

    def _connect(self) -> bool:
        """Opens the store only when a run starts: a run that fails its preflight leaves no trace."""
        if self._cfg.enabled and self._client is None:
            self._client = MlflowClient(tracking_uri=self._cfg.tracking_uri)
        return self._client is not None

    def _guarded(self, open_run, *args) -> None:
        try:
            open_run(*args)
        except Exception as error:  # whatever the store raises, training does not depend on it
            log.warning(
                f"MLflow at {self._cfg.tracking_uri} failed ({_first_line(error)}); training goes on without tracking"
            )
            if self.run_id is not None:  # opened, then failed: not to be left RUNNING
                with contextlib.suppress(Exception):  # the store is failing already; said above
                    self._client.set_terminated(self.run_id, status="FAILED")
            self.run_id, self._client = None, None

    def _create(self, params: dict[str, str], tags: dict[str, str], config_yaml: str) -> None:
        experiment = experiment_id(self._client, self._cfg)
        run = self._client.create_run(experiment, run_name=self._run_name, tags={**tags, **self._sweep_tags})
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
        resumes = int(run.data.tags.get("resumes", "0")) + 1
        old = run.data.params
        changed = {f"resume.{resumes}.{key}": value for key, value in params.items() if old.get(key, value) != value}
        self._log_params({key: value for key, value in params.items() if key not in old})
        resume_tags = {"resumes": str(resumes), f"resume.{resumes}.checkpoint": checkpoint}
        self.set_tags({**tags, **self._sweep_tags, **changed, **resume_tags})
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
    """The id of `mlflow.experiment_name`, created on first use."""
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(cfg.experiment_name, artifact_location=_artifact_location(cfg))


def _artifact_location(cfg: MlflowConfig) -> str | None:
    """Artifacts beside an embedded sqlite store, not in whatever folder the job started from.
    A server decides for itself."""
    prefix = "sqlite:///"
    if not cfg.tracking_uri.startswith(prefix):
        return None
    return (Path(cfg.tracking_uri[len(prefix) :]).parent / "mlruns").as_uri()


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class _Handover:
    """The training process's side: gathers metrics and hands them, as JSON lines, to the sender
    process through a pipe, from a thread of its own, so a full pipe never blocks training."""

    def __init__(self, tracking_uri: str, run_id: str, spill: Path) -> None:
        command = [sys.executable, "-m", __name__, "drain", tracking_uri, run_id, str(spill)]
        self._child = subprocess.Popen(command, stdin=subprocess.PIPE, text=True, start_new_session=True)
        self._gathered: list[list] = []
        self._batches: queue.Queue = queue.Queue()
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

    def close(self) -> None:
        """Hands over the rest, then waits for the sender to deliver it, up to `CLOSE_SECONDS`."""
        self.flush()
        self._batches.put(None)
        self._writer.join()
        try:
            self._child.wait(timeout=CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning(f"MLflow is slow: process {self._child.pid} goes on delivering the last metrics")

    def _write(self) -> None:
        try:
            while (batch := self._batches.get()) is not None:
                self._child.stdin.write(json.dumps(batch) + "\n")
                self._child.stdin.flush()
            self._child.stdin.close()  # end of input: the sender delivers the rest and exits
        except OSError as error:  # the sender died: nothing left to hand over to
            log.warning(f"the MLflow sender process stopped: {error}")


class _Sender:
    """The sender process's side: batches from `incoming` into `log_batch` calls, in order.

    When the store fails, metrics stay pending and are retried every `RETRY_SECONDS`; what is
    still pending when `incoming` ends (None) goes to `spill`, a JSON-lines file.
    """

    def __init__(self, client: MlflowClient, run_id: str, spill: Path, incoming: queue.Queue) -> None:
        self._client, self._run_id, self._spill, self._incoming = client, run_id, spill, incoming
        self._pending: list[Metric] = []
        self._retry_at: float | None = None  # set while the store is failing

    def run(self) -> None:
        while True:
            try:
                batch = self._incoming.get(timeout=RETRY_SECONDS if self._pending else None)
            except queue.Empty:  # nothing new, but metrics still wait for the store to come back
                self._send()
                continue
            if batch is None:
                self._send(force=True)
                self._spill_pending()
                return
            self._pending.extend(Metric(*row) for row in batch)
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
                        f"MLflow is not taking metrics ({_first_line(error)}); training goes on, metrics are kept"
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
            f"when the store is back: python -m {__spec__.name} replay {self._spill} --tracking-uri <uri>"
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


def replay(path: Path, tracking_uri: str) -> int:
    """Sends a file of unsent metrics to `tracking_uri`; returns how many were sent."""
    client, by_run = MlflowClient(tracking_uri=tracking_uri), {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by_run.setdefault(row["run_id"], []).append(Metric(row["key"], row["value"], row["timestamp"], row["step"]))
    for run_id, metrics in by_run.items():
        for start in range(0, len(metrics), BATCH_LIMIT):
            client.log_batch(run_id, metrics=metrics[start : start + BATCH_LIMIT])
    return sum(len(metrics) for metrics in by_run.values())


def main() -> None:
    parser = argparse.ArgumentParser(description="MLflow delivery for training runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    sender = commands.add_parser("drain", help="internal: the sender process a training run starts")
    sender.add_argument("tracking_uri")
    sender.add_argument("run_id")
    sender.add_argument("spill", type=Path)
    resend = commands.add_parser("replay", help="send metrics that a run could not deliver")
    resend.add_argument("file", type=Path, help="an unsent-metrics-<run id>.jsonl file from the checkpoint folder")
    resend.add_argument("--tracking-uri", required=True, help="the store the run logs to, e.g. http://127.0.0.1:5000")
    arguments = parser.parse_args()
    if arguments.command == "drain":
        drain(arguments.tracking_uri, arguments.run_id, arguments.spill)
    else:
        print(f"sent {replay(arguments.file, arguments.tracking_uri)} metrics to {arguments.tracking_uri}")


if __name__ == "__main__":
    main()


def check_tracking_uri(cfg: MlflowConfig) -> None:  # TEMP until the mlflow-leftovers merge
    pass
