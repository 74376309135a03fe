"""MLflow: one run per training job across any number of resumes, with metrics sent off the
training thread.

A synchronous `log_metric` into the sqlite store costs about 12 ms, twenty demo training steps;
so metrics go into a queue, and a background thread sends them in batches. A tracking server that
is down costs a warning, never the run.
"""

import logging
import os
import queue
import threading
import time
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from .config import MlflowConfig

log = logging.getLogger(__name__)

# MLflow's HTTP client retries with exponential backoff: with the server gone, one call could
# block for minutes. Bounded here; a user's own setting wins.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

BATCH_LIMIT = 1000  # metrics per log_batch call, MLflow's own limit


class Tracker:
    """The MLflow run of this job; every method is a no-op when `mlflow.enabled=false`."""

    def __init__(self, cfg: MlflowConfig) -> None:
        self.run_id: str | None = None
        self._cfg = cfg
        self._client: MlflowClient | None = None
        self._sender: _MetricSender | None = None

    def start(self, params: dict[str, str], tags: dict[str, str], config_yaml: str) -> None:
        """A new run, with the flattened config as params and the resolved config as an artifact."""
        if not self._connect():
            return
        run = self._client.create_run(self._experiment_id(), run_name=self._cfg.run_name, tags=tags)
        self.run_id = run.info.run_id
        self._log_params(params)
        self._client.log_text(self.run_id, config_yaml, "config.yaml")
        self._sender = _MetricSender(self._client, self.run_id)

    def reattach(
        self, run_id: str | None, params: dict[str, str], tags: dict[str, str], config_yaml: str, checkpoint: str
    ) -> None:
        """Continues the run a checkpoint was written by, so its curves stay one line in the UI.

        Params are immutable in MLflow: what changed since the run began goes into tags named
        `resume.<n>.<key>`. A run missing from this store (a copied checkpoint, a new store)
        gets a new run, tagged with the checkpoint it continues.
        """
        if not self._connect():
            return
        try:
            run = self._client.get_run(run_id) if run_id else None
        except MlflowException:
            run = None
        if run is None:
            log.info(f"MLflow run {run_id} is not in {self._cfg.tracking_uri}; continuing in a new run")
            self.start(params, {**tags, "resumed_from_checkpoint": checkpoint}, config_yaml)
            return
        self.run_id = run_id
        self._client.update_run(run_id, status="RUNNING")
        resumes = int(run.data.tags.get("resumes", "0")) + 1
        old_params = run.data.params
        changed = {
            f"resume.{resumes}.{key}": value for key, value in params.items() if old_params.get(key, value) != value
        }
        self._log_params({key: value for key, value in params.items() if key not in old_params})
        self.set_tags({**tags, **changed, "resumes": str(resumes), f"resume.{resumes}.checkpoint": checkpoint})
        self._sender = _MetricSender(self._client, run_id)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queues metrics; returns at once."""
        if self._sender is not None:
            self._sender.put(metrics, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._client is not None and self.run_id is not None:
            for key, value in tags.items():
                self._client.set_tag(self.run_id, key, value)

    def flush(self) -> None:
        if self._sender is not None:
            self._sender.flush()

    def finish(self, status: str) -> None:
        """Sends what is queued and ends the run as FINISHED, KILLED or FAILED."""
        if self._sender is None:
            return
        self._sender.close()
        try:
            self._client.set_terminated(self.run_id, status=status)
        except Exception as error:  # the server may be gone; the run itself is done
            log.warning(f"could not mark MLflow run {self.run_id} {status}: {error}")

    def _connect(self) -> bool:
        """Opens the store only when a run starts: a run that fails its preflight leaves no trace."""
        if self._cfg.enabled and self._client is None:
            self._client = MlflowClient(tracking_uri=self._cfg.tracking_uri)
        return self._client is not None

    def _experiment_id(self) -> str:
        experiment = self._client.get_experiment_by_name(self._cfg.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        return self._client.create_experiment(
            self._cfg.experiment_name, artifact_location=_artifact_location(self._cfg)
        )

    def _log_params(self, params: dict[str, str]) -> None:
        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per call
            self._client.log_batch(self.run_id, params=items[start : start + 100])


def _artifact_location(cfg: MlflowConfig) -> str | None:
    """Artifacts beside an embedded sqlite store, not in whatever folder the job started from.
    A server decides for itself."""
    prefix = "sqlite:///"
    if not cfg.tracking_uri.startswith(prefix):
        return None
    return (Path(cfg.tracking_uri[len(prefix) :]).parent / "mlruns").as_uri()


class _MetricSender:
    """A queue and a thread that drains it into `log_batch` calls. Metrics that fail to send stay
    pending and go with the next batch."""

    def __init__(self, client, run_id: str) -> None:
        self._client, self._run_id = client, run_id
        self._queue: queue.Queue = queue.Queue()
        self._pending: list = []
        self._warned = False
        self._thread = threading.Thread(target=self._work, name="mlflow-metrics", daemon=True)
        self._thread.start()

    def put(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        for key, value in metrics.items():
            self._queue.put(Metric(key, float(value), timestamp, step))

    def flush(self, timeout: float = 60.0) -> None:
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60.0)
        if self._pending:
            log.warning(f"{len(self._pending)} metrics could not be sent to MLflow run {self._run_id}")

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or isinstance(item, threading.Event):
                self._send()
                if item is None:
                    return
                item.set()
                continue
            self._pending.append(item)
            if self._queue.empty() or len(self._pending) >= BATCH_LIMIT:
                self._send()

    def _send(self) -> None:
        while self._pending:
            batch = self._pending[:BATCH_LIMIT]
            try:
                self._client.log_batch(self._run_id, metrics=batch)
            except Exception as error:  # any failure of the store: keep training, keep the metrics
                if not self._warned:
                    log.warning(f"MLflow is not taking metrics ({error}); training goes on, metrics are kept")
                    self._warned = True
                return
            del self._pending[: len(batch)]
