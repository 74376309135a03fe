"""A checkpoint of step N becomes visible (renamed into place) only once every metric of the steps
up to N is in the MLflow sender's hands: a resume starts after N, so a kill -9 right after the
rename must lose none of them. Each run here is killed at the instant its save is renamed, held
there by the save gate (conftest.SaveGate), then resumed; every step's train/loss must then be in
MLflow exactly once.

Every step logs five metrics, and the saves come every 5 steps: between two saves fewer rows
gather than the training process hands over unasked (handover.HAND_OVER_EVERY), so only a save
can hand them over; and training, which goes on during a background write held at the gate, stops
at the next save, which waits for that write, before a step after the save could reach MLflow."""

import os
import signal
from pathlib import Path

import pytest
from conftest import command, configured, losses, run_cli, start, started_by, wait_for_exit
from mlflow import MlflowClient
from test_distributed import CPU, torchrun

from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

EVERY_5 = ["trainer.log_every_n_steps=1", "checkpoint.every_n_steps=5"]


@pytest.mark.parametrize(
    "how",
    [
        ["checkpoint.async_save=false"],
        ["checkpoint.async_save=true"],
        ["strategy=fsdp", *CPU, "checkpoint.async_save=false"],  # the sharded format, in a group of one process
        ["strategy=fsdp", *CPU, "checkpoint.async_save=true"],
    ],
    ids=["one-file", "one-file-background", "sharded", "sharded-background"],
)
def test_a_kill_9_right_after_a_save_loses_no_metric_of_the_steps_it_covers(project, save_gate, how):
    settings = [*EVERY_5, *how, "trainer.max_steps=40"]
    senders = []
    for killed_at in (15, 20):  # the first leg's third save, the next leg's first
        gate = save_gate(match=f"step_{killed_at:08d}")
        process = start(project, *settings, *["resume=last"] * bool(senders), env=gate.env)
        senders.append(kill_at_the_gate(gate.wait(process)))
        process.communicate(timeout=60)
        assert newest_valid(project / "checkpoints" / configured().name)[1]["step"] == killed_at
    resumed = run_cli(project, *settings, "resume=last")
    assert resumed.returncode == 0, resumed.stderr
    assert_each_step_logged_once(project, senders, 40)


def test_a_rank_0_killed_right_after_each_sharded_save_under_torchrun_loses_no_metric(project, save_gate):
    """Two processes under torchrun, which restarts the job after each kill; rank 0 completes each
    folder (in the background: at the next save point), and is killed at its first in each attempt."""
    kills, every = 2, 5
    gate = save_gate(each=True)
    settings = [f"checkpoint.every_n_steps={every}", f"trainer.max_steps={every * (kills + 1)}", "resume=auto"]
    with open(project / "torchrun.log", "w+") as log:
        process = torchrun(project, *settings, strategy="fsdp", restarts=kills, env=gate.env, output=log)
        senders = []
        for _ in range(kills):
            senders.append(kill_at_the_gate(gate.wait(process)))
            gate.release()
        gate.wait(process)  # the attempt that is let go
        gate.release()
        process.wait()
        log.seek(0)
        assert process.returncode == 0, log.read()
    assert_each_step_logged_once(project, senders, every * (kills + 1))


def kill_at_the_gate(pid: int) -> int:
    """SIGKILL to `pid`, held at the gate just after its rename; returns the pid of its MLflow
    sender, which lives on to deliver what it was handed."""
    (sender,) = [child for child in started_by(pid) if "drain" in command(child)]
    os.kill(pid, signal.SIGKILL)
    return sender


def assert_each_step_logged_once(project: Path, senders: list[int], steps: int) -> None:
    for sender in senders:  # the killed legs' senders deliver what they were handed, then end
        wait_for_exit(sender)
    run_id = newest_valid(project / "checkpoints" / configured().name)[1]["tracker"]["run_id"]
    logged = losses(MlflowClient(f"sqlite:///{project / 'mlflow.db'}"), run_id)
    missing = [step for step in range(1, steps + 1) if step not in logged]
    twice = [step for step, values in logged.items() if len(values) > 1]
    assert (missing, twice) == ([], []), "train/loss of these steps never reached MLflow, or came twice"
    assert sorted(logged) == list(range(1, steps + 1))
