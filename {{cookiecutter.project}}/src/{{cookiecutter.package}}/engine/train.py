"""The training recipe, top to bottom: join the other processes (if any), claim the checkpoint
home, `setup` (`assemble`: build, place, wrap; `restore`, audit), check continuity, `fit`, `finish`, and
`log_models` once the run has finished for good.

The order is the point of this file. Each numbered step says why it stands where it does; moving
one is how the failures this project exists to prevent come back.
"""

import logging
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import torch
from omegaconf import DictConfig

from . import compile_cache, components, continuity, distributed, param_groups, strategies
from .callbacks.hooks import CallbackError, Callbacks
from .callbacks.time_limit import Hold
from .checkpoint import initial
from .checkpoint.claim import claim
from .checkpoint.manager import Checkpointer
from .checkpoint.remote import run_folder
from .checkpoint.schema import Checkpoint
from .config import Config, check_values, continuing
from .data.contract import DataError, build_data
from .data.loaders import batches, build_loader, evaluation_loader
from .data.position import Position
from .devices import audit_placement, describe, set_cpu_threads
from .distributed import World
from .errors import RunError, reported, shown
from .lifecycle import restarts, standby
from .lifecycle.divergence import Divergence
from .lifecycle.goodput import Clock
from .lifecycle.preemption import Preemption
from .monitor import Monitor
from .parts import Evaluable, Run
from .precision import build_scaler
from .precision import describe as describe_amp
from .probe import Probe
from .progress import Progress, Throughput
from .provenance import datasets, record, run_name
from .remembered import CommandLine, resumed
from .seeding import RandomState, seed_everything
from .signals import Stopped
from .step import train_step
from .sweeps import current_job
from .tracking.tracker import Tracker, check_tracking_uri
from .validation import build_metrics, check_wiring, evaluate, scheduled, validate

log = logging.getLogger(__name__)


def main(cfg: DictConfig) -> dict | float | None:
    """The entry point of run.py: a problem the user can fix prints as one line, no traceback.
    In a sweep, a failing job fails alone, and a job's value is its `optimized_metric` (sweeps.py)."""
    said = CommandLine.typed()
    job = current_job()
    if job is not None:
        return job.run(lambda cfg: train(cfg, said), cfg)
    return reported(lambda: train(cfg, said))


def train(cfg: Config, said: CommandLine | None = None) -> dict:
    """Trains, or continues the run `resume=` names, to `trainer.max_steps`; returns the final
    metrics, the continuity verdict and the MLflow run id. A resume runs with its checkpoint's
    settings and what the command line `said` changed (remembered.py); without `said`, with `cfg`."""
    cfg.resume = restarts.implied_resume(cfg.resume)  # a job that came back by itself continues
    # A standby leg, started warm beside the leg that trains, waits here for that leg to end.
    # checkpoint.remote, held (and an empty home filled from it) by the command line's settings, before a
    # resume's; the home's Checkpointer mirrors to it.
    with standby.taking_over(cfg, said) as took_over, run_folder.held(cfg, current_job() is not None):
        # Before anything is checked or built: a resume's settings are its checkpoint's but what was typed.
        cfg = resumed(cfg, said)
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
            return train_in(cfg, world, took_over)


def train_in(cfg: Config, world: World, began: float | None = None) -> dict:
    """Steps 2 to 11, in this process's place among the job's; this leg's time counts from `began`
    (a standby's takeover), or from the process's start."""
    # 2. The checkpoint home, held by rank 0 until the run ends: a second run with the same name,
    #    a fresh run over saved checkpoints, or a folder that cannot take checkpoints, stops here,
    #    not at a save hours later. A run refused before it saves leaves the folder as it found it.
    home = Path(cfg.checkpoint.dir)
    initial.check_apart(cfg)  # a fine-tune's source is another run's: this one's would be continued, and pruned
    with world.held_by_main(lambda: claim(home, fresh=cfg.name if cfg.resume is None else None)):
        run, checkpoints, found = setup(cfg, world, home, began)
        if found and run.monitor.finished(run.step):  # a resume with nothing left to train
            return nothing_to_train(run, checkpoints)

        # 10. One MLflow run across resumes; then the continuity check: the probe loss now must
        #     match the probe loss stored at save. Signals wait for a checkpoint from here on.
        status, unsaved = "FAILED", None
        with Preemption(Hold(cfg.trainer.hook_timeout_s, checkpoints.continuation)) as preemption:
            # What a validation asks before each batch, as the loop does at each step: a stop reaches it within one.
            stop = lambda: preemption.agreed(world, checkpoints.lost, during="validation")  # noqa: E731
            lineage, inputs = initial.tags(checkpoints.source), datasets(cfg.data, run.data, ("train", "val"))
            run.tracker.open(*record(cfg, world, lineage), checkpoint=found and found.path, datasets=inputs)
            try:
                verdict = continuity.check(run, found) if found else "fresh"
                with checkpoints:
                    try:
                        result = finish(run, checkpoints, fit(run, checkpoints, preemption, stop), verdict, stop)
                    except CallbackError as error:  # raised on every process at once (hooks.py)
                        where, then = checkpoints.on_disk(), checkpoints.continuation()
                        if error.stopped is None:
                            raise RunError(f"{error}; {where}; fix it, then {then}") from None
                        # A stop that cut short a hook of a callback that keeps state: stopped unsaved.
                        preemption.received, unsaved = error.stopped, f"{error}; {where}"
                    except DataError as error:  # a shard damaged mid-run: once it is put back, the run goes on
                        raise DataError(f"{error}; {checkpoints.standing('')}") from None
                # Short of max_steps, or of its last validation: stopped by a signal, unless early stopping ended it.
                status = "FINISHED" if run.monitor.finished(run.step) and unsaved is None else "KILLED"
                # One stopped to come back logs its models when it ends; one that a signal reached at
                # its end is about to be killed.
                if status == "FINISHED" and not preemption.received:
                    log_models(run, checkpoints)
            finally:
                run.tracker.log_metrics(run.clock.totals(run.step), run.step)
                run.tracker.finish(status)
                run.clock.close(run.step)
                checkpoints.settle()  # the remote's, its account too, as the leg ends

    newest = checkpoints.path_of(run.step)
    if status == "KILLED":
        # After the MLflow run is ended: a requeue has SLURM stop every process of the job.
        comeback = world.on_main(lambda: restarts.requeue(preemption.received))
        log.info(
            f"stopped at step {run.step} by {preemption.received.name}{preemption.cut}; {unsaved or f'saved {newest}'}; "
            f"{comeback or f'continue with {continuing(cfg)}'}"
        )
        said_at_end(run)
        raise Stopped(preemption.received, comeback)
    scores = ", ".join(f"{key} {value:.4f}" for key, value in result.items() if key.startswith("val/"))
    log.info(f"finished at step {run.step}: {scores}; checkpoint {newest}; MLflow run {result['run_id'] or 'off'}")
    said_at_end(run)
    return result


def said_at_end(run: Run) -> None:
    """What this leg's stop cost the run, and what it compiled."""
    log.info(run.clock.summary())
    if run.cfg.trainer.compile:
        log.info(compile_cache.said())


def describe_world(world: World) -> str:
    return f"{world.size} processes ({world.backend}), this is rank {world.rank}" if world.backend else "one process"


def setup(
    cfg: Config, world: World, home: Path, began: float | None = None
) -> tuple[Run, Checkpointer, Checkpoint | None]:
    """Steps 3 to 9: the run assembled on its device, restored from the checkpoint `resume=` names
    (returned), and audited."""
    run = assemble(cfg, world, home, began)
    checkpoints, found = restore(run, home)
    return run, checkpoints, found


def assemble(cfg: Config, world: World, home: Path, began: float | None) -> Run:
    """Steps 3 to 6: the run built, on its device, and wrapped for data parallelism."""
    strategy = strategies.choose(cfg, world)
    built = build(cfg, world, strategy)  # steps 3 and 4
    model = built.model

    # 5. The layers that do not train (init.freeze), frozen before DistributedDataParallel, which
    #    averages the gradients of the parameters that train when it wraps, and broadcasts rank
    #    0's weights, so that every rank starts from the same ones.
    param_groups.freeze(model, cfg.init.freeze)
    wrapped = strategy.wrap(model)

    # 6. Optimizer, scheduler and scaler, built on parameters that are already placed; the
    #    optimizer's groups by optimizer.lr_multipliers (param_groups.py). The callbacks too: one
    #    whose library is missing stops the run here, not at the first validation.
    optimizer = param_groups.build_optimizer(cfg.optimizer, model)
    scheduler = components.build("scheduler", cfg.scheduler, optimizer=optimizer)
    return Run.around(
        built,
        wrapped=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=build_scaler(cfg.amp, world.device),
        position=Position(),
        probe=Probe(built.data.val, cfg.checkpoint.continuity.probe_size, cfg.data.batch_size),
        tracker=Tracker(cfg.mlflow, home, main=world.is_main),
        monitor=Monitor(cfg),
        rng=RandomState(world, cfg.seed),
        callbacks=Callbacks.built(cfg.callbacks, world),
        clock=Clock(began),
    )


def restore(run: Run, home: Path) -> tuple[Checkpointer, Checkpoint | None]:
    """Steps 7 to 9: the run's parts handed to its Checkpointer, restored from the checkpoint
    `resume=` names (returned) or started from another run's weights, optimized for the device, and
    audited."""
    cfg, world = run.cfg, run.world
    # 7. Restore, after the move: Optimizer.load_state_dict casts the saved state to the device
    #    of the parameters as they are *now*. Loaded before the move, it would stay on the CPU
    #    and the first step would fail with "Expected all tensors to be on the same device".
    #    What a checkpoint holds, in the order a restore loads it: parts.py's Run.checkpointed.
    checkpoints = Checkpointer(
        cfg,
        world,
        run.strategy,
        run.checkpointed(),
        ready=lambda: continuity.unsaveable(run),
        saved=lambda step, state: run.tracker.log_checkpoint(state["probe"]["loss"], step),
        landed=lambda path: landed(run, home, path),
    )
    with run.clock.during("restore"):
        found = checkpoints.restore(cfg.resume)
    if world.is_main:  # rank 0 holds the home, and keeps there the run's account of its time (goodput.py)
        anchored = found is not None and found.path.parent.resolve() == home.resolve()
        run.clock.keep(home, continuing=cfg.resume is not None, anchored=anchored, max_steps=cfg.trainer.max_steps)
    if found is not None:
        run.step = found.step
    # 7b. Or, fine-tuning: a fresh run from another run's model weights (init.checkpoint), copied
    #     into the placed model; its optimizer, step and MLflow run are not this run's. A run with
    #     checkpoints of its own resumed from them above, and never reads the source again.
    elif cfg.init.checkpoint is not None:
        checkpoints.start_from()

    # 8. Optimize for the device after the restore, so that it starts from the restored state.
{%- if cookiecutter.ipex %}
    #    IPEX rewrites model and optimizer from what they hold; what it returns replaces them.
    if cfg.device.ipex:
        from .ipex import ipex_optimize  # only here: IPEX pins torch 2.8, most runs never load it

        run.model, run.optimizer = ipex_optimize(run.model, run.optimizer, cfg.amp)
        run.wrapped = run.model  # one process only (distributed.py refuses IPEX under ddp)
        checkpoints.parts.update(model=run.model, optimizer=run.optimizer)
{%- endif %}
    if cfg.trainer.compile:
        compile_cache.load(home, world.device)  # what earlier legs compiled, from this run's own home only
        run.model.compile()  # in place: state_dict keys stay those of the plain model

    # 9. Audit: every parameter, buffer, optimizer state tensor and the scaler on the device
    #    (again after the first step, in `fit`); then one batch through model, loss and metrics,
    #    so a part that does not fit the others stops the run now, before MLflow or a checkpoint
    #    hears of it; and a disk with less room than one checkpoint, which every save would fail on.
    audit_placement(run.device, run.model, run.optimizer, run.scaler)
    check_wiring(run)
    checkpoints.check_room()
    return checkpoints, found


def landed(run: Run, home: Path, path: Path) -> None:
    """A checkpoint is on disk: the run's account of its time and the graphs compiled so far go
    beside it (for a restart on another machine); then the callbacks hear of it."""
    run.clock.saved()
    if run.cfg.trainer.compile:
        compile_cache.save(home, run.device, run.world.is_main)
    run.callbacks.call("on_save_checkpoint", run, path)


def build(cfg: Config, world: World, strategy: strategies.Single) -> Evaluable:
    """Steps 3 and 4, which eval.py takes too: the data, the task, and the model, loss and metrics
    on the device, with this process's share of the validation set."""
    # 3. The data, and the task that says what its batches hold for the model; then the whole
    #    model, with any structural change (a new head) made in its constructor: the move below
    #    carries only the submodules that exist now. Each is given the data's facts that its
    #    constructor names (components.py).
    data = build_data(cfg.data)
    task = components.build("task", cfg.task, **data.facts)

    # 4. Model, loss and metrics to the device. Under fsdp the model is built without memory,
    #    sharded, and then given memory on the device, each process only its shard.
    model = strategy.build(lambda: components.build("model", cfg.model, **data.facts))
    criterion = components.build("loss", cfg.loss, **data.facts).to(world.device)
    metrics = build_metrics(cfg.metrics, data.facts, world.device)
    workers, limit = cfg.data.get("num_workers", 0), cfg.trainer.limit_val_batches
    val_loader = evaluation_loader(data.val, cfg.data.batch_size, workers, cfg.device, world, limit)
    return Evaluable(cfg, world, strategy, data, task, val_loader, model, criterion, metrics)


def fit(run: Run, checkpoints: Checkpointer, preemption: Preemption, stop: Callable[[], bool]) -> dict[str, float]:
    """11. Trains to `trainer.max_steps`, a signal or an early stop (monitor.py); saves on
    schedule, each save validated for its rank (checkpoint.keep_best). A save that fails (a full
    disk) costs a warning and is tried again at the next save point; a loss that is not finite
    stops the run before it can save (divergence.py). Returns the last loss and the throughput
    over the run, or nothing when a signal stopped it before its first step."""
    trainer, keep_best = run.trainer, run.cfg.checkpoint.keep_best
    loader = build_loader(
        run.data.train, run.cfg.data, run.cfg.device, run.cfg.seed, run.world, trainer.grad_accum_steps
    )
    # Closed as fit ends, however it ends: an open reading's workers hold the exit (data/workers.py).
    stream = batches(loader, run.position)
    divergence = Divergence(trainer, scaled=run.scaler.is_enabled())
    meter, loss, first, lost = Throughput(run.task.unit), None, run.step, None
    stepping = run.callbacks.stepping  # the one check a step pays for callbacks without a per-step hook
    run.callbacks.call("on_fit_start", run)
    run.clock.training(run.step)
    if run.monitor.owed is not None:  # a stop cut this step's validation short: done first, as the unbroken run did
        validate(run, run.monitor.owed[1], stop, judged=scheduled(trainer, run.step))
    with Progress(trainer, run.step, main=run.world.is_main) as progress, closing(stream):
        while run.step < trainer.max_steps and not run.monitor.stopped and not preemption.agreed(run.world, lost):
            micro_batches = [next(stream) for _ in range(trainer.grad_accum_steps)]
            loss, grad_norm, counted = train_step(run, micro_batches)
            if run.step == first:  # the optimizer's state exists now, and so does a layer built in forward
                audit_placement(run.device, run.model, run.optimizer, run.scaler)
                param_groups.check_optimized(run.model, run.optimizer)
            run.step += 1
            run.clock.stepped(run.step)
            divergence.watch(run.step, loss)
            meter.count(run.world.size * counted)
            progress.step()
            if stepping:
                run.callbacks.call("on_train_step_end", run, loss)
            if run.step % trainer.log_every_n_steps == 0:
                divergence.check(checkpoints.standing)
                value, rates = loss.item(), meter.window()
                lrs = param_groups.learning_rates(run.optimizer)
                norm = {} if grad_norm is None else {"train/grad_norm": grad_norm.item()}
                run.tracker.log_metrics({"train/loss": value, **lrs, **norm, **rates}, run.step)
                progress.report(run.step, value, rates[meter.rate], meter.unit)
                run.clock.beat(run.step)
                lost = checkpoints.lost  # rank 0's; every rank stops at the next agreement
            # A validation cut short by a stop ends the step: the loop's check ends the run, as after any step.
            if scheduled(trainer, run.step) and validate(run, loss.item(), stop, judged=True) is None:
                continue
            if checkpoints.due(run.step):
                divergence.check(checkpoints.standing)
                # Each checkpoint is ranked by its own step's metric.
                if keep_best and validate(run, loss.item(), stop) is None:
                    continue
                with run.clock.during("save"):
                    checkpoints.try_save(run.step)
    if preemption.failed:  # another machine took the run over: it trains it now
        raise RunError(f"{preemption.failed}; this machine stops at step {run.step} and uploads nothing more")
    run.clock.ending()
    divergence.check(checkpoints.standing)
    # A run stopped before its first step trains nothing: no training loss or throughput to report.
    return {"train/loss": loss.item(), **meter.total()} if loss is not None else {}


def finish(
    run: Run, checkpoints: Checkpointer, trained: dict[str, float], verdict: str, stop: Callable[[], bool]
) -> dict:
    """The final validation, of a run at its end (`stop` may cut it short; a run stopped sooner saves
    at once), and the last save, which must succeed, then the callbacks' on_fit_end (at a signal too:
    run.step says where); the run's result, the same on every process (the MLflow run id is rank 0's)."""
    val = (validate(run, trained.get("train/loss"), stop) if run.monitor.ended(run.step) else None) or {}
    run.tracker.log_metrics({key: value for key, value in trained.items() if key.startswith("train/mean_")}, run.step)
    with run.clock.during("save"):
        checkpoints.final(run.step)
    if run.monitor.stopped:
        run.tracker.set_tags({"stopped_early": str(run.step)})
        log.info(f"stopped early at step {run.step}: {run.monitor.explain()}")
    run.callbacks.call("on_fit_end", run, {**trained, **val})
    run_id = run.world.broadcast(run.tracker.run_id)
    return {**trained, **val, "continuity": verdict, "step": run.step, "run_id": run_id}


def nothing_to_train(run: Run, checkpoints: Checkpointer) -> dict:
    """A resume of a run at trainer.max_steps, or stopped early: says so and leaves the run as it was
    (checkpoints, callbacks, MLflow run), but for the models mlflow.log_models names that its MLflow
    run lacks (a sender that died logging them). The result's scores are evaluated again, logged nowhere."""
    finished = run.step >= run.trainer.max_steps
    done, more = ("finished", "max_steps") if finished else ("stopped early", "early_stopping.patience")
    log.info(
        f"{shown(run.cfg.name)} {done} at step {run.step} already: nothing to train; raise trainer.{more} to continue"
    )
    val = evaluate(run, run.val_loader)
    run.tracker.attach(run.cfg.name)
    log_models(run, checkpoints)
    run.tracker.finish(None)
    return {**val, "step": run.step, "run_id": run.world.broadcast(run.tracker.state_dict()["run_id"])}


def log_models(run: Run, checkpoints: Checkpointer) -> None:
    """12. The models out: the checkpoints `mlflow.log_models` names, as MLflow models of the run,
    which the sender process builds from the model's description, the checkpoint's weights and an
    input of two validation samples (rank 0's: the one that tracks)."""
    if run.cfg.mlflow.log_models == "none" or run.tracker.run_id is None:  # untracked, or not rank 0
        return
    inputs, _ = run.task.split(next(iter(run.val_loader)))
    try:
        if not isinstance(inputs, torch.Tensor):
            raise RunError(f"the model takes a {type(inputs).__name__}, and MLflow's models take tensors")
        model = components.described("model", run.cfg.model, **run.data.facts)
    except RunError as error:
        log.warning(f"no model is logged to MLflow: {error}; export.py writes the weights")
        return
    example = {"values": inputs[:2].tolist(), "dtype": str(inputs.dtype).removeprefix("torch.")}
    run.tracker.log_models(checkpoints.kept(run.cfg.mlflow.log_models), model, example)
