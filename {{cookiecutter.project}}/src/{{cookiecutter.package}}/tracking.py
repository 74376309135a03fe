"""MLflow: one run per training job across any number of resumes, from the training process's
side, which never imports MLflow.

Importing MLflow takes 2 s, and writing a metric into the embedded sqlite store costs about
0.5 ms of Python even in batches, a third of a demo training step; in the training process, both
would be paid by training. So everything MLflow is done by a child process (`python -m
<package>.tracking drain`, in mlflow_store.py). run.py starts it before anything else, so that it
imports MLflow while this process imports torch; it opens or continues the run when asked, answers
its id, then sends the metrics it is handed, in batches, and ends the run. It runs in its own
session, so Ctrl-C and a killed trainer leave it to finish delivering what it was handed.

A store that is down costs a warning, never the run: metrics wait and are retried, and those that
never got through are written to a file, with the status the run should have ended with, that
`python -m <package>.tracking replay` sends later.
"""

import argparse
import gc
import importlib.util
import json
import logging
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import OmegaConf

from .config import MlflowConfig, launched_as_main
from .errors import RunError, first_line

log = logging.getLogger(__name__)

HAND_OVER_EVERY = 100  # metrics the training process gathers before passing them on
CLOSE_SECONDS = 60.0  # how long the end of a run waits for the sender to deliver the rest


def check_tracking_uri(cfg: MlflowConfig) -> None:
    """Refuses, in one line, a tracking URI this MLflow cannot open; MLflow itself says so only
    seconds into the run, in a traceback. Reads the URI and nothing else (no store is opened, no
    network): a well-formed store that is down is left to the sender, which trains on untracked.
    The two kinds of store the project documents pass without importing MLflow."""
    address = urlparse(cfg.tracking_uri)
    if address.scheme == "sqlite" or (address.scheme in ("http", "https") and address.hostname):
        return
    from .mlflow_store import check_uri

    check_uri(cfg)


def spill_path(folder: Path, run_id: str) -> Path:
    """The file of the metrics (and the end) that a run could not deliver, for `replay`."""
    return folder / f"unsent-metrics-{run_id}.jsonl"


_started: "_Handover | None" = None  # the sender `start_sender` started, until a run takes it


def start_sender() -> None:
    """Starts the sender process ahead of the run (run.py, first thing): its imports, 2 s of
    MLflow, then run beside this process's. Only where a run can track: one process, or rank 0.
    Unused (`mlflow.enabled=false`), it ends with this process."""
    global _started
    if launched_as_main():
        _started = _Handover()


def _take_sender() -> "_Handover":
    global _started
    sender, _started = _started, None
    return sender or _Handover()


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
        self._cfg, self._spill_dir, self._main = cfg, spill_dir, main
        self._resumed_run_id: str | None = None  # the run a restored checkpoint was written by
        self._sender: _Handover | None = None

    @property
    def run_id(self) -> str | None:
        """The run's id, once the sender has opened it (this waits for that); None untracked."""
        return self._sender.opened()["run_id"] if self._sender is not None else None

    def state_dict(self) -> dict:
        """A checkpoint part: the run to continue after a resume."""
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state.get("run_id"), str | None):
            raise ValueError(f"an MLflow run id is a string; found {state.get('run_id')!r}")
        self._resumed_run_id = state["run_id"]

    def open(self, params: dict[str, str], tags: dict[str, str], config_yaml: str, checkpoint: Path | None) -> None:
        """Asks the sender process (started now, unless run.py did) for a run, with the flattened
        config as params and the resolved config as an artifact; or, resuming from `checkpoint`,
        for the run that wrote it (mlflow_store.RunOpener). Returns at once: the sender opens the
        run while training starts, and the store is opened only then, so a run that fails its
        preflight leaves no trace."""
        if not (self._cfg.enabled and self._main):
            return
        self._sender = _take_sender()
        asked = {
            "mlflow": OmegaConf.to_container(self._cfg, resolve=True),
            "spill_dir": str(self._spill_dir),
            "params": params,
            "tags": tags,
            "config_yaml": config_yaml,
            "checkpoint": checkpoint and str(checkpoint),
            "run_id": self._resumed_run_id,  # the run to continue, if the store has it
        }
        self._sender.send({"open": asked})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queues metrics; returns at once."""
        if self._sender is not None:
            self._sender.put(metrics, step)

    def set_tags(self, tags: dict[str, str]) -> None:
        if self._sender is not None:
            self._sender.send({"tags": tags})

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
        if self._sender is None:
            return
        opened = self._sender.opened()
        run_id = opened["run_id"]
        end = {"status": status, "end_time": int(time.time() * 1000), "resumes": opened["resumes"]} if run_id else None
        if not self._sender.close(end) and end is not None:  # the sender died: no one else writes the spill file
            from .mlflow_store import connect, end_run

            end_run(connect(self._cfg.tracking_uri), run_id, end, spill_path(self._spill_dir, run_id))


class _Handover:
    """The training process's side of the sender: hands it requests and metrics, as JSON lines,
    through a pipe, from a thread of its own, so a full pipe never blocks training; reads its one
    answer, the opened run, when first asked."""

    def __init__(self) -> None:
        command = [sys.executable, "-m", __name__, "drain"]
        self._child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self._answer: dict | None = None
        self._lock = threading.Lock()  # metrics come from the training thread and the checkpoint writer
        self._gathered: list[list] = []
        self._batches: queue.Queue = queue.Queue()
        self._handed_over = True  # until the pipe breaks
        self._writer = threading.Thread(target=self._write, name="mlflow-hand-over", daemon=True)
        self._writer.start()

    def opened(self) -> dict:
        """The sender's answer to `open`: the run's id (None: untracked) and its resumes so far."""
        if self._answer is None:
            line = self._child.stdout.readline()
            self._answer = json.loads(line) if line else {"run_id": None, "resumes": 0}
            if not line:
                log.warning("the MLflow sender process stopped before opening the run; training goes on untracked")
        return self._answer

    def send(self, request: dict) -> None:
        with self._lock:
            self._hand_over()  # in order with the metrics before it
            self._batches.put(request)

    def put(self, metrics: dict[str, float], step: int) -> None:
        timestamp = int(time.time() * 1000)
        with self._lock:
            self._gathered.extend([key, float(value), timestamp, step] for key, value in metrics.items())
            if len(self._gathered) >= HAND_OVER_EVERY:
                self._hand_over()

    def flush(self) -> None:
        with self._lock:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._gathered:
            self._batches.put(self._gathered)
            self._gathered = []

    def close(self, end: dict | None) -> bool:
        """Hands over the rest and the end of the run (None: no run was opened), then waits for
        the sender to deliver them, up to `CLOSE_SECONDS`. False when the sender died first."""
        if end is not None:
            self.send({"end": end})
        self.flush()
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


def main() -> None:
    parser = argparse.ArgumentParser(description="MLflow delivery for training runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("drain", help="internal: the sender process a training run starts")
    resend = commands.add_parser("replay", help="send metrics that a run could not deliver, and end the run")
    resend.add_argument("file", type=Path, help="an unsent-metrics-<run id>.jsonl file from the checkpoint folder")
    resend.add_argument("--tracking-uri", required=True, help="the store the run logs to, e.g. http://127.0.0.1:5000")
    arguments = parser.parse_args()
    from .mlflow_store import drain, replay

    if arguments.command == "drain":
        drain()
        gc.freeze()  # the trainer waits for this exit: spare it shutdown's collections (run.py says more)
        return
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
