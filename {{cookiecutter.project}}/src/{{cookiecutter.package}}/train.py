"""The training recipe, top to bottom: join the other processes (if any), claim the checkpoint
home, `setup` (build, place, wrap, restore, audit), check continuity, `fit`, `finish`.

The order is the point of this file. Each numbered step says why it stands where it does; moving
one is how the failures this project exists to prevent come back.
"""

import contextlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import Metric

from . import checkpoints, components, continuity, distributed, state
from .async_save import Snapshot, Writer
from .checkpoints import SaveError
from .config import AmpConfig, Config, TrainerConfig, check_values
from .continuity import Probe
from .data import Data, Position, batches, build_loader, evaluation_loader
from .devices import audit_placement, describe, set_cpu_threads, to_device
from .distributed import World, gradients_held
from .divergence import Divergence, nonfinite_weights
from .errors import RunError
from .evaluation import build_metrics, evaluate
from .precision import Scaler, autocast, build_scaler
from .precision import describe as describe_amp
from .preemption import Preemption
from .progress import Progress
from .provenance import record, run_name
from .seeding import RandomState, seed_everything
from .sweeps import current_job
from .tracking import Tracker, check_tracking_uri

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What a training step touches and a checkpoint saves (the parts named in checkpoints.PARTS),
    assembled by `setup` in recipe order."""

    cfg: Config
    world: World  # this process among the job's, and its device
    home: Path  # where this run's checkpoints live
    data: Data
    val_loader: DataLoader  # this process's share of the validation set
    model: nn.Module  # what is saved, evaluated and audited (under fsdp, sharded in place)
    wrapped: nn.Module  # what training calls: the model in DistributedDataParallel, or the model
    criterion: nn.Module
    metrics: dict[str, Metric]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: Scaler
    position: Position  # in the training data
    probe: Probe
    tracker: Tracker
    rng: RandomState
    step: int = 0  # optimizer steps taken
    # The settings every step reads, copied out of `cfg` as plain objects: a step read about
    # twenty of them from the DictConfig, at several microseconds each (bench/step_overhead.py).
    trainer: TrainerConfig = field(init=False)
    amp: AmpConfig = field(init=False)
    non_blocking: bool = field(init=False)  # device.non_blocking

    def __post_init__(self) -> None:
        self.trainer, self.amp = OmegaConf.to_object(self.cfg.trainer), OmegaConf.to_object(self.cfg.amp)
        self.non_blocking = self.cfg.device.non_blocking

    @property
    def device(self) -> torch.device:
        return self.world.device

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_device(tensor, self.device, self.non_blocking, self.trainer.channels_last)


def main(cfg: DictConfig) -> dict | float | None:
    """The entry point of run.py: a problem the user can fix prints as one line, no traceback.
    In a sweep, a failing job fails alone, and a job's value is its `optimized_metric` (sweeps.py)."""
    job = current_job()
    if job is not None:
        return job.run(train, cfg)
    try:
        return train(cfg)
    except RunError as error:
        rank = os.environ.get("RANK", "0")  # every process prints it: the one that failed may not be rank 0
        print(f"{'' if rank == '0' else f'[rank {rank}] '}error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def train(cfg: Config) -> dict:
    """Trains, or continues the run `resume=` names, to `trainer.max_steps`; returns the final
    metrics, the continuity verdict and the MLflow run id."""
    check_values(cfg)
    cfg.mlflow.run_name = cfg.mlflow.run_name or run_name(cfg)  # not MLflow's random `overjoyed-slug-911`
    # 1. This process's place among the job's and its device, first: a missing accelerator or a
    #    launch that does not match `strategy` fails here, before anything is built.
    with distributed.join(cfg) as world:
        seed_everything(cfg.seed + world.rank)  # rank 0 draws as a single process would
        set_cpu_threads(cfg.device)
        log.info(f"device: {describe(world.device)}; amp: {describe_amp(cfg.amp)}; {describe_world(world)}")
        if cfg.mlflow.enabled:
            world.on_main(lambda: check_tracking_uri(cfg.mlflow))
        return train_in(cfg, world)


def train_in(cfg: Config, world: World) -> dict:
    """Steps 2 to 11, in this process's place among the job's."""
    # 2. The checkpoint home, held by rank 0 until the run ends: a second run with the same name,
    #    or a folder that cannot take checkpoints, stops here, not at a save hours later.
    home = Path(cfg.checkpoint.dir)
    with world.held_by_main(lambda: checkpoints.claim(home)):
        world.on_main(lambda: refuse_to_start_over(cfg, home))
        run, found = setup(cfg, world, home)

        # 10. One MLflow run across resumes; then the continuity check: the probe loss now must
        #     match the probe loss stored at save. Signals wait for a checkpoint from here on.
        status = "FAILED"
        with Preemption() as preemption:
            run.tracker.open(*record(cfg, world), checkpoint=found[0] if found else None)
            try:
                verdict = continuity.check(run, found[1], run.step) if found else "fresh"
                with Saver(run, newest=found[0] if found else None) as saver:
                    result = finish(run, saver, fit(run, saver, preemption), verdict)
                status = "KILLED" if run.step < cfg.trainer.max_steps else "FINISHED"  # only a signal stops early
            finally:
                run.tracker.finish(status)

    newest = checkpoints.path_of(home, run.step, world.sharded)
    if status == "KILLED":
        log.info(f"stopped at step {run.step} by {preemption.received.name}; saved {newest}; continue with resume=last")
        raise SystemExit(128 + preemption.received)
    scores = ", ".join(f"{key} {value:.4f}" for key, value in result.items() if key.startswith("val/"))
    log.info(f"finished at step {run.step}: {scores}; checkpoint {newest}; MLflow run {result['run_id'] or 'off'}")
    return result


def describe_world(world: World) -> str:
    return f"{world.size} processes ({world.backend}), this is rank {world.rank}" if world.backend else "one process"


def refuse_to_start_over(cfg: Config, home: Path) -> None:
    if cfg.resume is None and checkpoints.has_checkpoints(home):
        raise RunError(
            f"{home} already holds checkpoints of {cfg.name!r}; continue them with resume=last, "
            f"or start a separate run with name=<new name> (or checkpoint.dir=<path>)"
        )


def setup(cfg: Config, world: World, home: Path) -> tuple[Run, tuple[Path, dict] | None]:
    """Steps 3 to 9: the run built, on its device, wrapped for data parallelism, restored from
    the checkpoint `resume=` names (returned with its path), and audited."""
    device = world.device
    # 3. The data, then the whole model, with any structural change (a new head, frozen layers)
    #    made in its constructor: the move below carries only the submodules that exist now.
    #    Under strategy=fsdp on the meta device: shapes only, no memory until it is sharded.
    data = components.build("data", cfg.data)
    if not isinstance(data, Data):
        raise RunError(f"data ({cfg.data._target_}) returned a {type(data).__name__}; it must return data.Data")

    def build_model() -> nn.Module:
        return components.build("model", cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)

    with torch.device("meta") if world.sharded else contextlib.nullcontext():
        model = build_model()

    # 4. Model, loss and metrics to the device. Under fsdp the model is sharded first and then
    #    given memory on the device, each process only its shard, set to the weights rank 0 builds.
    if world.sharded:
        distributed.shard(model, world, cfg, build_model)
    else:
        model.to(device, memory_format=torch.channels_last if cfg.trainer.channels_last else torch.preserve_format)
    criterion = components.build("loss", cfg.loss).to(device)
    metrics = build_metrics(cfg.metrics, data.num_classes, device)

    # 5. Under strategy=ddp, into DistributedDataParallel, which needs the model on its device
    #    and broadcasts rank 0's weights, so that every rank starts from the same ones.
    wrapped = distributed.wrap(model, world, cfg)

    # 6. Optimizer, scheduler and scaler, built on parameters that are already placed.
    optimizer = components.build("optimizer", cfg.optimizer, params=[p for p in model.parameters() if p.requires_grad])
    scheduler = components.build("scheduler", cfg.scheduler, optimizer=optimizer)
    run = Run(
        cfg,
        world,
        home,
        data,
        evaluation_loader(data.val, cfg.data.batch_size, cfg.data.get("num_workers", 0), cfg.device, world),
        model,
        wrapped,
        criterion,
        metrics,
        optimizer,
        scheduler,
        build_scaler(cfg.amp, device),
        Position(),
        Probe(data.val, cfg.checkpoint.continuity.probe_size),
        Tracker(cfg.mlflow, home, main=world.is_main),
        RandomState(world, cfg.seed),
    )

    # 7. Restore, after the move: Optimizer.load_state_dict casts the saved state to the device
    #    of the parameters as they are *now*. Loaded before the move, it would stay on the CPU
    #    and the first step would fail with "Expected all tensors to be on the same device".
    #    Every rank loads the same checkpoint, the one rank 0 chose, into its own copy.
    found = locate(cfg.resume, home, world, cfg.checkpoint.verify)
    if found is not None:
        state.restore(run, *found)
        world.on_main(lambda: set_aside_newer(home, run.step))

    # 8. Optimize for the device after the restore, so that it starts from the restored state.
{%- if cookiecutter.ipex %}
    #    IPEX rewrites model and optimizer from what they hold; what it returns replaces them.
    if cfg.device.ipex:
        from .ipex import ipex_optimize  # only here: IPEX pins torch 2.8, most runs never load it

        run.model, run.optimizer = ipex_optimize(run.model, run.optimizer, cfg.amp)
        run.wrapped = run.model  # one process only (distributed.py refuses IPEX under ddp)
{%- endif %}
    if cfg.trainer.compile:
        run.model.compile()  # in place: state_dict keys stay those of the plain model

    # 9. Audit: every parameter, buffer, optimizer state tensor and the scaler on the device.
    audit_placement(device, run.model, run.optimizer, run.scaler)
    return run, found


def locate(resume: str | None, home: Path, world: World, verify: bool) -> tuple[Path, dict] | None:
    """The checkpoint `resume=` names, as rank 0 finds (and, with `verify`, checks) it, loaded on
    every rank."""
    found = None

    def find() -> Path | None:
        nonlocal found
        found = checkpoints.find(resume, home, verify)
        return found and found[0]

    path = world.on_main(find)
    return found if world.is_main or path is None else (path, checkpoints.load(path, verify=False))


def set_aside_newer(home: Path, step: int) -> None:
    if (folder := checkpoints.set_aside_newer(home, step)) is not None:
        log.info(f"resuming from step {step}: the newer checkpoints of {home} are moved to {folder}")


def fit(run: Run, saver: "Saver", preemption: Preemption) -> dict[str, float]:
    """11. Trains to `trainer.max_steps` or a signal; saves on schedule. A save that fails (a full
    disk) costs a warning and is tried again at the next save point; a loss that is not finite
    stops the run before it can save (divergence.py). Returns the last loss and the throughput,
    or nothing when there was no step left to train."""
    trainer, save_every = run.trainer, run.cfg.checkpoint.every_n_steps
    loader = build_loader(run.data.train, run.cfg.data, run.cfg.device, run.cfg.seed, run.world)
    stream = batches(loader, run.position)
    divergence = Divergence(trainer, scaled=run.scaler.is_enabled())
    meter, loss = Throughput(), None
    with Progress(trainer, run.step, main=run.world.is_main) as progress:
        while run.step < trainer.max_steps and not preemption.agreed(run.world):
            micro_batches = [next(stream) for _ in range(trainer.grad_accum_steps)]
            loss = train_step(run, micro_batches)
            run.step += 1
            divergence.watch(run.step, loss)
            meter.count(run.world.size * sum(len(targets) for _, targets in micro_batches))
            progress.step()
            if run.step % trainer.log_every_n_steps == 0:
                divergence.check(saver.on_disk)
                value, rates = loss.item(), meter.window()
                lr = run.optimizer.param_groups[0]["lr"]
                run.tracker.log_metrics({"train/loss": value, "train/lr": lr, **rates}, run.step)
                progress.report(run.step, value, rates["train/samples_per_s"])
            if run.step % trainer.val_every_n_steps == 0 and run.step < trainer.max_steps:
                run.tracker.log_metrics(evaluate(run, run.val_loader), run.step)
            if run.step % save_every == 0:
                divergence.check(saver.on_disk)
                saver.try_save()
    divergence.check(saver.on_disk)
    # A run resumed at its last step trains nothing: no training loss or throughput to report.
    return {"train/loss": loss.item(), **meter.total()} if loss is not None else {}


def finish(run: Run, saver: "Saver", trained: dict[str, float], verdict: str) -> dict:
    """The final validation and the last save, which must succeed; the run's result, the same
    on every process (the MLflow run id is rank 0's)."""
    val = evaluate(run, run.val_loader)
    run.tracker.log_metrics(val, run.step)
    saver.final()
    run_id = run.world.broadcast(run.tracker.run_id)
    return {**trained, **val, "continuity": verdict, "step": run.step, "run_id": run_id}


def train_step(run: Run, micro_batches: list[list[torch.Tensor]]) -> torch.Tensor:
    """One optimizer step over `trainer.grad_accum_steps` batches; returns their mean loss over
    all processes."""
    total = None
    for number, (inputs, targets) in enumerate(micro_batches, start=1):
        with gradients_held(run.wrapped) if number < len(micro_batches) else contextlib.nullcontext():
            with autocast(run.amp, run.device):
                loss = run.criterion(run.wrapped(run.place(inputs)), run.place(targets))
            if len(micro_batches) > 1:  # the step's loss is their mean; a division by 1 would still cost an op
                loss = loss / len(micro_batches)
            run.scaler.scale(loss).backward()  # scale, unscale_ and step pass through when the scaler is off
        total = loss.detach().float() if total is None else total + loss.detach()  # float32 whatever autocast chose
    # The mean over the processes, as their gradients are: a loss that is not finite on one of
    # them is seen by all, and all skip the same steps.
    total = run.world.mean(total)
    # Asked for by on_nonfinite=skip_step, at the price of one host sync a step: no update from
    # a non-finite loss. The schedule still advances, so the lr stays a function of the step.
    if run.trainer.on_nonfinite == "skip_step" and not torch.isfinite(total):
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        return total
    if run.trainer.grad_clip is not None:
        run.scaler.unscale_(run.optimizer)  # clip the true gradients, not the fp16-scaled ones
        nn.utils.clip_grad_norm_(run.model.parameters(), run.trainer.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return total


class Throughput:
    """Samples and steps per second: over the window since the last log, and over the run."""

    def __init__(self) -> None:
        self.started = self.window_started = time.perf_counter()
        self.steps = self.samples = self.window_steps = self.window_samples = 0

    def count(self, samples: int) -> None:
        self.steps, self.samples = self.steps + 1, self.samples + samples
        self.window_steps, self.window_samples = self.window_steps + 1, self.window_samples + samples

    def window(self) -> dict[str, float]:
        """The window's rates, and a new window."""
        now = time.perf_counter()
        seconds = now - self.window_started
        rates = {
            "train/samples_per_s": self.window_samples / seconds,
            "train/step_time_ms": 1000 * seconds / self.window_steps,
        }
        self.window_started, self.window_steps, self.window_samples = now, 0, 0
        return rates

    def total(self) -> dict[str, float]:
        seconds = time.perf_counter() - self.started
        return {"train/steps_per_s": self.steps / seconds, "train/samples_per_s": self.samples / seconds}


class Saver:
    """The loop's checkpoints: which is the newest on disk, saves that fail without ending the
    run (until the last one), and, with `checkpoint.async_save`, writes that go on while the run
    trains (async_save.py). Leaving it waits for a write still in flight, so that no run ends,
    or releases its checkpoint folder, while one of its files is half written."""

    def __init__(self, run: Run, newest: Path | None) -> None:
        self.run = run
        self.newest = newest  # this run's newest checkpoint on disk, or the one it resumed from
        self.failed: SaveError | None = None
        # Shards are written by every process together (DCP, sharded.py): those saves stay in step.
        self._background = run.cfg.checkpoint.async_save and not run.world.sharded
        self._snapshot = Snapshot() if self._background and run.world.is_main else None
        self._writer = Writer() if self._background and run.world.is_main else None
        self._in_flight: int | None = None  # the step being written; known to every process, which all
        # collect the write's outcome at the same point

    def __enter__(self) -> "Saver":
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

    def try_save(self) -> None:
        """Saves (in the background: starts to); a save that fails warns once and leaves training
        going, to try again next time."""
        for attempt in (self._collect, self._save):
            try:
                attempt()
            except SaveError as error:
                self._failed(error)

    def final(self) -> None:
        """The save at the end (or at a signal), which must succeed or the run fails; written
        before this returns."""
        self.on_disk()  # the write in flight, done: an earlier step's failure only warns
        if self.newest == checkpoints.path_of(self.run.home, self.run.step, self.run.world.sharded):
            return
        try:
            self._saved(state.save(self._checked()), self.run.step)
        except SaveError as error:
            raise RunError(
                f"{error}, so step {self.run.step} is not saved; {self.on_disk()}; free space or fix the folder, "
                f"then continue with resume=last"
            ) from None

    def on_disk(self) -> str:
        """Where the run stands on disk, once the write in flight is done: for messages."""
        try:
            self._collect()
        except SaveError as error:
            self._failed(error)
        return f"the newest checkpoint on disk is {self.newest}" if self.newest else "no checkpoint is on disk"

    def _save(self) -> None:
        run = self._checked()
        if not self._background:
            self._saved(state.save(run), run.step)
            return
        captured = state.capture(run)  # on every process: the random state is gathered from all
        if self._writer is not None:
            snapshot = self._snapshot.take(captured)
            self._writer.start(lambda: state.write(run, snapshot))
        self._in_flight = run.step

    def _collect(self) -> None:
        """The outcome of the write in flight, waited for, on every process."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._saved(self.run.world.on_main(lambda: self._writer.wait()), step)  # rank 0 has the writer

    def _failed(self, error: SaveError) -> None:
        if self.failed is None:
            log.warning(f"{error}; training goes on and tries again at the next save; {self.on_disk()}")
        self.failed = error

    def _saved(self, path: Path, step: int) -> None:
        self.newest = path
        if self.failed is not None:
            log.warning(f"saving works again: step {step} is saved")
            self.failed = None

    def _checked(self) -> Run:
        """The run, with the probe's loss measured for the checkpoint; a RunError, which ends the
        run, when the model no longer computes numbers: saved, it would become resume=last and
        push the good checkpoints out."""
        loss = self.run.probe.measure(self.run)
        weights = nonfinite_weights(self.run.model)
        if self.run.world.sharded:  # each process sees its own shards; all must stop together
            weights = sorted(set().union(*self.run.world.gather(weights)))
        broken = weights + ([] if math.isfinite(loss) else [f"probe loss {loss}"])
        if broken:
            raise RunError(
                f"the model is no longer finite at step {self.run.step} ({', '.join(broken[:3])}"
                f"{', ...' if len(broken) > 3 else ''}): nothing is saved; {self.on_disk()}; continue from it "
                f"with resume=last and a lower optimizer.lr"
            )
        self.run.probe.loss = loss
        return self.run
