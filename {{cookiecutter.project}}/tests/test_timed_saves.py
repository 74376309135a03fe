"""checkpoint.every_s: saves by the clock, beside those by step, so that what a kill -9 loses is bounded
in time however long a step takes."""

import signal
import time

import pytest
from conftest import PROJECT, run_cli, start
from hydra import compose, initialize_config_dir
from test_distributed import finished, torchrun

from {{cookiecutter.package}}.engine.checkpoint.home import steps

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

EVERY_S = 0.5
# What a kill may lose beyond the interval: the wait for the next logging step, and the write.
SLACK_S = 2.0
# A save's file is complete a little after the save starts; how much later varies from save to save
# (its fsync waits behind other writes to the disk), yet by far less than the interval.
WRITE_JITTER_S = 0.25
BY_STEP_NEVER = "checkpoint.every_n_steps=1000000"
QUIET = ["device=cpu", "device.cpu_threads=1", "mlflow.enabled=false"]


def saved_at(home) -> list[tuple[int, float]]:
    """(step, when its file was last written) of each checkpoint in `home`, by step."""
    return sorted((step, path.stat().st_mtime) for step, path in steps(home))


def test_a_kill_9_loses_at_most_every_s_and_resume_last_continues_from_the_newest(project):
    home = project / "checkpoints" / "timed"
    settings = ["name=timed", *QUIET, BY_STEP_NEVER, f"checkpoint.every_s={EVERY_S}", "checkpoint.keep_last=100"]
    settings += ["trainer.log_every_n_steps=5", "trainer.val_every_n_steps=1000000"]
    process = start(project, *settings, "trainer.max_steps=100000000")
    deadline = time.monotonic() + 180
    while len(steps(home)) < 3:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no 3 checkpoints by the clock within 180 s"
        time.sleep(0.01)
    killed = time.time()
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)

    saved = saved_at(home)
    assert all(step % 5 == 0 and step % 1000000 for step, _ in saved), saved  # at logging steps, not by step
    newest_step, newest_time = saved[-1]
    assert killed - newest_time <= EVERY_S + SLACK_S
    gaps = [later - earlier for (_, earlier), (_, later) in zip(saved, saved[1:], strict=False)]
    assert all(EVERY_S - WRITE_JITTER_S <= gap <= EVERY_S + SLACK_S for gap in gaps), gaps

    resumed = run_cli(project, *settings, f"trainer.max_steps={newest_step + 10}", "resume=last")
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, said
    assert f"resumed at step {newest_step} on cpu" in said and f"finished at step {newest_step + 10}" in said


@pytest.mark.parametrize("value", ["-5", "0"])
def test_an_every_s_that_is_not_positive_is_refused_in_one_line_before_anything_is_written(project, value):
    result = run_cli(project, "name=refused", *QUIET, f"checkpoint.every_s={value}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint.every_s={float(value)} must be positive (seconds between saves), "
        "or null to save by step only"
    ]
    assert not (project / "checkpoints").exists()


def test_an_every_s_that_is_not_a_number_is_refused_at_composition_naming_the_key(project):
    """Hydra's own message, as for every typed setting (docs/configuration.md)."""
    result = run_cli(project, "name=refused", *QUIET, "checkpoint.every_s=abc")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "Error merging override checkpoint.every_s=abc" in result.stderr
    assert "could not be converted to Float" in result.stderr
    assert not (project / "checkpoints").exists()


def test_ddp_ranks_agree_on_each_save_by_the_clock(project):
    """Each rank's clock starts at its own moment: saved on one rank's word alone, one rank would
    save (a collective) while the other trained on, until the process group timed out."""
    settings = ["name=ddp", BY_STEP_NEVER, "checkpoint.every_s=0.05", "checkpoint.keep_last=100"]
    output = finished(torchrun(project, *settings, "trainer.max_steps=60", "strategy.timeout_s=30"), timeout=180)
    assert "finished at step 60" in output
    by_clock = [step for step, _ in steps(project / "checkpoints" / "ddp") if step != 60]
    assert by_clock, output


def test_a_sweep_job_with_another_every_s_is_the_same_job():
    """How often a job saves continues it: rerun with another checkpoint.every_s, it keeps its name
    (its checkpoint folder and MLflow run) and resumes."""
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["checkpoint.every_s=60", "optimizer.lr=0.1"], return_hydra_config=True)
    assert cfg.hydra.job.override_dirname == "optimizer.lr=0.1"


def test_a_run_saves_by_the_clock_by_default_every_five_minutes():
    """A preempted machine's kill -9 loses at most about 300 s of training, whatever a step costs
    (docs/preemptible-machines.md: the arithmetic), unless the project says otherwise."""
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        cfg = compose("config")
    assert cfg.checkpoint.every_s == 300
