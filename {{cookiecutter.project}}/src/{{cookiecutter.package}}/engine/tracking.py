"""MLflow: one run per training job across any number of resumes, from the training process's
side, which never imports MLflow.

Importing MLflow takes 2 s, and writing a metric into the embedded sqlite store costs about
0.5 ms of Python even in batches, a third of a demo training step; in the training process, both
would be paid by training. So everything MLflow is done by a child process (`python -m
<package>.engine.tracking drain`, in mlflow_store.py). run.py starts it before anything else, so that it
imports MLflow while this process imports torch; it opens or continues the run when asked, answers
its id, then sends the metrics it is handed, in batches, and ends the run. It runs in its own
session, so Ctrl-C and a killed trainer leave it to finish delivering what it was handed.

A store that is down costs a warning, never the run: metrics wait and are retried, and those that
never got through are written to a file, with the status the run should have ended with, that
`python -m <package>.engine.tracking replay` sends later. The sender confirms what it has delivered (or
written to that file); if it dies (killed, out of memory), the training process writes what was
not confirmed, and everything after it, the end of the run included, to the same file, and names
the models it did not log, which a resume logs.

Files (artifacts, images) go the same way: written by the training process in the checkpoint
folder's `unsent-files/`, handed over by name, logged by the sender, which deletes each once the
store has it; kept and retried with the metrics, and named in the spill file when they never got
through, where they wait, on disk, for `replay`, which deletes them once sent.
"""

import argparse
import collections
import contextlib
import gc
import importlib.util
import itertools
import json
import logging
import os
import posixpath
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from omegaconf import OmegaConf

from .config import MlflowConfig, launched_as_main
from .errors import RunError, first_line
from .preemption import SIGNALS
from .unsent import STAGING, discard, replay_command, spill, spill_path, staged

log = logging.getLogger(__name__)

HAND_OVER_EVERY = 100  # metrics the training process gathers before passing them on
CLOSE_SECONDS = 60.0  # how long the end of a run waits for the sender to deliver the rest
IMAGE_KEY = re.compile(r"[a-zA-Z0-9_\-./ ]+")  # what MLflow's log_image takes as a key, which it checks only then


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
        self._models: list[dict] = []  # the checkpoints handed over to be logged as models

    @property
    def run_id(self) -> str | None:
        """The run's id, once the sender has opened it (this waits for that); None untracked."""
        return self._sender.opened()["run_id"] if self._sender is not None else None

    def state_dict(self) -> dict:
        """A checkpoint part: the run to continue after a resume; through a stretch trained
        untracked (a store that failed, mlflow.enabled=false), the run it continued."""
        return {"run_id": self.run_id or self._resumed_run_id}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state.get("run_id"), str | None):
            raise ValueError(f"an MLflow run id is a string; found {state.get('run_id')!r}")
        self._resumed_run_id = state["run_id"]

    def open(
        self, params: dict[str, str], tags: dict[str, str], config_yaml: str, checkpoint: Path | None, datasets: list
    ) -> None:
        """Asks the sender process (started now, unless run.py did) for a run, with the flattened
        config as params, the resolved config as an artifact and the `datasets` it reads as inputs
        (provenance.datasets); or, resuming from `checkpoint`,
        for the run that wrote it (mlflow_store.RunOpener). Returns at once: the sender opens the
        run while training starts, and the store is opened only then, so a run that fails its
        preflight leaves no trace."""
        if not (self._cfg.enabled and self._main):
            return
        self._sender = _take_sender()
        self._sender.spill_dir = self._spill_dir
        asked = {
            "mlflow": OmegaConf.to_container(self._cfg, resolve=True),
            "spill_dir": str(self._spill_dir),
            "params": params,
            "tags": tags,
            "config_yaml": config_yaml,
            "datasets": datasets,
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

    @property
    def logs(self) -> bool:
        """Whether this process delivers what it is handed: tracked, and rank 0 (or alone). Other
        processes, and a run whose store failed at its start, need not render a file at all."""
        return self._cfg.enabled and self._main and not (self._sender is not None and self._sender.untracked)

    def staging_dir(self) -> Path:
        """The folder to write a file in before handing it over (log_artifact, log_image): the
        checkpoint folder's `unsent-files/`, where a file the store did not take stays, for `replay`."""
        folder = self._spill_dir / STAGING
        if folder.is_symlink():
            raise RunError(
                f"{folder} is a symbolic link, which files for MLflow would be written through; it holds only files "
                f"of this run's: remove it (rm {folder}) and run again"
            )
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Hands over `path`, a file written in staging_dir(), to be logged as MLflow's
        `log_artifact(path, artifact_path)` logs it; returns at once. The file is the tracker's from
        here: it is deleted once delivered, or at once where it has nowhere to go."""
        if artifact_path is not None and (  # as MLflow checks it, and only as the file is sent
            posixpath.normpath(artifact_path) != artifact_path
            or artifact_path == "."
            or artifact_path.startswith(("..", "/"))
        ):
            raise ValueError(
                f"artifact_path={artifact_path!r} is no folder of the run's artifacts; give a relative one, such as "
                f"'figures', or None"
            )
        self._hand_over(path, {"artifact_path": artifact_path})

    def log_image(self, path: Path, key: str, step: int) -> None:
        """Hands over `path`, an image written in staging_dir() (a PNG), to be logged as MLflow's
        `log_image(image, key=key, step=step)` logs it, in the run's image slider; owned as in
        log_artifact."""
        if not IMAGE_KEY.fullmatch(key):
            raise ValueError(f"the image key {key!r} is not one MLflow takes; use letters, digits, spaces and _ - . /")
        self._hand_over(path, {"key": key, "step": int(step), "timestamp": int(time.time() * 1000)})

    def _hand_over(self, path: Path, what: dict) -> None:
        name = os.path.relpath(path, self._spill_dir)
        staged(self._spill_dir, name)  # a file elsewhere would be deleted once sent: the caller's mistake
        if self._sender is None or not self.logs:  # not this process's to deliver: nowhere to go
            discard(self._spill_dir, name)
        elif not self._sender.send_file({"path": name, **what}):
            log.warning(f"{path} was handed to MLflow after the end of the run, and is not logged")
            discard(self._spill_dir, name)

    def log_models(self, checkpoints: list[dict], model: dict, example: dict) -> None:
        """Asks the sender to log the model of each of `checkpoints` (name, path, step) as an MLflow
        model of the run, once the metrics before are delivered; `model` builds it (its `_target_`
        and arguments), `example` is an input it takes (values, dtype). The sender reads the weights
        and writes the copy: training does not wait."""
        if self._sender is not None and checkpoints:
            self._models = checkpoints
            self._sender.send({"models": {"checkpoints": checkpoints, "model": model, "example": example}})

    def flush(self) -> None:
        """Hands every metric so far to the sender process, which delivers them even if this
        process dies next; does not wait for the store."""
        if self._sender is not None:
            self._sender.flush()

    def log_checkpoint(self, loss: float, step: int) -> None:
        """What a checkpoint proves, `checkpoint/loss`, handed over before the process can die."""
        self.log_metrics({"checkpoint/loss": loss}, step)
        self.flush()

    def finish(self, status: str) -> None:
        """Ends the run as FINISHED, KILLED or FAILED, after the metrics still queued.

        The sender process ends it, so that the run is not over in the UI while metrics still
        arrive; and, if the store refuses, it records the end in the spill file after the
        metrics it could not send, alone at that file, so `replay` ends the run later. If the
        sender died, this process has written them there itself, and now replays that file; and
        says which of the models it handed over are not logged.
        """
        if self._sender is None:
            return
        opened = self._sender.opened()
        run_id = opened["run_id"]
        end = {"status": status, "end_time": int(time.time() * 1000), "resumes": opened["resumes"]} if run_id else None
        if (spilled := self._sender.close(end)) is not None:
            self._replay(*spilled)
        if self._sender.died is not None and self._models:
            self._unlogged(self._sender.died)

    def _replay(self, died: str, spill_file: Path, first_step: int | None) -> None:
        """What a dead sender left to this process, sent now (importing MLflow, as only here)."""
        from .mlflow_store import replay

        kept = "the end of the run was" if first_step is None else f"the metrics from step {first_step} on were"
        said = f"the MLflow sender process died ({died}); {kept} kept in {spill_file}"
        try:
            replay(spill_file, self._cfg.tracking_uri)
        except Exception as error:
            log.warning(
                f"{said}, and could not be sent ({first_line(error)}); the run shows RUNNING in MLflow until "
                f"they are: {replay_command(spill_file, self._cfg.tracking_uri)}"
            )
            return
        spill_file.unlink()
        log.warning(f"{said}; sent now, with the end of the run")

    def _unlogged(self, died: str) -> None:
        """Which models a sender that died did not log, and how to log them, in one line; one it left
        PENDING is marked FAILED (mlflow_store.unlogged). A resume logs them: the sender of a run that
        finished logs the models it lacks, once."""
        from .mlflow_store import connect, unlogged

        try:
            left = unlogged(connect(self._cfg.tracking_uri), self.run_id, self._models)
        except Exception:  # the store cannot say: then the next sender marks what was left PENDING
            left = self._models
        if left:
            models = " and ".join(
                f"the {model['name']} model (step {model['step']}, {model['path']})" for model in left
            )
            was, them = ("was", "it") if len(left) == 1 else ("were", "them")
            log.warning(
                f"{models} {was} not logged to MLflow: the sender process died ({died}); run the same command "
                f"with resume=last to log {them} (it trains no further)"
            )


class _Handover:
    """The training process's side of the sender: hands it requests, metrics and files, as JSON
    lines, through a pipe, from a thread of its own, so a full pipe never blocks training; reads,
    from another, its answer to `open`, then how many metrics and which files it has confirmed so
    far, and that it has ended the run.

    Metrics, files, and the end of the run, stay here until confirmed. If the sender dies, those
    and everything handed over after go to the run's spill file instead, for `replay`.
    """

    def __init__(self) -> None:
        command = [sys.executable, "-m", __name__, "drain"]
        self._child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self.spill_dir: Path | None = None  # set by the run that opens (Tracker.open)
        self._answer: dict | None = None
        self._answered = threading.Event()
        self._lock = threading.Lock()  # metrics come from the training thread and the checkpoint writer
        self._gathered: list[list] = []
        self._batches: queue.Queue = queue.Queue()
        # Metric rows handed over and not yet confirmed, in order, and how many rows were taken off
        # its front so far (confirmed, or spilled after a death), counted from the start.
        self._unconfirmed: collections.deque[list] = collections.deque()
        self._taken_off = 0
        self._held = threading.Lock()  # _unconfirmed, shared by the writer and the reader
        self._keeping = True  # until the sender answers that the run is untracked: nothing to keep then
        self._files: dict[int, dict] = {}  # the files handed over and not yet confirmed, by number; under _held
        self._numbers = itertools.count()
        self._closed = False  # the end is handed over: nothing after it is read
        self._end: dict | None = None  # the end of the run, once handed over, until confirmed
        self._died: str | None = None  # how the sender ended, once it has died
        self._spilled: tuple[Path, int | None] | None = None  # the spill file, and the first step written to it
        self._reader = threading.Thread(target=self._read, name="mlflow-answers", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="mlflow-hand-over", daemon=True)
        self._writer.start()

    def opened(self) -> dict:
        """The sender's answer to `open`: the run's id (None: untracked) and its resumes so far."""
        self._answered.wait()
        if self._answer is None:
            log.warning("the MLflow sender process stopped before opening the run; training goes on untracked")
            self._answer = {"run_id": None, "resumes": 0}
        return self._answer

    @property
    def untracked(self) -> bool:
        """The sender has answered, or died, without a run: what is handed over has nowhere to go."""
        return self._answered.is_set() and (self._answer is None or self._answer["run_id"] is None)

    @property
    def died(self) -> str | None:
        """How the sender ended (its exit code), if it died."""
        return self._died

    def send(self, request: dict) -> None:
        with self._lock:
            self._hand_over()  # in order with the metrics before it
            self._batches.put(request)

    def send_file(self, what: dict) -> bool:
        """Hands over a file to deliver (`what`: its path in the checkpoint folder, and how to log
        it); False once the run is closed, as nothing would read it."""
        with self._lock:
            if self._closed:
                return False
            self._hand_over()
            self._batches.put({"file": what, "id": next(self._numbers)})
        return True

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

    def close(self, end: dict | None) -> tuple[str, Path, int | None] | None:
        """Hands over the rest and the end of the run (None: no run was opened), then waits for
        the sender to deliver them, up to `CLOSE_SECONDS`. If it died instead: how, the spill file
        that holds what it left, and the first step there."""
        with self._lock:
            self._closed = True
        if end is not None:
            self.send({"end": end})
        self.flush()
        self._batches.put(None)
        self._writer.join()
        try:
            returncode = self._child.wait(timeout=CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning(
                f"MLflow is slow: process {self._child.pid} goes on delivering the last metrics, the end of the run "
                f"and its models"
            )
            return None
        if returncode != 0:
            self._reader.join(timeout=CLOSE_SECONDS)  # its confirmations so far: not spilled twice
            self._sender_died(f"exit code {returncode}")
        return None if self._spilled is None else (self._died, *self._spilled)

    def _read(self) -> None:
        """The answer to `open`, then the count of metrics confirmed and the number of each file
        confirmed, line by line, and "ended", until the sender's output ends: it is done, or dead
        (then the writer learns it at its next write)."""
        for line in self._child.stdout:
            if self._answer is None:
                self._answer = json.loads(line)
                self._answered.set()
                if self._answer["run_id"] is None:
                    with self._held:
                        self._keeping = False
                        self._unconfirmed.clear()
                        self._files.clear()  # the sender deletes them
                continue
            if isinstance(confirmed := json.loads(line), dict):  # a file, delivered or spilled
                with self._held:
                    self._files.pop(confirmed["file"], None)
                continue
            if confirmed == "ended":  # killed after this, logging models, it leaves no end
                self._end = None
                continue
            with self._held:
                self._take_off(confirmed - self._taken_off)
        self._answered.set()
        self._batches.put(_SENDER_ENDED)

    def _write(self) -> None:
        while (item := self._batches.get()) is not None:
            if item is _SENDER_ENDED:
                if self._child.wait() != 0:  # its output ends as it exits
                    self._sender_died(f"exit code {self._child.returncode}")
            elif self._died is not None:
                self._spill([item])
            else:
                # Kept before the sender can have it: its confirmation may come back before the write returns.
                if isinstance(item, list):
                    with self._held:
                        if self._keeping:
                            self._unconfirmed.extend(item)
                elif "file" in item:
                    with self._held:
                        if self._keeping:
                            self._files[item["id"]] = item["file"]
                elif "end" in item:
                    self._end = item
                try:
                    self._child.stdin.write(json.dumps(item) + "\n")
                    self._child.stdin.flush()
                except OSError:  # it is gone: what it confirmed before, it has delivered
                    self._child.wait()
                    self._reader.join(timeout=CLOSE_SECONDS)
                    self._sender_died(f"exit code {self._child.returncode}")
        if self._died is None:
            with contextlib.suppress(OSError):
                self._child.stdin.close()  # end of input: the sender delivers the rest and exits

    def _sender_died(self, how: str) -> None:
        """From now on, the spill file; first, what the sender had not confirmed, the end included."""
        if self._died is not None:
            return
        self._died = how
        with self._held:
            unconfirmed = list(self._unconfirmed)
            self._take_off(len(unconfirmed))
            files = [{"file": what} for what in self._files.values()]
            self._files.clear()
        self._spill([unconfirmed, *files] if self._end is None else [unconfirmed, *files, self._end])
        if self._spilled is not None:
            log.warning(
                f"the MLflow sender process died ({how}); this run's metrics go to {self._spilled[0]} from now on, "
                f"and are sent from there at the end of the run"
            )

    def _take_off(self, count: int) -> None:
        """Drops `count` rows off the front of `_unconfirmed` (fewer if it holds fewer); under `_held`."""
        for _ in range(min(count, len(self._unconfirmed))):
            self._unconfirmed.popleft()
        self._taken_off += max(count, 0)

    def _spill(self, items: list) -> None:
        run_id = self.opened()["run_id"]
        if run_id is None or self.spill_dir is None:  # untracked: nowhere they were going
            for item in items:
                if isinstance(item, dict) and "file" in item:
                    discard(self.spill_dir, item["file"]["path"])
            return
        rows = []
        for item in items:
            if isinstance(item, list):
                rows += [{"run_id": run_id, "key": k, "value": v, "timestamp": t, "step": n} for k, v, t, n in item]
            elif "file" in item:
                rows.append({"run_id": run_id, "file": item["file"]})
            elif "end" in item:
                rows.append({"run_id": run_id, **item["end"]})
        if not rows:
            return  # tags only: the next resume sets them again
        try:
            path = spill(spill_path(self.spill_dir, run_id), rows)
        except OSError as error:
            log.warning(f"could not write metrics for MLflow to {self.spill_dir} ({error.strerror}); they are lost")
            return
        steps = [row["step"] for row in rows if "step" in row]
        if self._spilled is None or self._spilled[1] is None:
            self._spilled = (path, min(steps, default=None))


_SENDER_ENDED = object()  # put by the reader when the sender's output ends


def main() -> None:
    parser = argparse.ArgumentParser(description="MLflow delivery for training runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("drain", help="internal: the sender process a training run starts")
    resend = commands.add_parser("replay", help="send metrics and files that a run could not deliver, and end the run")
    resend.add_argument("file", type=Path, help="an unsent-metrics-<run id>.jsonl file from the checkpoint folder")
    resend.add_argument("--tracking-uri", required=True, help="the store the run logs to, e.g. http://127.0.0.1:5000")
    arguments = parser.parse_args()
    from .mlflow_store import drain, replay

    if arguments.command == "drain":
        # SLURM signals every process of a job, this one too: it ends when the trainer closes its
        # pipe, every metric delivered or kept (a SIGKILL is the backstop).
        for number in SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        drain()
        gc.freeze()  # the trainer waits for this exit: spare it shutdown's collections (run.py says more)
        return
    try:
        sent, files, ends = replay(arguments.file, arguments.tracking_uri)
    except Exception as error:  # the store is still down, or is not the run's store
        raise SystemExit(
            f"error: could not replay {arguments.file} into {arguments.tracking_uri} ({first_line(error)}); "
            f"run the same command once the run's store is back: a metric sent twice is stored once"
        ) from None
    print(f"sent {sent} metrics" + f" and {files} files" * bool(files) + f" to {arguments.tracking_uri}")
    for run_id, outcome in ends.items():
        print(f"run {run_id}: {outcome}")


if __name__ == "__main__":
    main()
