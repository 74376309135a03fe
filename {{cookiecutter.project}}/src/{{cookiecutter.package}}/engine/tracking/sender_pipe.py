"""The training process's end of the pipe to the MLflow sender process (tracker.py says why the
sender exists): requests, metrics and files go out as JSON lines from a thread of its own; its
answers come back on another; what the sender has not confirmed stays here, and goes to the run's
spill file if the sender dies.
"""

import collections
import contextlib
import itertools
import json
import logging
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from .unsent import discard, spill, spill_path

log = logging.getLogger(__name__)

HAND_OVER_EVERY = 100  # metrics the training process gathers before passing them on
CLOSE_SECONDS = 60.0  # how long the end of a run waits for the sender to deliver the rest


class Handover:
    """The training process's side of the sender: hands it requests, metrics and files, as JSON
    lines, through a pipe, from a thread of its own, so a full pipe never blocks training (a save
    waits, with `flush`, for the metrics of the steps it covers); reads, from another, its answer
    to `open`, then how many metrics and which files it has confirmed so far, and that it has
    ended the run.

    Metrics, files, and the end of the run, stay here until confirmed. If the sender dies, those
    and everything handed over after go to the run's spill file instead, for `replay`.
    """

    def __init__(self, idle: bool = False) -> None:
        command = [sys.executable, "-m", __package__, "drain", *["--idle"] * idle]
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

    def discard(self) -> None:
        """Ends a sender that was handed nothing yet, at once."""
        self._batches.put(None)  # the writer ends here, never to hear that the sender was killed
        self._child.kill()
        self._child.wait()

    def opened(self) -> dict:
        """The sender's answer to `open`: the run's id (None: untracked) and its resumes so far."""
        self._answered.wait()
        if self._answer is None:
            log.warning("the MLflow sender process stopped before opening the run; training goes on untracked")
            self._answer = {"run_id": None, "resumes": 0}
        return self._answer

    @property
    def answered(self) -> bool:
        """Whether the sender has answered `open` (or died): `opened()` would not wait."""
        return self._answered.is_set()

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

    def flush(self) -> threading.Event:
        """Hands over the metrics gathered so far; the event is set once everything handed over
        until now is written to the sender's pipe (or, the sender dead, to the spill file), from
        where it reaches MLflow even if this process dies next."""
        written = threading.Event()
        with self._lock:
            self._hand_over()
            if self._closed:  # the writer ends with the run: close() waits for it instead
                written.set()
            else:
                self._batches.put(written)
        return written

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
            if isinstance(item, threading.Event):  # a flush: what came before it is written
                item.set()
            elif item is _SENDER_ENDED:
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
