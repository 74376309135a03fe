"""Callbacks: your own code, called by the recipe at its points, added by config rather than by an
edit of train.py. `callbacks:` maps names to components built by `_target_`, as metrics do
(components.py checks their settings before anything is built); configs/callbacks/ holds ready
ones (`callbacks=[confusion_matrix,text_sample]`), and `+callbacks.<name>._target_=<class>` adds
one. A callback defines any of these, Lightning's names where it has them:

    on_fit_start(run)                 # training is about to start (again, at each resume)
    on_train_step_end(run, loss)      # after each optimizer step: `loss`, the step's mean over the
                                      # processes, a float32 tensor on the device (.item() waits for it)
    on_validation_end(run, metrics)   # once a step is validated: {"val/loss": ..., ...}
    on_save_checkpoint(run, path)     # a checkpoint of the run is on disk at `path`
    on_fit_end(run, metrics)          # the run has trained to its end and saved: its final metrics

`run` is the run as a callback sees it (CallbackRun): `run.step`, the run's parts (`run.model`,
`run.val_loader`, `run.data`, `run.task`, `run.cfg`, `run.world`, ...), and MLflow's own names to
log through the run's sender: `log_metrics`, `log_figure`, `log_image`, `log_text`, `log_dict`,
`log_artifact`; `run.predictions()`, the model's outputs and targets over the validation set, and
`run.autocast()`, the run's precision, for a callback that runs the model. Under ddp and fsdp
every process calls the hooks (they may take part in collective steps); what they log is logged
once, by rank 0, and the others skip the rendering.

A callback with `state_dict()` and `load_state_dict(state)` is saved in each checkpoint (the
`callbacks` part, by its name) and resumes with the run. Its state is what a checkpoint may hold,
checked at each save before anything is written (state.py): tensors and plain values, as the
restricted loader that reads checkpoints back takes them (a path as `str(path)`), in dicts, lists and
tuples that neither contain themselves nor nest a hundred deep.

A hook that raises, or that runs longer than `trainer.hook_timeout_s` (time_limit.py), stops the run in one
line that names it and its hook, after the last good checkpoint: nothing after the hook is saved; one
that swallows the interrupt of its overrun is stopped all the same. A stop (SIGTERM, Ctrl-C:
preemption.py) interrupts a hook at once, swallowed or not, and the run's later hooks are skipped;
the run saves as at any stop, unless a callback that keeps state takes part in the hook cut short:
its state may be half-updated, so nothing more is saved, and the newest checkpoint stays the newest.
The time hooks hold the run is their own in the run's goodput (`hooks`), not training's.
"""

import json
import logging
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from hydra.errors import InstantiationException
from omegaconf import DictConfig

from .. import components
from ..distributed import World
from ..errors import RunError, first_line, listed
from ..lifecycle.preemption import Preemption
from ..precision import autocast
from ..validation import in_float32, in_step
from .state import refused as refused_state
from .time_limit import Hold, Holding, Interrupted

log = logging.getLogger(__name__)

HOOKS = ("on_fit_start", "on_train_step_end", "on_validation_end", "on_save_checkpoint", "on_fit_end")
# The outcome of a hook that raised or overran, or of a state refused: above every signal's number,
# a stop's outcome, so that it prevails where the processes agree.
FAILED = 1000


class CallbackError(RunError):
    """A callback raised in one of its hooks, overran its time, or holds a state no checkpoint can;
    the recipe adds where the run stands on disk. `stopped`: the stop that cut short a hook in which
    a callback that keeps state takes part, after which the run stops as at a signal, but unsaved."""

    def __init__(self, message: str, stopped: signal.Signals | None = None) -> None:
        super().__init__(message)
        self.stopped = stopped


class Callbacks:
    """The callbacks `callbacks:` names, built, and the one checkpoint part that holds their state.

    For each hook, the callbacks that define it are listed once, here: a step calls
    `on_train_step_end` only where `stepping` is true, so callbacks without a per-step hook cost
    a step one check of a flag (bench/hooks_overhead.py), and a per-step hook's time bound costs no
    system call (time_limit.py)."""

    def __init__(self, built: dict[str, Any], world: World) -> None:
        self._built, self._world = built, world
        self._named = {
            name: f"callbacks.{name} ({type(callback).__module__}.{type(callback).__qualname__})"
            for name, callback in built.items()
        }
        self._defining = {
            hook: [(name, callback) for name, callback in built.items() if callable(getattr(callback, hook, None))]
            for hook in HOOKS
        }
        self.stepping = bool(self._defining["on_train_step_end"])
        self._view: CallbackRun | None = None
        self._cut = False  # a stop cut a hook short: no hook is called again

    @classmethod
    def built(cls, node: DictConfig, world: World) -> "Callbacks":
        """Each of `node`'s callbacks built now, before step 1: a library one of them imports that is
        missing stops the run here, not at the first validation."""
        built = {}
        for name, settings in node.items():
            try:
                built[name] = components.build(f"callbacks.{name}", settings)
            except InstantiationException as error:
                if not isinstance(missing := error.__cause__, ImportError):
                    raise
                module = (missing.name or "").split(".")[0]
                needs = f"needs {module}: pip install {module}" if module else f"cannot import ({first_line(missing)})"
                raise RunError(f"callbacks.{name} {needs}") from None
        return cls(built, world)

    def call(self, hook: str, run: Any, *arguments: Any) -> None:
        """`hook(run, *arguments)` of each callback that defines it, in the order configured, each
        holding the run (time_limit.py): a stop interrupts it, and so does trainer.hook_timeout_s, and what
        reached it counts whether it let the interrupt out or not. Their time is the `hooks` bucket of
        the run's goodput. Every process agrees on how they ended (under ddp and fsdp: one small
        collective step, where a callback defines `hook`), so that all stop at the same point with the
        same line."""
        callbacks = self._defining[hook]
        if not callbacks or self._cut:
            return
        if self._view is None:
            self._view = CallbackRun(run)
        preemption = Preemption.installed  # None where signals cannot reach this thread
        hold = preemption.hold if preemption is not None else UNHELD
        said, outcome = None, 0
        with run.clock.during("hooks"):
            for name, callback in callbacks:
                raised = None
                try:
                    with hold.by(self._named[name], hook) as holding:
                        getattr(callback, hook)(self._view, *arguments)
                except Interrupted:
                    pass  # what interrupted it is read from `holding`, as where the hook swallowed it
                except Exception as error:
                    raised = error
                said, outcome = _ended(hold, holding, raised)
                if outcome:
                    break
        agreed, line = self._agree(said, outcome)
        if agreed:  # a stop cut the hook short: the run is stopping, and hooks after it could hold it again
            self._cut = True
            stateful = self._stateful()
            keeping = [f"callbacks.{name}" for name, _ in callbacks if name in stateful]
            if keeping:
                raise CallbackError(
                    f"{line}, so the state of {listed(keeping)} may be half-updated: nothing more is saved",
                    stopped=signal.Signals(agreed),
                )
            log.warning(f"{line}; the run's later hooks are skipped")

    def state_dict(self) -> dict:
        """A checkpoint part: the state of each callback that has one, by its name. Checked first
        (by every process, which agree) against the restricted loader, which reads checkpoints back:
        a state it would refuse makes every checkpoint unusable, so none is written."""
        stateful = self._stateful()
        if not stateful:
            return {}
        state = {name: callback.state_dict() for name, callback in stateful.items()}
        said = None
        for name, part in state.items():
            if (refused := refused_state(part)) is not None:
                said = f"{self._named[name]} holds {refused}"
                break
        self._agree(said, FAILED if said else 0)
        return state

    def load_state_dict(self, state: dict) -> None:
        """A callback the checkpoint has no state of (added at this resume) starts as built; the
        state of one no longer configured is left unread."""
        for name, callback in self._stateful().items():
            if name in state:
                callback.load_state_dict(state[name])

    def _stateful(self) -> dict[str, Any]:
        return {
            name: callback
            for name, callback in self._built.items()
            if callable(getattr(callback, "state_dict", None)) and callable(getattr(callback, "load_state_dict", None))
        }

    def _agree(self, said: str | None, outcome: int) -> tuple[int, str | None]:
        """The outcome every process agrees on, the largest, and its line; a FAILED one raises, on
        every process at once."""
        agreed = self._world.max(outcome)
        if not agreed:
            return 0, None
        line = next(line for number, line in self._world.gather((outcome, said)) if number == agreed)
        if agreed == FAILED:
            raise CallbackError(line)
        return agreed, line


class CallbackRun:
    """The run a hook receives: the Run's parts read through (`run.step`, `run.model`, ...), and
    MLflow's names for logging. Each file is rendered or copied here, in the training process, into
    a fresh folder of the tracker's staging folder, and handed to the sender, which delivers it, or
    keeps it for the replay when the store is away: a step never waits for the store. In any
    process that does not log (untracked, or not rank 0), each returns at once, before rendering."""

    def __init__(self, run: Any) -> None:
        self._run = run

    def __getattr__(self, name: str) -> Any:
        return getattr(self._run, name)

    @property
    def step(self) -> int:
        return self._run.step

    def autocast(self) -> AbstractContextManager:
        """The run's mixed precision (amp), for a forward of the model's own."""
        return autocast(self._run.amp, self._run.device)

    @torch.no_grad()
    def predictions(self) -> Iterator[tuple[Any, Any]]:
        """The model's outputs (in float32) and the targets, batch by batch, over this process's
        share of the validation set, in eval mode and the run's precision, as validation sees them.
        Under fsdp every process takes them all: each forward is a collective step."""
        run = self._run
        run.model.eval()
        try:
            for batch, counted in in_step(run.val_loader, run, shared=True):
                inputs, targets = run.task.split(run.place(batch))
                with self.autocast():
                    outputs = run.model(inputs)
                if counted:
                    yield in_float32(outputs), targets
        finally:
            run.model.train()

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Scalars at `run.step`, as the run's own are logged (floats: a tensor costs a host sync)."""
        self._run.tracker.log_metrics({key: float(value) for key, value in metrics.items()}, self._run.step)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """A matplotlib figure, saved as `artifact_file` (its extension picks the format: .png, .svg, .pdf)."""
        if self._logs():
            path = self._staged(Path(artifact_file).name)
            figure.savefig(path)
            self._hand_over(path, artifact_file)

    def log_image(self, image: Any, key: str) -> None:
        """An image at `run.step` under `key` (MLflow's image slider): a numpy array or a tensor, HWC
        or CHW, of floats in [0, 1] or integers in [0, 255], or a PIL image; written as PNG."""
        if self._logs():
            path = self._staged("image.png")
            _pil_image(image).save(path)
            self._run.tracker.log_image(path, key, self._run.step)

    def log_text(self, text: str, artifact_file: str) -> None:
        if self._logs():
            path = self._staged(Path(artifact_file).name)
            path.write_text(text, encoding="utf-8")
            self._hand_over(path, artifact_file)

    def log_dict(self, dictionary: dict, artifact_file: str) -> None:
        """As MLflow writes one: YAML for a .yaml or .yml file, JSON otherwise."""
        if self._logs():
            path = self._staged(Path(artifact_file).name)
            with path.open("w", encoding="utf-8") as file:
                if path.suffix in (".yaml", ".yml"):
                    yaml.safe_dump(dictionary, file, sort_keys=False)
                else:
                    json.dump(dictionary, file, indent=2)
            self._hand_over(path, artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """A file of yours, copied now: it may change or go before the sender delivers it."""
        if self._logs():
            source = Path(local_path)
            if not source.is_file():
                raise ValueError(f"log_artifact takes a file; {source} is not one")
            path = self._staged(source.name)
            shutil.copyfile(source, path)
            self._run.tracker.log_artifact(path, artifact_path)

    def _logs(self) -> bool:
        return self._run.tracker.logs

    def _staged(self, name: str) -> Path:
        """A path named `name` in a folder of its own: two files of one name never meet."""
        return Path(tempfile.mkdtemp(dir=self._run.tracker.staging_dir())) / name

    def _hand_over(self, path: Path, artifact_file: str) -> None:
        folder = Path(artifact_file).parent.as_posix()
        self._run.tracker.log_artifact(path, None if folder == "." else folder)


UNHELD = Hold(None)  # where no Preemption is installed: signals cannot reach the hook, nor a watchdog


def _ended(hold: Hold, holding: Holding, raised: Exception | None) -> tuple[str | None, int]:
    """How a hook's call ended, its line and its outcome (0: it returned): what reached it while it
    held the run comes first, for a hook that swallowed it and then raised, or returned."""
    if holding.overran:
        return hold.overran(holding), FAILED
    if holding.stopped is not None:
        return f"{holding.who} was interrupted by {holding.stopped.name} in {holding.hook}", holding.stopped
    if raised is not None:
        return f"{holding.who} raised in {holding.hook}: {type(raised).__name__}: {first_line(raised)}", FAILED
    return None, 0


def _pil_image(image: Any) -> Any:
    from PIL import Image  # matplotlib's dependency; imported by the first image only

    if isinstance(image, Image.Image):
        return image
    array = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
        array = array.transpose(1, 2, 0)  # CHW, as torch holds images
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if np.issubdtype(array.dtype, np.floating):
        array = np.clip(array, 0, 1) * 255
    return Image.fromarray(array.astype(np.uint8))
