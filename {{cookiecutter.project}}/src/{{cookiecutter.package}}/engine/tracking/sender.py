"""The sender process a training run starts (`drain`, run as `python -m <package>.engine.tracking
drain`): it opens or continues the run (mlflow_store.py), then delivers the metrics and files the
training process hands it, in batches, retrying while the store is away and spilling what never
got through to the run's unsent-metrics file; and `replay`, which sends that file later. Only
processes that talk to MLflow import it.
"""

import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import MlflowException

from ..config import MlflowConfig
from ..errors import first_line
from .logged_models import log_models, prepare_model_logging
from .mlflow_run import RunOpener, attach_run, open_run
from .mlflow_store import connect, end_run, record_origin, set_tags
from .unsent import discard, replay_command, skipped, spill, spill_path, staged, unsent_rows

log = logging.getLogger(__name__)

BATCH_LIMIT = 1000  # metrics per log_batch call, MLflow's own limit
# How long metrics gather before they are sent: a log_batch call costs the store milliseconds of
# CPU whatever its size, taken from training on a machine with few cores (bench/logging_overhead.py).
SEND_EVERY_SECONDS = 1.0
RETRY_SECONDS = 2.0  # how long metrics wait before the next try at a store that failed


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


def drain() -> None:
    """The sender process: waits for the first line on stdin, which asks for a run, opens it and
    answers its id on stdout, then delivers what follows until stdin ends. Started ahead of the
    run, it may see stdin end first: the run was not tracked. A run asked for to `attach` to (a
    resume with nothing left to train) is left as it is, but for the models it lacks."""
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever MLflow prints stays off the answer
    incoming: queue.Queue = queue.Queue()

    def read() -> None:  # a thread, so that retries go on while no new line comes
        for line in sys.stdin:
            try:
                incoming.put(json.loads(line))
            except json.JSONDecodeError:  # cut short: the training process died while writing it
                break
        incoming.put(None)

    threading.Thread(target=read, daemon=True).start()
    if (first := incoming.get()) is None:
        return
    asked = first.get("open") or first["attach"]
    cfg = MlflowConfig(**asked["mlflow"])
    opened = open_run(cfg, asked) if "open" in first else attach_run(cfg, asked["run_id"], asked["name"])

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
        monitor, model_logging = started(cfg, opened) if "open" in first else (None, None)
        spill_file = spill_path(Path(asked["spill_dir"]), opened.run_id)
        _Sender(opened.client, opened.run_id, spill_file, incoming, say, monitor, model_logging).run()
    finally:
        with contextlib.suppress(OSError):  # the trainer takes the end of this output for the sender's exit
            answer.close()


def started(cfg: MlflowConfig, opened: RunOpener) -> tuple[Any, Any]:
    """A leg's run, opened and its id answered: MLflow's system metrics started (`mlflow.system_metrics`),
    and, now that they cost the trainer nothing (the metrics that arrive meanwhile wait), what logging
    its models needs, and what the code ran from (git, the package list) recorded."""
    monitor = None
    if cfg.system_metrics:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(opened.run_id, resume_logging=opened.resumes > 0, tracking_uri=cfg.tracking_uri)
        monitor.start()
    model_logging = prepare_model_logging() if cfg.log_models != "none" else None
    record_origin(opened.client, opened.run_id, opened.resumes, cfg.untracked_content)
    return monitor, model_logging


def replay(path: Path, tracking_uri: str) -> tuple[int, int, dict[str, str]]:
    """Sends a file of unsent metrics to `tracking_uri`, and the files it names (deleting each
    once sent), then ends the runs it records the end of; returns how many metrics and files were
    sent, and what became of each recorded end, by run. A file named twice (spilled by a sender
    that died before it confirmed, and again by the trainer) is sent once: it is gone after. A line
    that cannot be sent (cut short, edited, a metric the store refuses) is skipped, and named."""
    client, metrics_by_run, files, ends = connect(tracking_uri), {}, [], {}
    for line, row in unsent_rows(path):
        if "status" in row:
            ends[row["run_id"]] = row  # a run resumed and stopped again: its last end counts
        elif "file" in row:
            files.append(row)
        else:
            metric = Metric(row["key"], row["value"], row["timestamp"], row["step"])
            metrics_by_run.setdefault(row["run_id"], []).append((line, metric))
    sent = sum(_replay_metrics(client, run_id, metrics, path) for run_id, metrics in metrics_by_run.items())
    sent_files = sum(deliver_file(client, row["run_id"], path.parent, row["file"]) for row in files)
    outcomes = {run_id: _replay_end(client, end) for run_id, end in ends.items()}
    return sent, sent_files, outcomes


def _replay_metrics(client: MlflowClient, run_id: str, metrics: list[tuple[int, Metric]], path: Path) -> int:
    """Sends `metrics`, each with its line in `path`, in batches; returns how many the store took. A
    batch it refuses as invalid is sent again a metric at a time: one it refuses (a key MLflow does
    not take) is skipped and named, not the rest with it."""
    taken = 0
    for start in range(0, len(metrics), BATCH_LIMIT):
        batch = metrics[start : start + BATCH_LIMIT]
        if _refusal(client, run_id, [metric for _, metric in batch]) is None:
            taken += len(batch)
            continue
        for line, metric in batch:
            if (refusal := _refusal(client, run_id, [metric])) is None:
                taken += 1
            else:
                skipped(path, line, f"MLflow refused it ({refusal})")
    return taken


def _refusal(client: MlflowClient, run_id: str, metrics: list[Metric]) -> str | None:
    """Logs `metrics`; where the store refuses them as invalid, what it said. Any other failure raises."""
    try:
        client.log_batch(run_id, metrics=metrics)
    except MlflowException as error:
        if error.error_code != "INVALID_PARAMETER_VALUE":
            raise
        return first_line(error)
    return None


def _replay_end(client: MlflowClient, end: dict) -> str:
    run = client.get_run(end["run_id"])
    if run.info.status != "RUNNING":
        return f"left {run.info.status}: it was ended since"
    # A run resumed after this end was recorded may be training now: its own job ends it.
    if run.data.tags.get("resumes", "0") != str(end["resumes"]):
        return "left RUNNING: it was resumed since"
    client.set_terminated(end["run_id"], status=end["status"], end_time=end["end_time"])
    return f"ended {end['status']}"
