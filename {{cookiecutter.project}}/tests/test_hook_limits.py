"""What a callback may not do to a run (hooks.py, time_limit.py, preemption.py): keep a state no checkpoint
can hold, hold the run in a hook past trainer.hook_timeout_s, whatever it does with the signals that
bound it, or keep a stop from reaching it. Each ends the run in one line, with the newest checkpoint
intact for resume=last."""

import concurrent.futures
import contextlib
import logging
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import configured, goodput_of, losses, runs_named, start
from test_cli import descendants
from test_distributed import ranks, torchrun

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.callbacks import state as callback_state
from {{cookiecutter.package}}.engine.callbacks.time_limit import Hold
from {{cookiecutter.package}}.engine.checkpoint.home import path_of, steps
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.lifecycle import preemption

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

SETTINGS = ["trainer.log_every_n_steps=10", "trainer.val_every_n_steps=10", "checkpoint.every_n_steps=10"]
HELD = 60  # seconds a held hook sleeps: this long only where nothing interrupts it


class Keeper:
    """Keeps a count; its second state holds `holds`, which no checkpoint can."""

    def __init__(self, holds: str | None = None) -> None:
        self.holds, self.saved = holds, 0

    def state_dict(self) -> dict:
        self.saved += 1
        if self.saved < 2 or self.holds is None:
            return {"saved": self.saved}
        unsaveable = {"path": pathlib.Path("/data"), "lambda": lambda: 0, "file": open(os.devnull)}  # noqa: SIM115
        return {"saved": self.saved, "found": {"where": unsaveable[self.holds]}}

    def load_state_dict(self, state: dict) -> None:
        self.saved = state["saved"]


KEEPER = "+callbacks.keeper._target_=test_hook_limits.Keeper"


@pytest.mark.parametrize(
    ("holds", "found"),
    [
        ("path", "a PosixPath at state_dict()['found']['where'], {}store str(path) instead"),
        ("lambda", "a function at state_dict()['found']['where'], {}store plain values instead"),
        ("file", "a TextIOWrapper at state_dict()['found']['where'], {}store plain values instead"),
    ],
    ids=["path", "lambda", "file"],
)
def test_a_callback_state_no_checkpoint_can_hold_stops_the_run_at_that_save_in_one_line(
    make_cfg, checkpoint_dir, holds, found
):
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(*SETTINGS, "trainer.max_steps=20", KEEPER, f"+callbacks.keeper.holds={holds}"))
    said = found.format(
        "which a checkpoint cannot hold (resume and eval.py load only tensors and plain values), so nothing is saved; "
    )
    assert str(raised.value).startswith(f"callbacks.keeper (test_hook_limits.Keeper) holds {said}")
    assert str(raised.value).endswith(
        f"; the newest checkpoint on disk is {path_of(checkpoint_dir, 10)}; fix it, then continue from it with "
        f"name={configured().name} resume=last"
    )
    assert [step for step, _ in steps(checkpoint_dir)] == [10]  # nothing of step 20
    if holds == "path":
        result = recipe.train(make_cfg(*SETTINGS, "trainer.max_steps=30", KEEPER, "resume=last"))
        assert result["step"] == 30 and result["continuity"] == "ok"


def shaped(shape: str) -> object:
    """A state's value that contains itself (`list`, `dict`), or that nests 5,000 deep (`deep`)."""
    if shape == "deep":
        value: dict = {}
        for _ in range(5000):
            value = {"inner": value}
        return value
    value = [] if shape == "list" else {}
    if shape == "list":
        value.append(value)
    else:
        value["itself"] = value
    return value


class Shaped(Keeper):
    """Keeps a count; its second state holds `shape` (shaped)."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.shape = shape

    def state_dict(self) -> dict:
        state = super().state_dict()
        return state if self.saved < 2 else {**state, "found": shaped(self.shape)}


@pytest.mark.parametrize(
    ("shape", "said", "instead"),
    [
        ("list", "that is recursive (a dict, list or tuple in it contains itself)", "store it without the loop"),
        ("dict", "that is recursive (a dict, list or tuple in it contains itself)", "store it without the loop"),
        ("deep", "deeper than 100 levels of dicts, lists and tuples", "store it flatter"),
    ],
    ids=["recursive_list", "recursive_dict", "deep_dict"],
)
def test_a_callback_state_that_contains_itself_or_nests_too_deep_stops_the_run_at_that_save_in_one_line(
    make_cfg, checkpoint_dir, shape, said, instead
):
    with pytest.raises(RunError) as raised:
        recipe.train(
            make_cfg(*SETTINGS, "trainer.max_steps=20", "+callbacks.shaped._target_=test_hook_limits.Shaped", f"+callbacks.shaped.shape={shape}")
        )  # fmt: skip
    assert str(raised.value) == (
        f"callbacks.shaped (test_hook_limits.Shaped) holds a state {said}, which a checkpoint does not take, so "
        f"nothing is saved; {instead}; the newest checkpoint on disk is {path_of(checkpoint_dir, 10)}; fix it, then "
        f"continue from it with name={configured().name} resume=last"
    )
    assert [step for step, _ in steps(checkpoint_dir)] == [10]


def test_a_callback_state_that_shares_a_list_at_every_level_is_judged_once_a_list():
    """60 levels of `[inner, inner]`: 2**60 paths through 60 lists, which pickle writes once each."""
    state: list = []
    for _ in range(60):
        state = [state, state]
    assert callback_state.refused({"shared": state}) is None


class Stuck:
    """Holds the run in on_validation_end from step `at`; with `stop`, having sent this process that
    signal; with `marker`, having written that file; with `swallows`, catching what interrupts it, and
    returning."""

    def __init__(self, at: int = 20, stop: str | None = None, marker: str | None = None, swallows: bool = False):
        self.at, self.stop, self.marker, self.swallows = at, stop, marker, swallows

    def on_validation_end(self, run, metrics) -> None:
        if run.step < self.at:
            return
        if self.marker:
            pathlib.Path(self.marker).touch()
        with contextlib.suppress(BaseException) if self.swallows else contextlib.nullcontext():
            if self.stop:
                os.kill(os.getpid(), signal.Signals[self.stop])
            time.sleep(HELD)


class StuckKeeping(Stuck):
    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def test_a_hook_past_trainer_hook_timeout_s_stops_the_run_in_one_line_after_the_newest_checkpoint(
    make_cfg, checkpoint_dir
):
    began = time.monotonic()
    with pytest.raises(RunError) as raised:
        recipe.train(
            make_cfg(*SETTINGS, "trainer.max_steps=30", "trainer.hook_timeout_s=0.5", "+callbacks.stuck._target_=test_hook_limits.Stuck")
        )  # fmt: skip
    assert time.monotonic() - began < HELD
    assert str(raised.value) == (
        "callbacks.stuck (test_hook_limits.Stuck) did not return from on_validation_end within "
        "trainer.hook_timeout_s=0.5 s (raise it if the hook needs longer); the newest checkpoint on disk is "
        f"{path_of(checkpoint_dir, 10)}; fix it, then continue from it with name={configured().name} resume=last"
    )
    assert [step for step, _ in steps(checkpoint_dir)] == [10]
    result = recipe.train(make_cfg(*SETTINGS, "trainer.max_steps=30", "resume=last"))
    assert result["step"] == 30 and result["continuity"] == "ok"


class Defiant:
    """Holds the run in on_validation_end from step 20, as `how` says: `alarm` cancels the process's
    SIGALRM timer first; `handler` takes SIGALRM over, as a library's own timeout does; `once`
    swallows the first interrupt, and returns; `on` swallows the first, and holds on."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_validation_end(self, run, metrics) -> None:
        if run.step < 20:
            return
        if self.how == "alarm":
            signal.alarm(0)
        taken = signal.signal(signal.SIGALRM, lambda *_: None) if self.how == "handler" else None
        try:
            with contextlib.suppress(BaseException) if self.how in ("once", "on") else contextlib.nullcontext():
                time.sleep(HELD)
            if self.how != "once":
                time.sleep(HELD)
        finally:
            if taken is not None:
                signal.signal(signal.SIGALRM, taken)


@pytest.mark.parametrize("how", ["alarm", "handler", "once", "on"])
def test_a_hook_that_cancels_its_timer_takes_sigalrm_over_or_swallows_its_interrupt_still_stops_at_its_bound(
    make_cfg, checkpoint_dir, client, how
):
    began = time.monotonic()
    with pytest.raises(RunError) as raised:
        recipe.train(
            make_cfg(*SETTINGS, f"name=defiant-{how}", "trainer.max_steps=30", "trainer.hook_timeout_s=0.5", "+callbacks.defiant._target_=test_hook_limits.Defiant", f"+callbacks.defiant.how={how}")
        )  # fmt: skip
    assert time.monotonic() - began < HELD
    assert str(raised.value) == (
        "callbacks.defiant (test_hook_limits.Defiant) did not return from on_validation_end within "
        "trainer.hook_timeout_s=0.5 s (raise it if the hook needs longer); the newest checkpoint on disk is "
        f"{path_of(checkpoint_dir, 10)}; fix it, then continue from it with name=defiant-{how} resume=last"
    )
    assert [step for step, _ in steps(checkpoint_dir)] == [10]
    (run,) = runs_named(client, f"defiant-{how}")
    assert run.info.status == "FAILED"
    assert goodput_of(run)["hooks_s"] >= 0.5  # the hook's time is its own, not training's


class Slow:
    """Takes `seconds` at each validation, and returns."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_validation_end(self, run, metrics) -> None:
        time.sleep(self.seconds)


def test_the_time_hooks_hold_the_run_is_theirs_in_the_goodput_not_trainings(make_cfg, client):
    result = recipe.train(
        make_cfg(*SETTINGS, "name=slow-hooks", "trainer.max_steps=30", "+callbacks.slow._target_=test_hook_limits.Slow", "+callbacks.slow.seconds=0.5")
    )  # fmt: skip
    (run,) = runs_named(client, "slow-hooks")
    assert result["step"] == 30 and run.info.status == "FINISHED"
    goodput = goodput_of(run)
    assert goodput["hooks_s"] >= 3 * 0.5  # the validations of steps 10, 20 and 30
    assert goodput["train_s"] <= goodput["wall_s"] - goodput["hooks_s"]


def test_trainer_hook_timeout_s_must_be_positive_or_null(make_cfg):
    with pytest.raises(RunError, match=r"trainer.hook_timeout_s=0.0 must be positive, or null for no bound"):
        recipe.train(make_cfg("trainer.hook_timeout_s=0"))


@pytest.mark.parametrize("swallows", [False, True], ids=["let_out", "swallowed"])
@pytest.mark.parametrize("keeps", [False, True], ids=["stateless", "keeping_state"])
def test_a_stop_interrupts_a_held_hook_and_saves_unless_a_callback_in_it_keeps_state_swallowed_or_not(
    make_cfg, checkpoint_dir, caplog, keeps, swallows
):
    caplog.set_level(logging.INFO)
    target = "test_hook_limits." + ("StuckKeeping" if keeps else "Stuck")
    began = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        recipe.train(
            make_cfg(*SETTINGS, f"+callbacks.stuck._target_={target}", "+callbacks.stuck.stop=SIGTERM", f"+callbacks.stuck.swallows={swallows}")
        )  # fmt: skip
    assert time.monotonic() - began < HELD
    assert stopped.value.code == 128 + signal.SIGTERM
    interrupted = f"callbacks.stuck ({target}) was interrupted by SIGTERM in on_validation_end"
    if keeps:
        said = (
            f"{interrupted}, so the state of callbacks.stuck may be half-updated: nothing more is saved; the newest "
            f"checkpoint on disk is {path_of(checkpoint_dir, 10)}"
        )
    else:
        said = f"saved {path_of(checkpoint_dir, 20)}"
        assert f"{interrupted}; the run's later hooks are skipped" in caplog.messages
    assert (
        f"stopped at step 20 by SIGTERM; {said}; continue with name={configured().name} resume=last" in caplog.messages
    )
    assert sorted(step for step, _ in steps(checkpoint_dir)) == ([10] if keeps else [10, 20])
    result = recipe.train(make_cfg(*SETTINGS, "resume=last"))
    assert result["step"] == 40 and result["continuity"] == "ok"


class LastStep:
    """Sends this process SIGTERM in the last step's on_train_step_end; with `swallows`, catching the
    interrupt, and returning."""

    def __init__(self, swallows: bool) -> None:
        self.swallows = swallows

    def on_train_step_end(self, run, loss) -> None:
        if run.step == run.cfg.trainer.max_steps:
            with contextlib.suppress(BaseException) if self.swallows else contextlib.nullcontext():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(HELD)


@pytest.mark.parametrize("swallows", [False, True], ids=["let_out", "swallowed"])
def test_a_stop_in_the_last_steps_hook_is_said_swallowed_or_not_and_the_run_ends_as_at_any_stop_there(
    make_cfg, checkpoint_dir, client, caplog, swallows
):
    """The run has trained its steps, and the stop reaches its last validation before its first batch:
    the last step is saved, that validation owed, and the run stops (KILLED, no models logged); the
    resume validates it, logs the models and ends FINISHED."""
    caplog.set_level(logging.INFO)
    name = f"last-{swallows}"
    settings = [*SETTINGS, f"name={name}", "trainer.max_steps=30", "checkpoint.keep_last=3", "mlflow.log_models=final"]
    with pytest.raises(SystemExit) as stopped:
        recipe.train(
            make_cfg(*settings, "+callbacks.last._target_=test_hook_limits.LastStep", f"+callbacks.last.swallows={swallows}")
        )  # fmt: skip
    assert stopped.value.code == 128 + signal.SIGTERM
    assert (
        "callbacks.last (test_hook_limits.LastStep) was interrupted by SIGTERM in on_train_step_end; the run's later "
        "hooks are skipped"
    ) in caplog.messages
    assert sorted(step for step, _ in steps(checkpoint_dir)) == [10, 20, 30]
    (run,) = runs_named(client, name)
    found = f"source_run_id = '{run.info.run_id}'"
    assert run.info.status == "KILLED" and 30 not in losses(client, run.info.run_id, "val/loss")
    assert not client.search_logged_models(experiment_ids=[run.info.experiment_id], filter_string=found)

    result = recipe.train(make_cfg(*settings, "resume=last"))
    (run,) = runs_named(client, name)
    assert result["step"] == 30 and run.info.status == "FINISHED"
    assert losses(client, run.info.run_id, "val/loss")[30] == [result["val/loss"]]
    assert client.search_logged_models(experiment_ids=[run.info.experiment_id], filter_string=found)


STUCK = """
import pathlib, time


class Stuck:
    def __init__(self, marker, rank=None):
        self.marker, self.rank = pathlib.Path(marker), rank

    def on_validation_end(self, run, metrics):
        if run.step >= 20 and self.rank in (None, run.world.rank):
            self.marker.touch()
            time.sleep(600)
"""


@contextlib.contextmanager
def held_run(
    project: pathlib.Path, *overrides: str, env: dict | None = None, launch: Callable = start
) -> Iterator[subprocess.Popen]:
    """`python run.py` (or `launch`) with a callback that holds the run in on_validation_end from
    step 20, once it is held there; killed at the end if still running."""
    (project / "stuck_callbacks.py").write_text(STUCK)
    marker = project / "held"
    process = launch(
        project, *SETTINGS, "+callbacks.stuck._target_=stuck_callbacks.Stuck", f"+callbacks.stuck.marker={marker}",
        *overrides, env=env,
    )  # fmt: skip
    try:
        while not marker.exists():
            assert process.poll() is None, process.communicate()
            time.sleep(0.01)
        yield process
    finally:
        for pid in [*descendants(process.pid), process.pid]:  # under torchrun, its ranks too
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.communicate()


def test_sigterm_reaches_a_run_held_in_a_hook_which_stops_saved_without_a_traceback(project):
    home = project / "checkpoints" / configured().name
    with held_run(project) as process:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stdout + stderr
    lines = (stdout + stderr).splitlines()
    assert (
        f"stopped at step 20 by SIGTERM; saved {path_of(home, 20)}; continue with name={home.name} resume=last" in lines
    )
    assert load(path_of(home, 20)).step == 20


def test_a_signal_that_comes_while_the_run_writes_to_a_full_log_pipe_is_said_there_without_a_logging_error():
    """A run whose stderr is a pipe nobody reads for a while (a launcher's, a test's) waits in its
    write; a signal then interrupts that write, and the handler's own line, written from there, would
    be a reentrant write into the same stream: Python refuses it, and logging printed a traceback."""
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    handler = logging.StreamHandler(stream)
    errors = []
    handler.handleError = lambda record: errors.append(repr(sys.exc_info()[1]))  # what a write raised
    logger = logging.getLogger(preemption.__name__)
    logger.addHandler(handler)
    main = threading.main_thread()

    def signal_the_blocked_write_then_read() -> bytes:
        wchan, given_up = pathlib.Path(f"/proc/self/task/{main.native_id}/wchan"), time.monotonic() + 120
        # Until the main thread waits in its write, the pipe full (the kernel's pipe_write, or anon_pipe_write).
        while not wchan.read_text().endswith("pipe_write"):
            if time.monotonic() > given_up:
                os.close(read)  # the main thread's write fails rather than wait for good
                raise AssertionError(f"the main thread never waited in its write: {wchan.read_text()}")
            time.sleep(0.01)
        signal.pthread_kill(main.ident, signal.SIGTERM)
        said = b""
        while chunk := os.read(read, 1 << 16):
            said += chunk
        return said

    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        said = reader.submit(signal_the_blocked_write_then_read)
        try:
            with preemption.Preemption(Hold(None)) as stops:
                stream.write("x" * (1 << 20))  # 16 times what a pipe holds
                stream.flush()
        finally:
            logger.removeHandler(handler)
            stream.close()
        assert stops.received == signal.SIGTERM and errors == []
        assert "SIGTERM received: finishing this step or validation batch" in said.result().decode()


def test_the_stop_line_names_the_run_and_its_words_typed_as_printed_continue_that_run(project, save_gate):
    """A run named w-int, stopped once its step 10 is saved: the words the stop line gives, after
    `python run.py`, continue w-int from its checkpoint, not the configs' default run."""
    gate = save_gate(match="step_00000010")
    process = start(project, *SETTINGS, "name=w-int", "trainer.max_steps=30", env=gate.env)
    gate.wait(process)
    process.send_signal(signal.SIGTERM)
    gate.release()
    stdout, stderr = process.communicate(timeout=120)
    said = next(line for line in (stdout + stderr).splitlines() if line.startswith("stopped at step "))
    assert said.endswith("; continue with name=w-int resume=last"), said
    continued = start(project, *shlex.split(said.rpartition("continue with ")[2]))
    stdout, stderr = continued.communicate(timeout=120)
    assert continued.returncode == 0, stderr
    assert max(step for step, _ in steps(project / "checkpoints" / "w-int")) == 30
    assert "nothing to train" not in stdout + stderr and not (project / "checkpoints" / configured().name).exists()


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_keeps_the_newest_checkpoint(project, save_gate):
    """The first Ctrl-C interrupts the held hook; the run then saves, held at that save (the gate),
    where the second one stops it."""
    home = project / "checkpoints" / configured().name
    gate = save_gate(when="before", match="step_00000020")
    with held_run(project, "checkpoint.async_save=false", env=gate.env) as process:
        process.send_signal(signal.SIGINT)
        gate.wait(process)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr
    assert stdout.splitlines()[-1] == (
        f"stopped at once by a second Ctrl-C: nothing more is saved; continue from it with name={home.name} resume=last"
    )
    assert [step for step, _ in steps(home)] == [10] and not list(home.glob("*.tmp"))
    assert load(path_of(home, 10)).step == 10


def test_under_ddp_a_stop_that_reaches_one_rank_held_in_a_hook_stops_both_at_that_step_saved(project):
    """Rank 1 alone is held, and alone signalled; rank 0, done with its hook, waits for it."""
    home = project / "checkpoints" / configured().name
    with held_run(project, "+callbacks.stuck.rank=1", launch=torchrun) as process:
        os.kill(ranks(process)[1], signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    assert "exitcode  : 143" in stdout + stderr  # torchrun's report of the ranks' exit
    lines = (stdout + stderr).splitlines()
    assert (
        f"stopped at step 20 by SIGTERM; saved {path_of(home, 20)}; continue with name={home.name} resume=last" in lines
    )
    assert len(load(path_of(home, 20)).part("rng")["ranks"]) == 2


FOREVER = """
import signal, time


class Forever:
    def __init__(self, how):
        self.how = how

    def on_validation_end(self, run, metrics):
        if run.step < 20:
            return
        if self.how == "every_signal":
            for number in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
                try:
                    signal.signal(number, lambda *_: None)
                except (OSError, ValueError):
                    pass
        while True:
            try:
                time.sleep(600)
            except BaseException:
                pass
"""


@pytest.mark.parametrize("how", ["swallows_all", "every_signal"])
def test_a_hook_that_swallows_every_interrupt_or_takes_every_signal_over_ends_the_process_in_one_line(project, how):
    """Nothing raised into the main thread can stop such a hook: the watchdog ends the process, as a
    kill would, once the hook has held the run its bound and as long again."""
    home = project / "checkpoints" / configured().name
    (project / "forever_callbacks.py").write_text(FOREVER)
    process = start(
        project, *SETTINGS, "trainer.hook_timeout_s=0.5", "+callbacks.forever._target_=forever_callbacks.Forever",
        f"+callbacks.forever.how={how}",
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
    assert process.returncode == 2, stderr
    assert "Traceback" not in stdout + stderr
    assert (
        "error: callbacks.forever (forever_callbacks.Forever) did not return from on_validation_end within "
        "trainer.hook_timeout_s=0.5 s (raise it if the hook needs longer), nor 0.5 s after it was interrupted: the "
        "process ends here, as at a kill; nothing after the newest checkpoint is saved; fix it, then continue from it "
        f"with name={home.name} resume=last"
    ) in stderr.splitlines()
    assert [step for step, _ in steps(home)] == [10] and not list(home.glob("*.tmp"))
    assert load(path_of(home, 10)).step == 10
