"""`python run.py` as a person types it: the default demo, one-line errors, preemption by
SIGTERM, and `kill -9` at any moment, mid-save included."""

import contextlib
import fcntl
import os
import pty
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
from conftest import configured, losses, run_cli, runs_named, start, wait_for_a_save
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine.checkpoint.resume import load, newest_valid

pytestmark = pytest.mark.slow


def test_the_default_demo_trains_and_logs_to_the_project_store(bare_project):
    project = bare_project  # the first run makes the store
    result = run_cli(project)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "device: cpu" in output and "amp: off" in output
    cfg = configured()  # the name, steps and optimizer as the project's configs set them
    steps, every = cfg.trainer.max_steps, cfg.trainer.log_every_n_steps
    assert f"finished at step {steps}" in output
    assert (project / "mlflow.db").exists()
    assert (project / "checkpoints" / cfg.name / f"step_{steps:08d}.pt").exists()
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = runs_named(client, cfg.name)
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer"] == cfg.optimizer._target_.rsplit(".", 1)[-1]
    assert run.data.params["optimizer.lr"] == str(cfg.optimizer.lr)
    assert run.data.tags["device"] == "cpu"
    logged = losses(client, run.info.run_id)
    assert sorted(logged) == list(range(every, steps + 1, every))
    assert logged[steps][-1] < logged[every][-1], "it learns, however long and fast the configs say"
    assert run.data.metrics["val/accuracy"] > 0.1  # above chance: one in the digits' 10 classes
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["config.yaml", "provenance"]


def test_the_progress_display_stays_quiet_without_a_terminal_and_shows_with_one(project):
    quiet = run_cli(project, "trainer.max_steps=30", "mlflow.enabled=false")
    assert quiet.returncode == 0 and "it/s" not in quiet.stderr and "samples_s" not in quiet.stderr
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0x0
    process = subprocess.Popen(
        [sys.executable, "run.py", "trainer.max_steps=30", "mlflow.enabled=false", "name=tty"],
        cwd=project, stdout=subprocess.DEVNULL, stderr=secondary,
    )  # fmt: skip
    os.close(secondary)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        shown += chunk
    assert process.wait(timeout=120) == 0
    assert b"train: 100%" in shown and b"samples_s=" in shown


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has cuda")
def test_a_missing_device_exits_before_building_with_one_line_and_no_traceback(project):
    result = run_cli(project, "device=cuda")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: device=cuda was asked for, but torch.cuda.is_available() is False (this torch build is "
        f"{torch.__version__}); use device=auto or device=cpu, or install a torch build with cuda support"
    ]
    assert not (project / "checkpoints").exists()


def test_an_unknown_group_option_is_hydras_error(project):
    result = run_cli(project, "device=tpu")
    assert result.returncode == 1
    assert "Could not find 'device/tpu'" in result.stderr and "Traceback" not in result.stderr


def test_resume_last_with_nothing_saved_says_where_it_looked(project):
    result = run_cli(project, "resume=last")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: resume=last found no valid checkpoint in {project / 'checkpoints' / configured().name}; "
        f"train without resume first, or pass resume=auto to start fresh when there is none"
    )


def test_sigterm_saves_the_current_step_and_resume_last_continues_from_it(project):
    home, client = project / "checkpoints" / configured().name, MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    process = start(project, "trainer.max_steps=100000", "checkpoint.every_n_steps=50")
    wait_for_a_save(home, process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    saved = newest_valid(home)[1]
    assert f"stopped at step {saved['step']} by SIGTERM" in stdout + stderr
    assert client.get_run(saved["tracker"]["run_id"]).info.status == "KILLED"

    resumed = run_cli(project, f"trainer.max_steps={saved['step'] + 20}", "checkpoint.every_n_steps=50", "resume=last")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {saved['step']} on cpu: loss at save" in resumed.stdout + resumed.stderr
    assert "(ok)" in resumed.stdout + resumed.stderr
    assert client.get_run(saved["tracker"]["run_id"]).info.status == "FINISHED"


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGUSR2], ids=lambda number: number.name)
def test_a_signal_to_every_process_of_a_run_as_slurm_sends_it_stops_at_a_step_with_a_save_and_every_metric_logged(
    project, save_gate, number
):
    """SLURM signals every process of a job: here the run, its data-loader workers and its MLflow
    sender. The workers and the sender carry on; the run stops at a step boundary and saves."""
    home, client = project / "checkpoints" / configured().name, MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    gate = save_gate()  # held at its first save, with its workers and sender running
    settings = [
        "trainer.max_steps=100000",
        "checkpoint.every_n_steps=50",
        "trainer.log_every_n_steps=1",
        "data.num_workers=2",
    ]
    process = start(project, *settings, env=gate.env, cold=True)  # its sender among its children
    gate.wait(process)
    # Training goes on to its next save, which waits for this one: the workers of an epoch that
    # ends meanwhile are gone until the next epoch's start, so they are waited for, not counted once.
    while len(family := descendants(process.pid)) < 3:  # the run's sender and two data-loader workers
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)
    os.kill(process.pid, number)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):  # a short-lived helper of the run, already gone
            os.kill(pid, number)
    gate.release()
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + number, stderr
    saved = newest_valid(home)[1]
    assert f"stopped at step {saved['step']} by {number.name}" in stdout + stderr
    assert "died" not in stdout + stderr and "exited unexpectedly" not in stdout + stderr
    run_id = saved["tracker"]["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    assert sorted(losses(client, run_id)) == list(range(1, saved["step"] + 1)), "every step's loss reached MLflow"


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, theirs, and so on."""
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [found for child in map(int, children) for found in (child, *descendants(child))]


def test_kill_9_at_random_moments_always_resumes_and_reproduces_the_unbroken_run(project):
    """Saves every 3 steps, so some kills land mid-save; every resume must find a valid checkpoint
    and every loss logged after it must equal the unbroken run's."""
    settings = [
        "trainer.max_steps=600",
        "checkpoint.every_n_steps=3",
        "checkpoint.keep_last=2",
        "trainer.log_every_n_steps=1",
    ]
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    reference = run_cli(project, *settings, "name=reference")
    assert reference.returncode == 0, reference.stderr
    (reference_run,) = runs_named(client, "reference")
    expected = {step: values[-1] for step, values in losses(client, reference_run.info.run_id).items()}

    home, rng = project / "checkpoints" / configured().name, random.Random(0)
    for attempt in range(3):
        process = start(project, *settings, *(["resume=last"] if attempt else []))
        wait_for_a_save(home, process)
        time.sleep(rng.uniform(0.0, 0.5))
        process.send_signal(signal.SIGKILL)
        process.communicate(timeout=60)
    final = run_cli(project, *settings, "resume=last")
    assert final.returncode == 0, final.stderr
    assert "resumed at step" in final.stdout + final.stderr and "(ok)" in final.stdout + final.stderr

    run_id = newest_valid(home)[1]["tracker"]["run_id"]
    logged = losses(client, run_id)
    assert max(logged) == 600
    mismatched = {step: values for step, values in logged.items() if any(value != expected[step] for value in values)}
    assert mismatched == {}


def test_a_diverging_run_exits_non_zero_and_keeps_the_good_checkpoints(project):
    home = project / "checkpoints" / configured().name
    first = run_cli(project, "trainer.max_steps=150", "checkpoint.every_n_steps=50", "mlflow.enabled=false")
    assert first.returncode == 0, first.stderr
    good = {path.name: path.read_bytes() for path in home.glob("step_*.pt")}
    diverged = run_cli(
        project, "resume=last", "optimizer.lr=1e6", "trainer.max_steps=400", "checkpoint.every_n_steps=50",
        "mlflow.enabled=false",
    )  # fmt: skip
    assert diverged.returncode == 2
    (line,) = diverged.stderr.strip().splitlines()
    diverged = re.match(r"error: the loss is nan at step (\d+): the run stops unsaved; ", line)
    assert diverged and int(diverged[1]) > 150, line  # the first after the resume, however fast it comes
    assert f"the newest checkpoint on disk is {home / 'step_00000150.pt'}" in line
    assert {path.name: path.read_bytes() for path in home.glob("step_*.pt")} == good


def test_a_second_run_with_the_same_name_stops_at_once_and_the_first_keeps_its_checkpoints(project):
    home = project / "checkpoints" / "race"
    settings = ["name=race", "trainer.max_steps=100000", "checkpoint.every_n_steps=20", "mlflow.enabled=false"]
    first = start(project, *settings, "seed=1")
    wait_for_a_save(home, first)
    for resume in ([], ["resume=auto"]):
        second = run_cli(project, *settings, "seed=2", *resume)
        assert second.returncode == 2
        (line,) = second.stderr.strip().splitlines()
        assert line.startswith(f"error: {home} is in use by PID {first.pid} on ")
        assert line.endswith("wait for that run to end (or stop it), or train separately with name=<another name>")
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    assert {load(path).state["config"]["seed"] for path in home.glob("step_*.pt")} == {1}


@pytest.mark.parametrize(
    "override, message",
    [
        ("+optimzer=sgd", "error: optimzer is not a setting (did you mean optimizer?)"),
        ("name=../../../../tmp/escaped", "error: name='../../../../tmp/escaped' must be a plain name"),
        (
            "+model.hiden_sizes=[8]",
            "error: model.hiden_sizes is not a setting of {{cookiecutter.package}}.models.MLP (did you mean model.hidden_sizes?)",
        ),
        ("model.dropout=abc", "error: model.dropout='abc' is not a number"),
        ("checkpoint.dir=run.py", "error: cannot write checkpoints to run.py (it is a file, not a folder)"),
        ("optimizer.lr=-1", "error: optimizer (torch.optim.AdamW): Invalid learning rate: -1"),
        (
            "data.val_fraction=0",
            "error: data ({{cookiecutter.package}}.datasets.digits): val_fraction=0 must be above 0 and below 1",
        ),
        ("device.index=7", "error: device.index=7 means nothing on device=cpu"),
        ("seed=-1", "error: seed=-1 must be between 0 and 2147483647 (each process draws from seed + its rank)"),
        (f"name={'n' * 300}", "error: cannot write checkpoints to "),
        ("mlflow.tracking_uri=foo://bar", "error: mlflow.tracking_uri=foo://bar: MLflow "),
        ("mlflow.tracking_uri=file:///tmp/mlruns", "error: mlflow.tracking_uri=file:///tmp/mlruns is a file store"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_training(bare_project, override, message):
    project = bare_project  # a refused run makes no store
    result = run_cli(project, "device=cpu", override)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(message)
    # A component's constructor refuses its value once the checkpoint home is held: the claim undoes itself.
    assert not (project / "checkpoints").exists() and not (project / "mlflow.db").exists()


def user_namespaces_work() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--mount", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


def on_a_small_disk(project, disk, script: str) -> subprocess.CompletedProcess:
    """Runs `script` where `$DISK` is a small tmpfs of its own (a mount namespace needs no root),
    so a full disk fails writes with the kernel's own ENOSPC."""
    disk.mkdir()
    env = {**os.environ, "DISK": str(disk), "PYTHON": sys.executable}
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        cwd=project, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


small_disk = pytest.mark.skipif(not user_namespaces_work(), reason="needs unprivileged user and mount namespaces")


FILL_THE_DISK_MID_RUN = """
set -u
mount -t tmpfs -o size=8m tmpfs "$DISK"
"$PYTHON" run.py checkpoint.dir="$DISK/demo" trainer.max_steps=100000 checkpoint.every_n_steps=20 \\
    mlflow.enabled=false >trainer.out 2>trainer.err &
trainer=$!
# Each wait is for what the trainer does (or for its end), never for a time.
while [ ! -e "$DISK/demo/step_00000020.pt" ] && kill -0 $trainer 2>/dev/null; do sleep 0.02; done
dd if=/dev/zero of="$DISK/filler" bs=64k 2>/dev/null
until grep -q "No space left on device" trainer.out trainer.err || ! kill -0 $trainer 2>/dev/null; do sleep 0.02; done
kill -TERM $trainer
wait $trainer
status=$?
cat trainer.out
cat trainer.err >&2
echo "exit $status"
ls "$DISK/demo"
"""


@small_disk
def test_a_disk_that_fills_up_mid_run_keeps_training_then_fails_naming_the_newest_checkpoint(project, tmp_path):
    """A real tmpfs, filled up by another writer after the first save."""
    disk = tmp_path / "disk"
    result = on_a_small_disk(project, disk, FILL_THE_DISK_MID_RUN)
    assert "exit 2" in result.stdout, result.stderr
    on_disk = result.stdout.split("exit 2", 1)[1].split()
    output = (result.stdout + result.stderr).splitlines()  # Hydra logs to stdout, errors go to stderr
    failures = [line for line in output if "No space left on device" in line and "goodput.json" not in line]
    assert len(failures) == 2, output  # one warning for the outage, one error at the end
    # The run's account of its time (goodput.py), tried again at each beat, is said once.
    assert len([line for line in output if "goodput.json could not be written" in line]) <= 1, output
    assert failures[0].startswith(f"could not write {disk / 'demo'}/step_")
    assert "training goes on and tries again at the next save" in failures[0]
    newest = max(name for name in on_disk if name.startswith("step_"))
    assert failures[1].startswith(f"error: could not write {disk / 'demo'}/step_")
    assert f"the newest checkpoint on disk is {disk / 'demo' / newest}; free space" in failures[1]
    assert not [name for name in on_disk if name.endswith(".tmp")]


def test_kill_9_of_a_run_with_data_workers_leaves_no_lock_for_the_resume_right_after(project):
    """Whether or not forked data-loader workers outlive a killed run, the lock must not."""
    home = project / "checkpoints" / configured().name
    settings = ["trainer.max_steps=100000", "checkpoint.every_n_steps=20", "data.num_workers=2", "mlflow.enabled=false"]
    process = start(project, *settings)
    wait_for_a_save(home, process)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    resumed = run_cli(project, *settings[1:], "trainer.max_steps=40", "resume=last")
    assert resumed.returncode == 0, resumed.stderr
    assert "finished at step" in resumed.stdout + resumed.stderr


FULL_DISK_AT_START = """
mount -t tmpfs -o size=1m tmpfs "$DISK"
dd if=/dev/zero of="$DISK/filler" bs=64k 2>/dev/null
"$PYTHON" run.py checkpoint.dir="$DISK/demo" mlflow.enabled=false
echo "exit $?"
"""


@small_disk
def test_a_full_disk_is_found_before_training_in_one_line(project, tmp_path):
    disk = tmp_path / "disk"
    result = on_a_small_disk(project, disk, FULL_DISK_AT_START)
    assert "exit 2" in result.stdout, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: cannot write checkpoints to {disk / 'demo'} (No space left on device); free space or fix its "
        f"permissions, or choose another folder with checkpoint.dir=<path>"
    ]
    assert "finished at step" not in result.stdout
