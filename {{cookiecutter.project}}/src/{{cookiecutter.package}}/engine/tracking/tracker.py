"""MLflow: one run per training job across any number of resumes, from the training process's
side, which never imports MLflow.

Importing MLflow takes 2 s, and writing a metric into the embedded sqlite store costs about
0.5 ms of Python even in batches, a third of a demo training step; in the training process, both
would be paid by training. So everything MLflow is done by a child process (`python -m
<package>.engine.tracking drain`, in sender.py). run.py starts it before anything else, so that it
imports MLflow while this process imports torch; it opens or continues the run when asked, answers
its id, then sends the metrics it is handed, in batches, and ends the run. It runs in its own
session, so Ctrl-C and a killed trainer leave it to finish delivering what it was handed.

A store that is down costs a warning, never the run: metrics wait and are retried, and those that
never got through are written to a file, with the status the run should have ended with, that
`python -m <package>.engine.tracking replay` sends later. The sender confirms what it has delivered
(or written to that file); if it dies (killed, out of memory), the training process writes what was
not confirmed, and everything after it, the end of the run included, to the same file, and names
the models it did not log, which a resume logs.

Files (artifacts, images) go the same way: written by the training process in the checkpoint
folder's `unsent-files/`, handed over by name, logged by the sender, which deletes each once the
store has it; kept and retried with the metrics, and named in the spill file when they never got
through, where they wait, on disk, for `replay`, which deletes them once sent.
"""

import argparse
import functools
import gc
import importlib.util
import logging
import os
import posixpath
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlparse

from omegaconf import OmegaConf

from .. import priority
from ..config import MlflowConfig, launched_as_main
from ..errors import RunError, first_line
from ..signals import SIGNALS
from .sender_pipe import Handover
from .unsent import STAGING, discard, drop_staging, replay_command, staged

log = logging.getLogger(__name__)

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


_started: "Handover | None" = None  # the sender `start_sender` started, until a run takes it


def start_sender(idle: bool = False) -> None:
    """Starts the sender process ahead of the run (run.py, first thing): its imports, 2 s of
    MLflow, then run beside this process's. Only where a run can track: one process, or rank 0.
    Unused (`mlflow.enabled=false`), it ends with this process. `idle`: its imports at the lowest
    priority (priority.py), in place of one started before (a standby leg's: standby.py)."""
    global _started
    if launched_as_main():
        if _started is not None:
            _started.discard()
        _started = Handover(idle)


def _take_sender() -> "Handover":
    global _started
    sender, _started = _started, None
    return sender or Handover()


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
        # The run's start, as the run sets up: the sender creates it only when it gets to it, seconds
        # later in a sweep job (its MLflow import), and MLflow's Duration would miss them.
        self._started = int(time.time() * 1000)
        self._resumed_run_id: str | None = None  # the run a restored checkpoint was written by
        self._sender: Handover | None = None
        self._models: list[dict] = []  # the checkpoints handed over to be logged as models

    @property
    def run_id(self) -> str | None:
        """The run's id, once the sender has opened it (this waits for that); None untracked."""
        return self._sender.opened()["run_id"] if self._sender is not None else None

    def state_dict(self) -> dict:
        """A checkpoint part: the run to continue after a resume; through a stretch trained
        untracked (a store that failed, mlflow.enabled=false), the run it continued. A resumed leg
        does not wait for the sender to answer (it imports MLflow, seconds that the leg's first save
        would wait for): until it has, the run is the one the leg continues, as the sender opens it
        unless that run is not this run's, or gone (then the next save holds the new one, and a
        checkpoint saved before finds it: mlflow_run.RunOpener)."""
        if self._sender is not None and self._resumed_run_id is not None and not self._sender.answered:
            return {"run_id": self._resumed_run_id}
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
        (provenance.datasets); or, resuming from `checkpoint`, for the run that wrote it, where that
        is this run (mlflow_run.RunOpener). Returns at once: the sender opens the run while training
        starts, and the store is opened only then, so a run that fails its preflight leaves no trace."""
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
            "started": self._started,
        }
        self._sender.send({"open": asked})

    def attach(self, name: str) -> None:
        """For a resume with nothing left to train: asks the sender for the run a restored checkpoint
        was written by, where that is this run (`name`'s), left as it is but for the models it lacks
        (log_models; a sender that died as it logged them). Only where mlflow.log_models asks for
        models; else the store is not opened."""
        if self._cfg.enabled and self._main and self._cfg.log_models != "none" and self._resumed_run_id:
            self._sender = _take_sender()
            self._sender.spill_dir = self._spill_dir
            settings = OmegaConf.to_container(self._cfg, resolve=True)
            asked = {
                "mlflow": settings,
                "spill_dir": str(self._spill_dir),
                "run_id": self._resumed_run_id,
                "name": name,
            }
            self._sender.send({"attach": asked})

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
        here: it is deleted once delivered, or at once where it has nowhere to go or is refused."""
        if artifact_path is not None and (  # as MLflow checks it, and only as the file is sent
            posixpath.normpath(artifact_path) != artifact_path
            or artifact_path == "."
            or artifact_path.startswith(("..", "/"))
        ):
            self._refuse(
                path,
                f"artifact_path={artifact_path!r} is no folder of the run's artifacts; give a relative one, such as "
                f"'figures', or None",
            )
        self._hand_over(path, {"artifact_path": artifact_path})

    def log_image(self, path: Path, key: str, step: int) -> None:
        """Hands over `path`, an image written in staging_dir() (a PNG), to be logged as MLflow's
        `log_image(image, key=key, step=step)` logs it, in the run's image slider; owned as in
        log_artifact."""
        if not IMAGE_KEY.fullmatch(key):
            self._refuse(
                path, f"the image key {key!r} is not one MLflow takes; use letters, digits, spaces and _ - . /"
            )
        self._hand_over(path, {"key": key, "step": int(step), "timestamp": int(time.time() * 1000)})

    def _refuse(self, path: Path, reason: str) -> NoReturn:
        """Raises `reason` (ValueError) for a file handed over under a name MLflow would refuse: the
        file, the tracker's, is deleted first, or it would wait in staging_dir() forever."""
        discard(self._spill_dir, os.path.relpath(path, self._spill_dir))
        raise ValueError(reason)

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

    def flush(self) -> Callable[[], object]:
        """Hands every metric so far to the sender process; returns the wait for them to be written
        to its pipe (or, the sender dead, to the spill file), from where they reach MLflow even if
        this process dies next. Neither waits for the store."""
        return self._sender.flush().wait if self._sender is not None else lambda: None

    def log_checkpoint(self, loss: float, step: int) -> None:
        """What a checkpoint proves, `checkpoint/loss`, handed over before the process can die."""
        self.log_metrics({"checkpoint/loss": loss}, step)
        self.flush()

    def finish(self, status: str | None) -> None:
        """Ends the run as FINISHED, KILLED or FAILED (None: a run only attached to, left as it was),
        after the metrics still queued; then drops the folder of files for MLflow, once empty.

        The sender process ends it, so that the run is not over in the UI while metrics still
        arrive; and, if the store refuses, it records the end in the spill file after the
        metrics it could not send, alone at that file, so `replay` ends the run later. If the
        sender died, this process has written them there itself, and now replays that file; and
        says which of the models it handed over are not logged.
        """
        if self._sender is not None:
            opened, now = self._sender.opened(), int(time.time() * 1000)
            end = {"status": status, "end_time": now, "resumes": opened["resumes"]}
            if (spilled := self._sender.close(end if opened["run_id"] and status else None)) is not None:
                self._replay(*spilled)
            if self._sender.died is not None and self._models:
                self._unlogged(self._sender.died)
        if self._main:  # one process tidies the folder that every process's files pass through
            drop_staging(self._spill_dir)

    def _replay(self, died: str, spill_file: Path, first_step: int | None) -> None:
        """What a dead sender left to this process, sent now (importing MLflow, as only here)."""
        from .sender import replay

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
        PENDING is marked FAILED (logged_models.unlogged). A resume logs them: the sender of a run that
        finished logs the models it lacks, once."""
        from .logged_models import unlogged
        from .mlflow_store import connect

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


def main() -> None:
    parser = argparse.ArgumentParser(description="MLflow delivery for training runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    draining = commands.add_parser("drain", help="internal: the sender process a training run starts")
    draining.add_argument("--idle", action="store_true", help="import MLflow at the lowest CPU priority")
    resend = commands.add_parser("replay", help="send metrics and files that a run could not deliver, and end the run")
    resend.add_argument("file", type=Path, help="an unsent-metrics-<run id>.jsonl file from the checkpoint folder")
    resend.add_argument("--tracking-uri", required=True, help="the store the run logs to, e.g. http://127.0.0.1:5000")
    arguments = parser.parse_args()
    if arguments.command == "drain":
        # A standby leg's sender imports at the lowest priority: the leg that trains keeps the cores.
        importing = functools.partial(importlib.import_module, f"{__package__}.sender")
        drain = (priority.lowest(importing) if arguments.idle else importing()).drain
        # SLURM signals every process of a job, this one too: it ends when the trainer closes its
        # pipe, every metric delivered or kept (a SIGKILL is the backstop).
        for number in SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        drain()
        gc.freeze()  # the trainer waits for this exit: spare it shutdown's collections (run.py says more)
        return
    from .sender import replay

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
