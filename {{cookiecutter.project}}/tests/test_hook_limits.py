"""What a callback may not do to a run (hooks.py, preemption.py): keep a state no checkpoint can hold,
hold the run in a hook past trainer.hook_timeout_s, or keep a stop from reaching it. Each ends the
run in one line, with the newest checkpoint intact for resume=last."""

import contextlib
import logging
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import start
from test_cli import descendants
from test_distributed import ranks, torchrun

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.home import path_of, steps
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.errors import RunError

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
        f"resume=last"
    )
    assert [step for step, _ in steps(checkpoint_dir)] == [10]  # nothing of step 20
    if holds == "path":
        result = recipe.train(make_cfg(*SETTINGS, "trainer.max_steps=30", KEEPER, "resume=last"))
        assert result["step"] == 30 and result["continuity"] == "ok"


class Stuck:
    """Holds the run in on_validation_end from step `at`; with `stop`, having sent this process that
    signal; with `marker`, having written that file; with `keeps`, a callback with state."""

    def __init__(self, at: int = 20, stop: str | None = None, marker: str | None = None) -> None:
        self.at, self.stop, self.marker = at, stop, marker

    def on_validation_end(self, run, metrics) -> None:
        if run.step < self.at:
            return
        if self.marker:
            pathlib.Path(self.marker).touch()
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
        f"{path_of(checkpoint_dir, 10)}; fix it, then continue from it with resume=last"
    )
    assert [step for step, _ in steps(checkpoint_dir)] == [10]
    result = recipe.train(make_cfg(*SETTINGS, "trainer.max_steps=30", "resume=last"))
    assert result["step"] == 30 and result["continuity"] == "ok"


def test_trainer_hook_timeout_s_must_be_positive_or_null(make_cfg):
    with pytest.raises(RunError, match=r"trainer.hook_timeout_s=0.0 must be positive, or null for no bound"):
        recipe.train(make_cfg("trainer.hook_timeout_s=0"))


@pytest.mark.parametrize("keeps", [False, True], ids=["stateless", "keeping_state"])
def test_a_stop_interrupts_a_held_hook_and_saves_unless_a_callback_in_it_keeps_state(
    make_cfg, checkpoint_dir, caplog, keeps
):
    caplog.set_level(logging.INFO)
    target = "test_hook_limits." + ("StuckKeeping" if keeps else "Stuck")
    began = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        recipe.train(make_cfg(*SETTINGS, f"+callbacks.stuck._target_={target}", "+callbacks.stuck.stop=SIGTERM"))
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
    assert f"stopped at step 20 by SIGTERM; {said}; continue with resume=last" in caplog.messages
    assert sorted(step for step, _ in steps(checkpoint_dir)) == ([10] if keeps else [10, 20])
    result = recipe.train(make_cfg(*SETTINGS, "resume=last"))
    assert result["step"] == 40 and result["continuity"] == "ok"


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
    home = project / "checkpoints" / "demo"
    with held_run(project) as process:
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stdout + stderr
    lines = (stdout + stderr).splitlines()
    assert f"stopped at step 20 by SIGTERM; saved {path_of(home, 20)}; continue with resume=last" in lines
    assert load(path_of(home, 20)).step == 20


def test_a_second_ctrl_c_stops_at_once_in_one_line_and_keeps_the_newest_checkpoint(project, save_gate):
    """The first Ctrl-C interrupts the held hook; the run then saves, held at that save (the gate),
    where the second one stops it."""
    home = project / "checkpoints" / "demo"
    gate = save_gate(when="before", match="step_00000020")
    with held_run(project, "checkpoint.async_save=false", env=gate.env) as process:
        process.send_signal(signal.SIGINT)
        gate.wait(process)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stdout + stderr and "KeyboardInterrupt" not in stdout + stderr
    assert stdout.splitlines()[-1] == (
        "stopped at once by a second Ctrl-C: nothing more is saved; continue with resume=last"
    )
    assert [step for step, _ in steps(home)] == [10] and not list(home.glob("*.tmp"))
    assert load(path_of(home, 10)).step == 10


def test_under_ddp_a_stop_that_reaches_one_rank_held_in_a_hook_stops_both_at_that_step_saved(project):
    """Rank 1 alone is held, and alone signalled; rank 0, done with its hook, waits for it."""
    home = project / "checkpoints" / "demo"
    with held_run(project, "+callbacks.stuck.rank=1", launch=torchrun) as process:
        os.kill(ranks(process)[1], signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
    assert "exitcode  : 143" in stdout + stderr  # torchrun's report of the ranks' exit
    lines = (stdout + stderr).splitlines()
    assert f"stopped at step 20 by SIGTERM; saved {path_of(home, 20)}; continue with resume=last" in lines
    assert len(load(path_of(home, 20)).part("rng")["ranks"]) == 2
