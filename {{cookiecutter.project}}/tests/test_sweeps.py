"""Multirun sweeps: a parent MLflow run with a child per job, a summary, jobs that fail alone,
and sweeps that resume job by job."""

import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import copy_project, run_cli, start
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.sweeps import RESULT_FILE, Job, named, summary_table

pytestmark = pytest.mark.slow

COMMON = ["trainer.max_steps=200", "checkpoint.every_n_steps=20"]
SWEEP = ["-m", "optimizer=adamw,sgd", "optimizer.lr=1e-3,3e-3", *COMMON]
# A job is named, and keeps its checkpoints, by its sorted overrides, less those that continue a job
# (trainer.max_steps, checkpoint.every_n_steps, ...); jobs are launched in this order.
LAUNCHED = [
    ",".join(sorted([f"optimizer.lr={lr}", f"optimizer={name}"]))
    for name in ("adamw", "sgd")
    for lr in ("0.001", "0.003")
]
JOBS = sorted(LAUNCHED)
OPTIMIZERS = {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}


def sweep_runs(project) -> tuple:
    """The project's one sweep parent run and its children, by job name."""
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    (parent,) = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    children = {run.info.run_name: run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    return client, parent, children


def check_sweep(project, result) -> dict:
    assert result.returncode == 0, result.stderr
    client, parent, children = sweep_runs(project)
    assert sorted(children) == JOBS
    assert parent.info.status == "FINISHED"
    for name, child in children.items():
        assert child.info.status == "FINISHED"
        overrides = dict(pair.split("=") for pair in name.split(","))
        assert child.data.tags["optimizer._target_"] == OPTIMIZERS[overrides["optimizer"]]
        assert child.data.params["optimizer"] == OPTIMIZERS[overrides["optimizer"]].rsplit(".", 1)[-1]
        assert float(child.data.params["optimizer.lr"]) == float(overrides["optimizer.lr"])
    best = min(children.values(), key=lambda child: child.data.metrics["val/loss"])
    assert parent.data.metrics["best/val/loss"] == best.data.metrics["val/loss"]
    assert (parent.data.tags["best.job"], parent.data.tags["best.run_id"]) == (best.info.run_name, best.info.run_id)
    table = Path(client.download_artifacts(parent.info.run_id, "summary.md", str(project))).read_text()
    assert all(job in table for job in JOBS) and "| FINISHED " in table
    assert "sweep summary" in result.stdout + result.stderr
    return children


@pytest.mark.parametrize("metric", ["val/loss", "val/accuracy"])
def test_a_job_trains_in_its_own_home_and_child_run_and_returns_its_optimized_metric(make_cfg, tmp_path, metric):
    given = []
    result = {"val/loss": 0.5, "val/accuracy": 0.9}
    value = Job("optimizer=sgd", "parent-run", tmp_path).run(
        lambda cfg: given.append(cfg) or result, make_cfg(f"optimized_metric={metric}")
    )
    assert value == result[metric]
    (cfg,) = given
    assert cfg.checkpoint.dir.endswith("/checkpoints/optimizer=sgd")
    assert (cfg.mlflow.run_name, cfg.mlflow.parent_run_id) == ("optimizer=sgd", "parent-run")
    assert (tmp_path / RESULT_FILE).exists()


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The 2x2 sweep in one process, run once for this module: checked by the test below, and the
    reference that an interrupted sweep must reproduce. Its project folder is its own (as the
    `project` fixture's), so no other test's runs mix with it."""
    project = copy_project(tmp_path_factory.mktemp("swept"))
    return project, run_cli(project, *SWEEP, timeout=600)


def test_a_2x2_sweep_in_one_process_makes_four_children_under_one_parent(swept):
    check_sweep(*swept)


def test_a_2x2_sweep_in_worker_processes_makes_four_children_under_one_parent(project):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="pip install -e '.[sweeps]'")
    result = run_cli(project, *SWEEP, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", timeout=600)
    check_sweep(project, result)
    # The console shows the project's own sentences: no "[2026-…][HYDRA]" prefixes, no joblib banner.
    assert "[HYDRA]" not in result.stdout + result.stderr and "Joblib.Parallel" not in result.stdout + result.stderr


def test_a_failing_job_fails_alone_and_the_sweep_says_which(project):
    result = run_cli(project, "-m", "trainer.grad_accum_steps=0,1", "trainer.max_steps=10", timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert "error: trainer.grad_accum_steps=0 must be at least 1" in output
    assert "1 of 2 jobs failed: trainer.grad_accum_steps=0" in output
    client, parent, children = sweep_runs(project)
    assert parent.info.status == "FAILED"
    # The job after the failure runs in a run of its own, under the same parent.
    assert list(children) == ["trainer.grad_accum_steps=1"]
    assert children["trainer.grad_accum_steps=1"].info.status == "FINISHED"
    best = min(children.values(), key=lambda child: child.data.metrics["val/loss"])
    assert parent.data.metrics["best/val/loss"] == best.data.metrics["val/loss"]
    assert (parent.data.tags["best.job"], parent.data.tags["best.run_id"]) == (best.info.run_name, best.info.run_id)
    table = Path(client.download_artifacts(parent.info.run_id, "summary.md", str(project))).read_text()
    assert "| trainer.grad_accum_steps=0 | FAILED " in table and "must be at least 1" in table


def test_an_interrupted_sweep_rerun_with_resume_auto_continues_each_job_to_the_same_losses(project, swept, save_gate):
    reference = check_sweep(*swept)

    # Held at the second job's first save (the first job done), so the SIGTERM lands in that job
    # however slow this machine is: the job cannot finish, nor the third start, before it.
    gate = save_gate(match=f"/{LAUNCHED[1]}/")
    process = start(project, *SWEEP, "name=interrupted", env=gate.env)
    gate.wait(process)
    process.send_signal(signal.SIGTERM)  # its handler runs before the job's next step
    gate.release()
    process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    _, interrupted_parent, started = sweep_runs(project)
    assert interrupted_parent.info.status == "KILLED"
    assert sorted(started) == sorted(LAUNCHED[:2])

    rerun = run_cli(project, *SWEEP, "name=interrupted", "resume=auto", timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    client, parent, children = sweep_runs(project)  # the sweep's run continued, not a second one
    assert parent.info.run_id == interrupted_parent.info.run_id and parent.info.status == "FINISHED"
    resumed = [run.info.run_id for run in children.values() if run.data.tags.get("resumes") == "1"]
    assert sorted(resumed) == sorted(run.info.run_id for run in started.values())
    assert sorted(children) == JOBS
    for job in JOBS:
        assert children[job].data.metrics["val/loss"] == reference[job].data.metrics["val/loss"], job
        assert children[job].data.metrics["train/loss"] == reference[job].data.metrics["train/loss"], job


def test_a_finished_sweep_run_again_with_more_steps_continues_each_job_in_its_own_run(project):
    sweep = ["-m", "optimizer.lr=1e-3,3e-3", "trainer.log_every_n_steps=1"]
    first = run_cli(project, *sweep, "trainer.max_steps=30", timeout=600)
    assert first.returncode == 0, first.stderr
    _, first_parent, _ = sweep_runs(project)

    more = run_cli(project, *sweep, "trainer.max_steps=50", "resume=auto", timeout=600)
    assert more.returncode == 0, more.stderr
    client, parent, children = sweep_runs(project)  # one parent, and two children, not four
    assert len(client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])) == 3
    assert parent.info.run_id == first_parent.info.run_id and parent.info.status == "FINISHED"
    assert sorted(children) == ["optimizer.lr=0.001", "optimizer.lr=0.003"]
    assert sorted(path.name for path in (project / "checkpoints" / "demo").iterdir()) == sorted(children)
    table = Path(client.download_artifacts(parent.info.run_id, "summary.md", str(project))).read_text()
    for name, child in children.items():
        assert [metric.step for metric in client.get_metric_history(child.info.run_id, "train/loss")] == list(
            range(1, 51)
        )
        assert child.data.tags["resumes"] == "1" and child.data.tags["resume.1.trainer.max_steps"] == "50"
        assert f"| {name} | FINISHED | {child.data.metrics['train/loss']:.4f} " in table  # the summary at step 50


def test_a_job_is_named_by_what_it_trains_unless_the_sweep_sweeps_a_setting_that_continues_it():
    continuing = frozenset({"trainer.max_steps", "resume"})
    overrides = ["trainer.max_steps=50", "optimizer=sgd", "resume=auto", "model/head=linear"]
    assert named(overrides, continuing) == "model_head=linear,optimizer=sgd"
    # `-m trainer.max_steps=100,200` compares lengths: its jobs are two, named by it.
    swept = continuing - {"trainer.max_steps"}
    assert named(overrides, swept) == "model_head=linear,optimizer=sgd,trainer.max_steps=50"


def test_a_job_continued_from_a_folder_named_before_max_steps_left_its_name_continues_there(tmp_path):
    job = Job("optimizer.lr=0.001", None, tmp_path, frozenset({"trainer.max_steps", "checkpoint.every_n_steps"}))
    root = tmp_path / "checkpoints"
    old = root / "checkpoint.every_n_steps=10,optimizer.lr=0.001,trainer.max_steps=30"
    for folder in (old, root / "optimizer.lr=0.003,trainer.max_steps=30"):
        folder.mkdir(parents=True)
        (folder / "step_00000030.pt").touch()
    assert job._home(root, "auto") == old
    assert job._home(root, None) == root / "optimizer.lr=0.001"  # a fresh job starts in its own folder
    second = root / "optimizer.lr=0.001,trainer.max_steps=40"
    second.mkdir()
    (second / "step_00000040.pt").touch()
    with pytest.raises(RunError, match=r"are in 2 folders named the old way: .*; rename the one to continue to "):
        job._home(root, "auto")


PAUSE_BEFORE_SECOND_JOB = """
import threading
from pathlib import Path

from hydra.experimental.callback import Callback


class PauseBeforeSecondJob(Callback):
    def on_job_start(self, config, **kwargs):
        if config.hydra.job.num == 1:
            Path("between jobs").touch()
            threading.Event().wait()  # until the test's SIGTERM, whose handler ends the sweep
"""


def test_a_sweep_stopped_by_sigterm_between_jobs_ends_its_run_killed(project):
    (project / "pause_between_jobs.py").write_text(PAUSE_BEFORE_SECOND_JOB)
    process = start(
        project, "-m", "optimizer=adamw,sgd", "trainer.max_steps=10",
        "+hydra.callbacks.pause._target_=pause_between_jobs.PauseBeforeSecondJob",
    )  # fmt: skip
    while not (project / "between jobs").exists():
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "SIGTERM received between jobs: the sweep stops, its MLflow run ends KILLED" in stdout + stderr
    _, parent, children = sweep_runs(project)
    assert parent.info.status == "KILLED"
    assert {name: child.info.status for name, child in children.items()} == {"optimizer=adamw": "FINISHED"}


def test_a_sweep_with_a_tracking_uri_mlflow_cannot_open_stops_before_any_job_in_one_line(project):
    result = run_cli(project, "-m", "optimizer=adamw,sgd", "trainer.max_steps=10", "mlflow.tracking_uri=foo://bar")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: mlflow.tracking_uri=foo://bar: MLflow")
    assert "Traceback" not in result.stderr
    assert not (project / "checkpoints").exists()


def test_a_search_sweep_optimizes_the_chosen_metric(project):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[search]'")
    search = ["-m", "hydra/sweeper=search", "hydra.sweeper.n_trials=3", "trainer.max_steps=30"]
    maximize = ["optimized_metric=val/accuracy", "optimized_mode=max"]
    result = run_cli(project, *search, *maximize, timeout=600)
    assert result.returncode == 0, result.stderr
    _, parent, children = sweep_runs(project)
    assert parent.info.status == "FINISHED" and len(children) == 3
    (results,) = (project / "multirun").glob("*/*/optimization_results.yaml")
    best = max(child.data.metrics["val/accuracy"] for child in children.values())
    assert yaml.safe_load(results.read_text())["best_value"] == best
    # The sweep's run names the winner by the same metric and mode, not by val/loss.
    assert parent.data.metrics["best/val/accuracy"] == best and "best/val/loss" not in parent.data.metrics
    winner = children[parent.data.tags["best.job"]]
    assert winner.info.run_id == parent.data.tags["best.run_id"] and winner.data.metrics["val/accuracy"] == best


def test_a_search_direction_that_disagrees_with_optimized_mode_stops_the_sweep_in_one_line(project):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install -e '.[search]'")
    result = run_cli(project, "-m", "hydra/sweeper=search", "hydra.sweeper.direction=maximize", "trainer.max_steps=5")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: hydra.sweeper.direction=maximize disagrees with optimized_mode=min, which also names the winner and "
        "the best checkpoint; set optimized_mode alone"
    )
    assert not (project / "checkpoints").exists()


def test_a_named_experiment_sweeps_what_its_file_says(project):
    result = run_cli(project, "-m", "experiment=compare_optimizers", "trainer.max_steps=10", timeout=600)
    assert result.returncode == 0, result.stderr
    _, parent, children = sweep_runs(project)
    assert parent.info.status == "FINISHED"
    assert sorted(child.data.tags["optimizer._target_"] for child in children.values()) == sorted(OPTIMIZERS.values())


def test_the_summary_table_gives_each_job_its_throughput_in_its_tasks_unit():
    rows = [
        {
            "job": "model=mlp",
            "status": "FINISHED",
            "train/loss": 0.5,
            "val/loss": 0.25,
            "train/mean_samples_per_s": 5230.0,
        },
        {"job": "experiment=char_lm", "status": "FINISHED", "train/loss": 2.5, "train/mean_tokens_per_s": 14157.0},
    ]
    header, _, mlp, lm = (line.split("|")[1:-1] for line in summary_table(rows).splitlines())
    cells = [{name.strip(): cell.strip() for name, cell in zip(header, row, strict=True)} for row in (mlp, lm)]
    assert [name.strip() for name in header] == [
        "job", "status", "train/loss", "val/loss", "train/mean_samples_per_s", "train/mean_tokens_per_s", "continuity", "run_id",
        "error",
    ]  # fmt: skip
    assert (cells[0]["train/mean_samples_per_s"], cells[0]["train/mean_tokens_per_s"]) == ("5,230", "")
    assert (cells[1]["train/mean_samples_per_s"], cells[1]["train/mean_tokens_per_s"]) == ("", "14,157")
