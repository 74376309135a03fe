"""Recovery without a person, on a real SLURM cluster (tests/slurm_cluster.py): a sweep job that
is requeued, preempted (with and without grace time) or reaches its time limit saves at the end of
its step, runs again by itself, resumes where it stopped and finishes in the same MLflow run, with
every step's loss logged once. The SLURM line of docs/slurm.md, as written (no resume=auto), plus what
fits this one-node cluster. `pytest -m slurm` runs them (as root; Debian's packages)."""

import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import configured, goodput_of, losses, runs_named, start
from mlflow import MlflowClient
from slurm_cluster import Cluster, unavailable

pytestmark = pytest.mark.slurm

STEPS = ["trainer.max_steps=60", "checkpoint.every_n_steps=20", "trainer.log_every_n_steps=1"]
# The cluster's one node has no GPU and a few cores: one core and a little memory a job.
FITS = ["hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1"]


def readme_sweep(partition: str, *more: str) -> list[str]:
    """The SLURM line of docs/slurm.md, one job of it, on `partition`."""
    return ["-m", "hydra/launcher=slurm", f"hydra.launcher.partition={partition}", "device=cpu", "optimizer=adamw",
            *FITS, *STEPS, *more]  # fmt: skip


@pytest.fixture(scope="module")
def slurm():
    if (why := unavailable()) is not None:
        pytest.skip(f"no SLURM cluster here: {why}")
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def job_logs(project: Path) -> str:
    """What the sweep's SLURM jobs printed, every attempt of each (submitit's log files)."""
    return "".join(path.read_text() for path in sorted(project.glob("multirun/*/*/.submitit/*/*_log.*")))


def wait_for_log(project: Path, text: str, sweep: subprocess.Popen) -> None:
    """Returns once a job has printed `text` (or fails, with the logs, if the sweep ends first)."""
    while text not in job_logs(project):
        assert sweep.poll() is None, (sweep.communicate(), job_logs(project))
        time.sleep(0.1)


def slurm_job(pid: int) -> str:
    """The SLURM job the process `pid` belongs to (`<array job>_<task>` in a sweep of several)."""
    variables = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    if "SLURM_ARRAY_TASK_ID" in variables:
        return f"{variables['SLURM_ARRAY_JOB_ID']}_{variables['SLURM_ARRAY_TASK_ID']}"
    return variables["SLURM_JOB_ID"]


def check_came_back(project: Path, slurm: Cluster, job: str, sweep: subprocess.Popen) -> None:
    """The sweep finished after its job ran a second time by itself, resumed where it stopped with
    continuity checked, and filled one MLflow run with every step's loss, once."""
    stdout, stderr = sweep.communicate(timeout=600)
    logs = job_logs(project)
    assert sweep.returncode == 0, (stdout, stderr, logs)
    assert re.search(r"Restarts=1\b", slurm.run("scontrol", "show", "job", job).stdout)
    resumed = re.search(r"resumed at step (\d+) .*\(ok\)", logs)
    assert resumed and int(resumed[1]) >= 20, logs
    assert "| FINISHED " in stdout + stderr and "| ok " in stdout + stderr  # the summary: status, continuity
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = runs_named(client, configured().name, "tags.resumes = '1'")
    (run,) = [run for run in runs if "mlflow.parentRunId" in run.data.tags]
    assert run.info.status == "FINISHED"
    assert goodput_of(run)["legs"] == 2  # the goodput of both legs, whatever came between them
    assert {step: len(values) for step, values in losses(client, run.info.run_id).items()} == {
        step: 1 for step in range(1, 61)
    }
    assert len(list(project.glob("multirun/*/*/0/.hydra"))) == 1, "the job's output folder stayed put"


def test_a_job_requeued_with_scontrol_resumes_by_itself(slurm, project, save_gate):
    gate = save_gate()  # the job waits at its first save: requeued mid-run, however slow this machine
    # The gate's PYTHONPATH (its folder first) over the one the cluster's environment copied.
    sweep = start(project, *readme_sweep("low"), env={**slurm.env, **gate.env})
    job = slurm_job(gate.wait(sweep))
    slurm.run("scontrol", "requeue", job)
    wait_for_log(project, "SIGTERM received", sweep)
    gate.release()
    check_came_back(project, slurm, job, sweep)


@pytest.mark.parametrize(
    ("partition", "launch"),
    [("low", []), ("grace", []), ("grace", ["hydra.launcher.tasks_per_node=2", "strategy=ddp"])],
    ids=["no grace time", "grace time", "ddp of two tasks"],
)
def test_a_preempted_job_saves_requeues_and_resumes_by_itself(slurm, project, save_gate, partition, launch):
    """`low` has no grace time (SLURM requeues the job as it signals it); in `grace` the job has
    60 s, and one that ended on its own inside them would be recorded FAILED, never to run again.
    The ddp job's two tasks each get the signal and must stop at the same step."""
    gate = save_gate()
    sweep = start(project, *readme_sweep(partition, *launch), env={**slurm.env, **gate.env})
    job = slurm_job(gate.wait(sweep))
    slurm.run(
        "sbatch", "-p", "high", f"--cpus-per-task={slurm.cpus}", "--output=/dev/null", "--wrap", "true"
    )  # needs every core
    wait_for_log(project, "SIGTERM received", sweep)
    gate.release()
    check_came_back(project, slurm, job, sweep)


def test_a_job_at_its_time_limit_saves_requeues_and_resumes_by_itself(slurm, project, save_gate):
    """submitit asks SLURM for SIGUSR2 `signal_delay_s` before the limit (here 2 minutes, a signal
    30 s before it); without the run's own handler, submitit's would requeue mid-step, unsaved.
    SLURM sends the warning from a periodic check, up to a minute before the time asked for: under a
    1-minute limit it came as the job came back, before any handler was set, and killed it."""
    gate = save_gate()
    limits = ["hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=30"]
    sweep = start(project, *readme_sweep("low", *limits), env={**slurm.env, **gate.env})
    job = slurm_job(gate.wait(sweep))
    wait_for_log(project, "SIGUSR2 received", sweep)
    gate.release()
    check_came_back(project, slurm, job, sweep)


def test_a_job_a_person_cancels_saves_stays_down_and_the_sweep_says_so_without_a_traceback(slurm, project, save_gate):
    gate = save_gate()
    sweep = start(project, *readme_sweep("low"), env={**slurm.env, **gate.env})
    job = slurm_job(gate.wait(sweep))
    slurm.run("scancel", job)
    wait_for_log(project, "SIGTERM received", sweep)
    gate.release()
    stdout, stderr = sweep.communicate(timeout=600)
    assert sweep.returncode == 1, (stdout, stderr)
    assert "| KILLED " in stdout + stderr and "1 of 1 jobs failed" in stdout + stderr
    assert "Traceback" not in stdout + stderr
    assert re.search(r"Restarts=0\b", slurm.run("scontrol", "show", "job", job).stdout), "not requeued"
    assert f"continue with name={configured().name} resume=last" in job_logs(project)
