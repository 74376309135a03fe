"""The run's checkpoints, owned by one object the recipe hands its parts to: it restores them from
what `resume=` names, or starts a fresh model from another run's weights (`init.checkpoint`),
saves them on schedule (in the background with `checkpoint.async_save`), and makes the last save,
which must succeed; with `checkpoint.remote`, it mirrors each save to the run's remote folder
(remote/), and says when another machine took that folder over. The recipe knows nothing of files,
shards, seals, writer threads or stores; which format a save takes is decided here, by the
strategy, and nowhere else.
"""

import logging
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

import torch
from omegaconf import OmegaConf

from ..config import Config, continuing
from ..devices import describe
from ..distributed import World
from ..errors import CheckpointError, RunError, SaveError, listed, readable
from ..files import check_room
from ..param_groups import hyperparameters, keep_configured
from ..precision import setting
from ..provenance import library_versions
from ..strategies import Single
from . import compatibility, initial, onefile
from .background import Snapshot, Writer
from .home import best_of, path_of, rank, set_aside_newer, step_of
from .remote.run_folder import held_for
from .resume import find, found_by_main
from .schema import FORMAT_VERSION, LATER_PARTS, SHARDED_PARTS, Checkpoint

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Checkpointer:
    """Restores and saves `parts`, each saved under its name as its `state_dict()`, restored in
    the order given: the model before the optimizer, whose state follows the parameters' device,
    and the random state last, so that nothing after it draws.

    `ready()` is asked before each save why the state must not be saved (it also measures what the
    checkpoint proves); the tracker part's metrics so far are in MLflow's sender's hands before the
    checkpoint is visible; `saved(step, state)` is told of each checkpoint once it is on disk, from
    the thread that wrote it; `landed(path)`, from the training thread, once the run knows it is.
    The run's remote folder, where this process holds one for the home (remote/run_folder.held),
    gets each checkpoint from the thread that wrote it, as soon as it is on disk.
    Leaving the `with` block waits for a write still in flight, so that no run ends, or releases its
    checkpoint folder, while one of its files is half written.
    """

    def __init__(
        self,
        cfg: Config,
        world: World,
        strategy: Single,
        parts: dict[str, Stateful],
        ready: Callable[[], list[str]],
        saved: Callable[[int, dict], None],
        landed: Callable[[Path], None] = lambda path: None,
    ) -> None:
        self.cfg, self.world, self.strategy, self.parts = cfg, world, strategy, parts
        self.home, self.settings = Path(cfg.checkpoint.dir), cfg.checkpoint
        self._ready, self._on_saved, self._landed = ready, saved, landed
        # Rank 0's, started before the restore, which tells it where the run resumed (home.mirrored).
        self.remote = held_for(self.home)
        self._mirror = self.remote.mirroring(self.home, self.settings.keep_last) if self.remote else None
        self.newest: Path | None = None  # this run's newest checkpoint on disk, or the one it resumed from
        self.source: dict | None = None  # the checkpoint of another run its weights started from (initial.lineage)
        self.failed: SaveError | None = None
        # In the background, the one file is rank 0's to write; shards, every process's.
        self._background = self.settings.async_save
        writes = self._background and (world.is_main or strategy.shards)
        self._snapshot = Snapshot() if writes else None
        self._writer = Writer() if writes else None
        self._group = None
        if self._background and strategy.shards:
            from . import sharded  # torch.distributed.checkpoint: 1 s of start-up a one-file run never uses

            self._group = sharded.background_group(cfg.strategy.timeout_s)
        self._in_flight: int | None = None  # the step being written; known to every process, which all
        # collect the write's outcome at the same point
        self._pending = None  # a sharded save in flight (sharded.Pending)
        # The wait for the metrics of the steps up to the last save's (`_save`), called by its commit.
        self._handed_over: Callable[[], object] = lambda: None
        self._last_save = time.monotonic()  # when the last save started: checkpoint.every_s counts from it
        # Read once: `due` is asked at every step, and a DictConfig's value costs microseconds.
        self._every = (self.settings.every_n_steps, self.settings.every_s, cfg.trainer.log_every_n_steps)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: object) -> None:
        if self._writer is None:
            return
        try:  # normally collected by `final`; after an error, the file still completes
            self._writer.wait()
        except Exception as failure:
            if error is None and not isinstance(failure, SaveError):
                raise
            log.warning(f"the checkpoint write in flight failed: {failure}")  # the run's own error comes next
        finally:
            self._writer.close()

    def path_of(self, step: int) -> Path:
        return path_of(self.home, step, folder=self.strategy.shards)

    @property
    def lost(self) -> str | None:
        """Why this machine no longer holds the run's remote folder, once another took it over."""
        return self.remote.lost if self.remote is not None else None

    def settle(self) -> None:
        """The leg's end: its newest checkpoint and the run's account remote within
        checkpoint.remote_wait_s, and said."""
        if self.remote is not None:
            self.remote.settle()

    def restore(self, resume: str | None) -> Checkpoint | None:
        """The checkpoint `resume=` names, as rank 0 finds (and, with `checkpoint.verify`, checks)
        it, loaded into the parts on every process after checking that it can belong to them; the
        config's hyperparameters stay this run's. None: a fresh start."""
        saved = found_by_main(self.world, lambda: find(resume, self.home, self.settings.verify))
        if saved is None:
            return None
        optimizer, scheduler = self.parts["optimizer"], self.parts["scheduler"]
        compatibility.check_fits(saved, self.cfg, self.parts["model"])
        compatibility.report_changes(saved, self.cfg, self.world.device)
        configured = hyperparameters(optimizer)
        self._load(saved)
        saved_lr = optimizer.param_groups[0]["lr"]
        keep_configured(optimizer, scheduler, configured)
        compatibility.report_lr_move(saved, saved_lr, optimizer.param_groups[0]["lr"], self.cfg)
        self.newest, self.source = saved.path, saved.state.get("source")
        self.world.on_main(lambda: self._tidy(saved))
        return saved

    def start_from(self) -> None:
        """A fresh run's model weights from the checkpoint `init.checkpoint` names (fine-tuning), as
        rank 0 finds and checks it, into the model where it is; nothing else of it is loaded."""
        saved = found_by_main(self.world, lambda: initial.find(self.cfg))
        model = self.parts["model"]
        ignored = initial.load_weights(model, saved, list(self.cfg.init.ignore), self.strategy.shards)
        frozen = sum(not parameter.requires_grad for parameter in model.parameters())
        self.source = {**initial.lineage(saved), "ignored": len(ignored), "frozen": frozen}
        kept = f"; {len(ignored)} key(s) kept as built ({listed(ignored, most=4)})"
        log.info(f"starting from the weights of {saved.path} (step {saved.step}){kept if ignored else ''}")

    def _load(self, saved: Checkpoint) -> None:
        """A sharded checkpoint loads on any number of processes; a one-file checkpoint into a
        sharded model too."""
        in_shards = SHARDED_PARTS if saved.sharded or self.strategy.shards else ()
        if in_shards:
            from . import sharded

            sharded.load_into(self.parts["model"], self.parts["optimizer"], saved)
        for name, part in self.parts.items():
            if name in in_shards or (name in LATER_PARTS and name not in saved.state):
                continue
            try:
                part.load_state_dict(saved.part(name))
            except (KeyError, ValueError, TypeError, IndexError) as error:
                raise CheckpointError(
                    f"the checkpoint's {name} does not load ({error}); resume from another checkpoint, "
                    f"or start a new run with name=<new name>"
                ) from None

    def _tidy(self, saved: Checkpoint) -> None:
        """Rank 0, resuming: the home's newer checkpoints set aside, and the home ranked by this run's
        optimized_metric, the restored checkpoint with the rest (a run killed between its rename and
        its ranking left it unranked; one that changed optimized_metric finds the home ranked by another)."""
        if (folder := set_aside_newer(self.home, saved.step)) is not None:
            log.info(f"resuming from step {saved.step}: the newer checkpoints of {self.home} are moved to {folder}")
        if self.settings.keep_best and saved.path.parent.resolve() == self.home.resolve():
            own = {saved.path.name: saved.state.get("score")}
            try:
                rank(self.home, own, self.cfg.optimized_metric, self.cfg.optimized_mode)
            except OSError as error:
                log.warning(f"{saved.path.name} could not be ranked ({error.strerror or error})")

    def due(self, step: int) -> bool:
        """Whether `step` is a save point: every checkpoint.every_n_steps steps, and, with
        checkpoint.every_s, the first logging step that long after the last save started, so that what
        a kill -9 loses is bounded in time whatever a step costs. The processes' clocks differ: they
        agree at logging steps only, a collective that an ordinary step never pays for."""
        every_n_steps, every_s, logging = self._every
        if step % every_n_steps == 0:
            return True
        if every_s is None or step % logging:
            return False
        return bool(self.world.max(int(time.monotonic() - self._last_save >= every_s)))

    def try_save(self, step: int) -> None:
        """Saves (in the background: starts to); a save that fails warns once and leaves training
        going, to try again next time."""
        for attempt in (self._collect, lambda: self._save(step, background=True)):
            try:
                attempt()
            except SaveError as error:
                self._failed(error)

    def final(self, step: int) -> None:
        """The save at the end (or at a signal), which must succeed or the run fails; written
        before this returns."""
        self.on_disk()  # the write in flight, done: an earlier step's failure only warns
        if self.newest == self.path_of(step):
            return
        try:
            self._save(step, background=False)
        except SaveError as error:
            raise RunError(
                f"{error}, so step {step} is not saved; {self.on_disk()}; free space or fix the folder, "
                f"then {self.continuation()}"
            ) from None

    def check_room(self) -> None:
        """Refuses a run whose home has less free space than one checkpoint will take, before its
        first step: otherwise every save fails, and the run learns it only at the last one, which
        must succeed. A fresh optimizer has no state until its first step: its size is estimated
        from the parameters it trains."""
        model, optimizer = self.parts["model"], self.parts["optimizer"]
        weights = _size(model.state_dict().values())
        if optimizer.state:
            moments = _size(value for state in optimizer.state.values() for value in state.values())
        else:
            trained = (parameter for group in optimizer.param_groups for parameter in group["params"])
            moments = _slots(optimizer) * _size(trained)
        # The home is rank 0's, claimed before this (or, built without a claim, to be made in the nearest folder there is).
        there = next(folder for folder in (self.home, *self.home.parents) if folder.is_dir())
        free = self.world.on_main(lambda: shutil.disk_usage(there).free)
        parts = f"{readable(weights)} of model, {readable(moments)} of optimizer state"
        check_room(free, weights + moments, f"{self.home} cannot hold one checkpoint of this run ({parts})")

    def kept(self, which: str) -> list[dict]:
        """The checkpoints `mlflow.log_models` names (best, final, both, none), once the last save is
        written: their names, paths and steps. The final one is left out where it is the best."""
        found = {"best": best_of(self.home), "final": self.newest}
        names = {"best": ["best"], "final": ["final"], "both": ["best", "final"], "none": []}[which]
        if which == "both" and found["final"] == found["best"]:
            names = ["best"]
        return [{"name": name, "path": str(found[name]), "step": step_of(found[name])} for name in names if found[name]]

    def standing(self, fix: str) -> str:
        """Where the run stands on disk and how to go on from there with `fix` (a lower lr): for messages."""
        return f"{self.on_disk()}; {self.continuation(fix)}"

    def continuation(self, fix: str = "") -> str:
        """The command that goes on from the newest checkpoint on disk, and none that cannot work:
        with nothing saved, a fresh start; from a checkpoint elsewhere (resumed from another home),
        that checkpoint, which resume=last would not find. A write in flight (its line may come from the
        hook watchdog's thread, mid-write) lands in this home, where resume=last finds it."""
        if self.newest is None and self._in_flight is None:
            return f"run it again with {fix}" if fix else "run it again"
        here = self._in_flight is not None or self.newest.parent.resolve() == self.home.resolve()
        resume = "last" if here else str(self.newest)
        return f"continue from it with {continuing(self.cfg, resume)}" + (f" and {fix}" if fix else "")

    def on_disk(self) -> str:
        """Where the run stands on disk, once the write in flight is done: for messages."""
        try:
            self._collect()
        except SaveError as error:
            self._failed(error)
        return f"the newest checkpoint on disk is {self.newest}" if self.newest else "no checkpoint is on disk"

    def _save(self, step: int, background: bool) -> None:
        self._last_save = time.monotonic()
        self._refuse_unless_ready(step)
        state = self._capture(step)  # on every process: the random state is gathered from all
        # A resume starts after this step, so the metrics of the steps up to it must be out of this
        # process before the checkpoint is visible: a kill -9 after its rename would lose them for
        # good. They are all known now; the commit waits for them, in the writer's thread if any.
        self._handed_over = self.parts["tracker"].flush()
        background = background and self._background
        if self.strategy.shards:
            self._save_shards(state, background)
        elif background:
            if self._writer is not None:
                snapshot = self._snapshot.take(state)
                self._writer.start(lambda: self._write(snapshot))
            self._in_flight = step
        else:
            self._saved(self.world.on_main(lambda: self._write(state)), step)

    def _save_shards(self, state: dict, background: bool) -> None:
        from . import sharded

        model, optimizer, step = self.parts["model"], self.parts["optimizer"], state["step"]
        if background:
            writing = (self._snapshot, self._writer, self._group)
            self._pending = sharded.begin(state, model, optimizer, self.home, self.world, writing)
            self._in_flight = step
            return
        self._handed_over()
        path = sharded.save(state, model, optimizer, self.home, self.settings.keep_last, self.world)
        self._written(step, state)
        self._saved(path, step)

    def _write(self, state: dict) -> Path:
        """Rank 0: the one-file checkpoint, once the metrics it covers are handed over, then its news;
        from the training thread or the writer's."""
        self._handed_over()
        path = onefile.save(state, self.home, self.settings.keep_last)
        self._written(state["step"], state)
        return path

    def _written(self, step: int, state: dict) -> None:
        """The checkpoint of `step` is in its home: its news, from the thread that wrote it, so that
        its upload starts now."""
        self._on_saved(step, state)
        if self._mirror is not None:
            self._mirror.landed(self.path_of(step))

    def _capture(self, step: int) -> dict:
        """The parts' state as a checkpoint holds it (under strategy=fsdp, less the shards), with
        the metadata of this run. Its tensors are the parts' own, not copies."""
        in_shards = SHARDED_PARTS if self.strategy.shards else ()
        return {
            "format_version": FORMAT_VERSION,
            "step": step,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "device": {"type": self.world.device.type, "name": describe(self.world.device)},
            "amp": setting(self.cfg.amp),
            "versions": library_versions(),
            "source": self.source,
            "score": self.parts["monitor"].score_at(step) if self.settings.keep_best else None,
            **{name: part.state_dict() for name, part in self.parts.items() if name not in in_shards},
        }

    def _refuse_unless_ready(self, step: int) -> None:
        """A RunError, which ends the run, when `ready()` names a reason: a model that no longer
        computes numbers, saved, would become resume=last and push the good checkpoints out."""
        if broken := self._ready():
            raise RunError(
                f"the model is no longer finite at step {step} ({', '.join(broken[:3])}"
                f"{', ...' if len(broken) > 3 else ''}): nothing is saved; {self.standing('a lower optimizer.lr')}"
            )

    def _collect(self) -> None:
        """The outcome of the write in flight, waited for, on every process."""
        if self._in_flight is None:
            return
        step, self._in_flight = self._in_flight, None
        if self._pending is not None:
            from . import sharded

            pending, self._pending = self._pending, None
            self._handed_over()  # written long since, as a rule: the shards took longer
            path = sharded.finish(pending, self._writer, self.home, self.settings.keep_last, self.world)
            self._written(step, pending.state)
        else:
            path = self.world.on_main(lambda: self._writer.wait())  # rank 0 has the writer
        self._saved(path, step)

    def _failed(self, error: SaveError) -> None:
        if self.failed is None:
            log.warning(f"{error}; training goes on and tries again at the next save; {self.on_disk()}")
        self.failed = error

    def _saved(self, path: Path, step: int) -> None:
        self.newest = path
        if self.failed is not None:
            log.warning(f"saving works again: step {step} is saved")
            self.failed = None
        self._landed(path)


def _size(values: Iterable) -> int:
    """The bytes of the tensors among `values`; of a sharded tensor, all its shards'."""
    return sum(value.numel() * value.element_size() for value in values if isinstance(value, torch.Tensor))


def _slots(optimizer: torch.optim.Optimizer) -> int:
    """How many tensors the size of its parameter the optimizer keeps for each: SGD's momentum,
    Adam's and AdamW's two moments (three with amsgrad); another optimizer is taken for Adam."""
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if optimizer.defaults.get("momentum") else 0
    return 3 if optimizer.defaults.get("amsgrad") else 2
