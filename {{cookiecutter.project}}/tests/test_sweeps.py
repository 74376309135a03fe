"""Multirun sweeps: a parent MLflow run with a child per job named by its overrides, a summary that
names the best job, jobs that fail alone, and sweeps that resume job by job."""

import json
import re
import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import PROJECT, configured, copy_project, run_cli, start
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from mlflow import MlflowClient
from omegaconf import OmegaConf
from test_compare import rows

from {{cookiecutter.package}}.engine.compare import compare
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.provenance import run_name, titled
from {{cookiecutter.package}}.engine.sweeps import RESULT_FILE, Job, dropped, figure, named, summary_table, sweep_key

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
    said = f"\n\nbest by val/loss (min): {best.info.run_name}, {figure(best.data.metrics['val/loss'])}"
    assert table.endswith(said)
    assert "sweep summary" in result.stdout + result.stderr and said in result.stdout + result.stderr
    return children


@pytest.mark.parametrize("metric", ["val/loss", "val/accuracy"])
def test_a_job_trains_in_its_own_home_and_child_run_and_returns_its_optimized_metric(make_cfg, tmp_path, metric):
    given = []
    result = {"val/loss": 0.5, "val/accuracy": 0.9}
    value = Job("optimizer=sgd", "optimizer=sgd", "parent-run", tmp_path).run(
        lambda cfg: given.append(cfg) or result, make_cfg(f"optimized_metric={metric}")
    )
    assert value == result[metric]
    (cfg,) = given
    assert cfg.checkpoint.dir.endswith("/checkpoints/optimizer=sgd")
    assert (cfg.mlflow.run_name, cfg.mlflow.parent_run_id) == ("optimizer=sgd", "parent-run")
    assert (tmp_path / RESULT_FILE).exists()


def test_a_job_over_a_path_keeps_its_checkpoints_by_the_whole_path_and_is_named_by_its_last_part(make_cfg, tmp_path):
    overrides = ["data.dir=/srv/corpora/mytexts", "experiment=classify_text", "trainer.max_steps=5"]
    continuing = frozenset({"trainer.max_steps"})
    job = Job(named(overrides, continuing), titled(overrides, continuing), None, tmp_path)
    assert (job.key, job.title) == (
        "data.dir=_srv_corpora_mytexts,experiment=classify_text", "data.dir=mytexts,experiment=classify_text"
    )  # fmt: skip
    given = []
    job.run(lambda cfg: given.append(cfg) or {}, make_cfg())
    job.run(lambda cfg: given.append(cfg) or {}, make_cfg("mlflow.run_name=/srv/corpora run"))
    assert [cfg.mlflow.run_name for cfg in given] == ["data.dir=mytexts,experiment=classify_text", "/srv/corpora run"]
    assert given[0].checkpoint.dir.endswith("/checkpoints/data.dir=_srv_corpora_mytexts,experiment=classify_text")


def test_a_single_run_is_named_by_its_overrides_a_path_by_its_last_part(monkeypatch):
    typed = ["data=text_folder", "data.dir=/srv/corpora/mytexts/", "device=cpu", "optimizer.lr=0.01"]
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=["name=cls", *typed], return_hydra_config=True)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", cfg)  # as run.py's Hydra sets it
    assert run_name(cfg) == "cls data.dir=mytexts,data=text_folder,optimizer.lr=0.01"


@pytest.fixture(scope="module")
def swept(tmp_path_factory, blank_store):
    """The 2x2 sweep in one process, run once for this module: checked by the test below, and the
    reference that an interrupted sweep must reproduce. Its project folder is its own (as the
    `project` fixture's), so no other test's runs mix with it."""
    project = copy_project(tmp_path_factory.mktemp("swept"), blank_store)
    return project, run_cli(project, *SWEEP, timeout=600)


def test_a_2x2_sweep_in_one_process_makes_four_children_under_one_parent(swept):
    check_sweep(*swept)


def test_two_jobs_compared_by_their_run_ids_are_labelled_by_their_overrides_and_judged(swept, make_cfg):
    project, _ = swept
    client, _, children = sweep_runs(project)
    jobs = [children[job] for job in JOBS[:2]]  # adamw and sgd, at lr 0.001
    cfg = make_cfg(f"mlflow.tracking_uri=sqlite:///{project / 'mlflow.db'}")

    shown = compare(cfg, *(job.info.run_id for job in jobs))

    assert rows(shown)["setting"] == rows(shown)["val/loss (min)"] == tuple(JOBS[:2])
    assert rows(shown)["optimizer"] == ("AdamW", "SGD")
    histories = [client.get_metric_history(job.info.run_id, "val/loss") for job in jobs]
    bests = [min(history, key=lambda metric: metric.value) for history in histories]
    assert rows(shown)["best"] == tuple(f"{figure(best.value)} at step {best.step}" for best in bests)
    better = min(zip(JOBS[:2], bests, strict=True), key=lambda job: job[1].value)
    assert f"\nbetter by best val/loss (min): {better[0]}, {figure(better[1].value)} at step {better[1].step} " in shown


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
    # The job the stop cut short resumes; the one that had finished has nothing to train, so its run stays as it was.
    assert resumed == [started[LAUNCHED[1]].info.run_id]
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
    assert sorted(path.name for path in (project / "checkpoints" / configured().name).iterdir()) == sorted(children)
    table = Path(client.download_artifacts(parent.info.run_id, "summary.md", str(project))).read_text()
    for name, child in children.items():
        assert [metric.step for metric in client.get_metric_history(child.info.run_id, "train/loss")] == list(
            range(1, 51)
        )
        assert child.data.tags["resumes"] == "1" and child.data.tags["resume.1.trainer.max_steps"] == "50"
        assert f"| {name} | FINISHED | {figure(child.data.metrics['train/loss'])} " in table  # the summary at step 50


def test_a_grid_grown_with_resume_auto_continues_its_sweep_run_and_one_dropping_values_or_keys_is_a_new_one(project):
    sweep, lrs = ["-m", "trainer.max_steps=20", "trainer.log_every_n_steps=1"], ["0.001", "0.003", "0.01"]
    first = run_cli(project, *sweep, "optimizer.lr=1e-3,3e-3", timeout=600)
    assert first.returncode == 0, first.stderr
    _, first_parent, started = sweep_runs(project)
    homes = {job: project / "checkpoints" / configured().name / job for job in started}
    saved = {job: sorted((path.name, path.read_bytes()) for path in home.glob("step_*")) for job, home in homes.items()}

    grown = run_cli(project, *sweep, "optimizer.lr=1e-3,3e-3,1e-2", "resume=auto", timeout=600)
    assert grown.returncode == 0, grown.stderr
    client, parent, children = sweep_runs(project)  # one sweep run, not a second one beside an empty first
    assert parent.info.run_id == first_parent.info.run_id and parent.info.status == "FINISHED"
    said = f"continuing the sweep's MLflow run {parent.info.run_id} ({parent.info.run_name}), its grid grown by "
    assert said + "optimizer.lr=0.01" in grown.stdout + grown.stderr
    assert sorted(children) == [f"optimizer.lr={lr}" for lr in lrs]
    assert json.loads(parent.data.tags["sweep.grid"]) == {"optimizer.lr": lrs}
    for job, run in started.items():  # finished at max_steps: continued, with nothing to train
        assert children[job].info.run_id == run.info.run_id and "resumes" not in children[job].data.tags
        logged = client.get_metric_history(run.info.run_id, "train/loss")
        assert [metric.step for metric in logged] == list(range(1, 21))  # each step once: not trained again
        assert sorted((path.name, path.read_bytes()) for path in homes[job].glob("step_*")) == saved[job]
    table = Path(client.download_artifacts(parent.info.run_id, "summary.md", str(project))).read_text()
    assert all(re.search(rf"^\| optimizer.lr={lr} +\| FINISHED ", table, re.MULTILINE) for lr in lrs), table
    best = min(children.values(), key=lambda child: child.data.metrics["val/loss"])
    assert parent.data.metrics["best/val/loss"] == best.data.metrics["val/loss"]
    assert (parent.data.tags["best.job"], parent.data.tags["best.run_id"]) == (best.info.run_name, best.info.run_id)
    assert table.endswith(f"best by val/loss (min): {best.info.run_name}, {figure(best.data.metrics['val/loss'])}")

    shrunk = run_cli(project, *sweep, "optimizer.lr=1e-3,3e-3", "resume=auto", timeout=600)
    assert shrunk.returncode == 0, shrunk.stderr
    assert (
        f"resume=auto: this line drops optimizer.lr=0.01 of the sweep MLflow run {parent.info.run_id} "
        f"({parent.info.run_name}) swept: a new sweep run holds its jobs; add them back to continue that one"
    ) in (shrunk.stdout + shrunk.stderr).splitlines()
    alone = run_cli(project, *sweep, "optimizer.lr=1e-3", "resume=auto", timeout=600)  # sweeps lr no more
    assert alone.returncode == 0, alone.stderr
    assert (
        f"resume=auto: no sweep in MLflow has this line's settings (name={configured().name} optimizer.lr=1e-3): a new "
        "sweep run holds its jobs"
    ) in (alone.stdout + alone.stderr).splitlines()
    runs = client.search_runs([parent.info.experiment_id], "tags.`sweep.key` != ''")
    assert len(runs) == 3 and client.get_run(parent.info.run_id).data.tags == parent.data.tags  # the first untouched


@pytest.mark.daily
def test_a_sweep_is_named_by_the_keys_of_its_grid_and_its_other_settings_and_a_grid_extends_another_by_values():
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        continuing = list(compose("config", return_hydra_config=True).hydra.job.config.override_dirname.exclude_keys)

    def key_of(*overrides: str, name: str = "demo") -> tuple[str, dict[str, list[str]]]:
        """The key and grid of `python run.py -m <overrides>`, as the sweep's callback reads its config."""
        job = {"config": {"override_dirname": {"exclude_keys": continuing}}}
        hydra = {"overrides": {"task": list(overrides), "hydra": []}, "job": job}
        return sweep_key(OmegaConf.create({"name": name, "hydra": hydra}))

    key, grid = key_of("optimizer.lr=1e-3,3e-3", "optimizer=sgd", "trainer.max_steps=30")
    assert (key, grid) == ("name=demo optimizer.lr=<grid> optimizer=sgd", {"optimizer.lr": ["0.001", "0.003"]})
    grown_key, grown = key_of("trainer.max_steps=60", "optimizer=sgd", "optimizer.lr=choice(1e-2,3e-3,1e-3)")
    assert grown_key == key and dropped(grid, grown) == [] and dropped(grown, grid) == ["optimizer.lr=0.01"]
    assert key_of("optimizer.lr=1e-3", "optimizer=sgd")[0] != key  # one value: no grid, another sweep
    assert key_of("optimizer.lr=1e-3,3e-3", "optimizer=adamw")[0] != key
    assert key_of("optimizer.lr=1e-3,3e-3", "optimizer=sgd", "seed=range(0,2)")[0] != key
    assert key_of("optimizer.lr=1e-3,3e-3", "optimizer=sgd", name="other")[0] != key


def test_a_job_is_named_by_what_it_trains_unless_the_sweep_sweeps_a_setting_that_continues_it():
    continuing = frozenset({"trainer.max_steps", "resume"})
    overrides = ["trainer.max_steps=50", "optimizer=sgd", "resume=auto", "model/head=linear"]
    assert named(overrides, continuing) == "model_head=linear,optimizer=sgd"
    # `-m trainer.max_steps=100,200` compares lengths: its jobs are two, named by it.
    swept = continuing - {"trainer.max_steps"}
    assert named(overrides, swept) == "model_head=linear,optimizer=sgd,trainer.max_steps=50"


def test_a_job_continued_from_a_folder_named_before_max_steps_left_its_name_continues_there(tmp_path):
    continuing = frozenset({"trainer.max_steps", "checkpoint.every_n_steps"})
    job = Job("optimizer.lr=0.001", "optimizer.lr=0.001", None, tmp_path, continuing)
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


def test_a_sweep_over_a_folder_names_its_job_by_the_folders_last_part_and_keys_its_checkpoints_by_the_path(
    project, tmp_path
):
    texts = tmp_path / "corpora" / "mytexts"
    texts.mkdir(parents=True)
    lines = 2 * configured("data=text_folder").data.batch_size  # a full batch, whatever the configs' split
    for label in ("no", "yes"):
        (texts / f"{label}.txt").write_text("".join(f"{label}, line {number}\n" for number in range(lines)))
    typed = ["data=text_folder", f"data.dir={texts}", "model=gpt", "trainer.max_steps=4"]
    result = run_cli(project, "-m", *typed, timeout=600)
    assert result.returncode == 0, result.stderr
    _, parent, children = sweep_runs(project)
    title = "data.dir=mytexts,data=text_folder,model=gpt"
    assert list(children) == [title]
    assert parent.data.tags["best.job"] == title and f"best by val/loss (min): {title}, " in result.stdout
    assert str(tmp_path) not in children[title].info.run_name
    key = f"data.dir={str(texts).replace('/', '_')},data=text_folder,model=gpt"  # another mytexts/ trains apart
    assert [folder.name for folder in (project / "checkpoints" / configured().name).iterdir()] == [key]


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
    header, _, mlp, lm = (line.split("|")[1:-1] for line in summary_table(rows, "val/loss", "min").splitlines()[:4])
    cells = [{name.strip(): cell.strip() for name, cell in zip(header, row, strict=True)} for row in (mlp, lm)]
    assert [name.strip() for name in header] == [
        "job", "status", "train/loss", "val/loss", "train/mean_samples_per_s", "train/mean_tokens_per_s", "continuity", "run_id",
        "error",
    ]  # fmt: skip
    assert (cells[0]["train/mean_samples_per_s"], cells[0]["train/mean_tokens_per_s"]) == ("5230", "")
    assert (cells[1]["train/mean_samples_per_s"], cells[1]["train/mean_tokens_per_s"]) == ("", "14157")


def test_the_summary_writes_every_number_one_way_and_names_the_best_job_under_its_table():
    results = [
        {"job": "optimizer=adamw", "status": "FINISHED", "val/loss": 0.20461, "train/mean_samples_per_s": 2038.0},
        {"job": "optimizer=sgd", "status": "FINISHED", "val/loss": 0.1873, "train/mean_samples_per_s": 559.245},
        {"job": "optimizer=rmsprop", "status": "FAILED", "error": "RunError: ..."},
    ]
    lines = summary_table(results, "val/loss", "min").splitlines()
    header, _, adamw, sgd, _ = (line.split("|")[1:-1] for line in lines[:5])
    cells = [{name.strip(): cell.strip() for name, cell in zip(header, row, strict=True)} for row in (adamw, sgd)]
    written = [(row["val/loss"], row["train/mean_samples_per_s"]) for row in cells]
    assert written == [("0.2046", "2038"), ("0.1873", "559.2")]
    assert lines[5:] == ["", "best by val/loss (min): optimizer=sgd, 0.1873"]
    assert summary_table(results, "val/loss", "max").endswith("\nbest by val/loss (max): optimizer=adamw, 0.2046")
    assert summary_table(results[2:], "val/loss", "min").endswith(
        "\nbest by val/loss (min): none: no job reported a finite val/loss"
    )


@pytest.mark.parametrize(
    ("value", "written"),
    [(2038.0, "2038"), (559.245, "559.2"), (14157.4, "14157"), (0.20461, "0.2046"), (0.5, "0.5"),
     (0.000123456, "0.0001235"), (999.97, "1000"), (-3.25, "-3.25"), (float("nan"), "nan")],
)  # fmt: skip
def test_a_number_is_written_with_four_significant_digits_whole_from_1000_and_never_with_separators(value, written):
    assert figure(value) == written
