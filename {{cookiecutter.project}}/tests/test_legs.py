"""The legs of a run: what each one ran from, kept apart from the others'; a resume with nothing
left to train, which leaves the run as it was; and what a run leaves behind it: its MLflow run's
true start, no empty folder of files for MLflow, no lines about MLflow's own schema."""

import json
import logging
import time
from pathlib import Path

import pytest
from conftest import run_cli
from mlflow import MlflowClient
from test_early_stopping import PATIENT
from test_tracking import artifacts_of, git, provenance_of

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.tracking import mlflow_store  # noqa: F401 (it quiets MLflow in the processes that import it)
from {{cookiecutter.package}}.engine.tracking.tracker import Tracker
from {{cookiecutter.package}}.engine.tracking.unsent import STAGING

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

ORIGIN = ("template.version", "git.commit", "git.dirty")  # the tags, by how their names end


def baked(repo: Path, template_commit: str) -> None:
    """`.cruft.json` as the template writes it, and `cruft update` rewrites it."""
    (repo / ".cruft.json").write_text(json.dumps({"template": "gh:o/t", "commit": template_commit, "checkout": None}))


def test_each_leg_keeps_what_it_ran_from_and_the_first_legs_tags_stay_the_runs(make_cfg, client, tmp_path, monkeypatch):
    repo = tmp_path / "project"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "model.py").write_text("width = 1\n")
    baked(repo, "c0ffee")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "baked")
    first = git(repo, "rev-parse", "HEAD").strip()
    monkeypatch.chdir(repo)  # the folder a run starts in: the sender's too
    run_id = recipe.train(make_cfg("trainer.max_steps=10"))["run_id"]

    # Between the legs: a `cruft update` to a newer template, committed, and a change left uncommitted.
    baked(repo, "beef00")
    (repo / "model.py").write_text("width = 2\n")
    git(repo, "commit", "-q", "-am", "cruft update")
    second = git(repo, "rev-parse", "HEAD").strip()
    (repo / "model.py").write_text("width = 3\n")
    assert recipe.train(make_cfg("trainer.max_steps=20", "resume=last"))["run_id"] == run_id

    tags = client.get_run(run_id).data.tags
    assert {key: value for key, value in tags.items() if key.endswith(ORIGIN)} == {
        "template.version": "c0ffee",
        "mlflow.source.git.commit": first,
        "git.dirty": "false",
        "resume.1.template.version": "beef00",
        "resume.1.git.commit": second,
        "resume.1.git.dirty": "true",
    }
    files = provenance_of(client, run_id, tmp_path / "artifacts")
    assert sorted(files) == ["requirements.txt", "resume.1/git.diff", "resume.1/requirements.txt"]
    assert "-width = 2\n+width = 3\n" in files["resume.1/git.diff"]


def snapshot(client: MlflowClient, run_id: str) -> dict:
    """All that MLflow holds of a run: its status and times, params, tags, every metric's history,
    artifacts, dataset inputs and logged models."""
    run = client.get_run(run_id)
    models = client.search_logged_models(
        experiment_ids=[run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    return {
        "info": (run.info.status, run.info.start_time, run.info.end_time),
        "params": run.data.params,
        "tags": run.data.tags,
        "metrics": {
            key: [(metric.step, metric.value, metric.timestamp) for metric in client.get_metric_history(run_id, key)]
            for key in run.data.metrics
        },
        "artifacts": artifacts_of(client, run_id),
        "inputs": sorted(item.dataset.digest for item in run.inputs.dataset_inputs),
        "models": sorted((model.model_id, str(model.status)) for model in models),
    }


def checkpoint_files(home: Path) -> dict[str, tuple[bytes, int | None]]:
    """Each file of a checkpoint folder, the lock aside: its bytes and, for a checkpoint, when it was written."""
    return {
        path.name: (path.read_bytes(), path.stat().st_mtime_ns if path.name.startswith("step_") else None)
        for path in sorted(home.iterdir())
        if path.name != "run.lock"
    }


@pytest.mark.parametrize("log_models", ["none", "best"])
def test_a_resume_of_a_finished_run_says_so_and_leaves_the_run_and_its_checkpoints_as_they_were(
    project, make_cfg, client, checkpoint_dir, tracking_uri, log_models
):
    settings = ["trainer.max_steps=20", f"mlflow.log_models={log_models}"]
    run_id = recipe.train(make_cfg(*settings))["run_id"]
    before, on_disk = snapshot(client, run_id), checkpoint_files(checkpoint_dir)
    assert len(before["models"]) == (log_models == "best")

    where = [f"checkpoint.dir={checkpoint_dir}", f"mlflow.tracking_uri={tracking_uri}", "device=cpu"]
    again = run_cli(project, *settings, *where, "resume=last")
    assert again.returncode == 0, again.stderr
    said = (again.stdout + again.stderr).splitlines()
    finished = f"{make_cfg().name} finished at step 20 already: nothing to train; raise trainer.max_steps to continue"
    assert finished in said
    assert not any(line.startswith(("resumed at step", "finished at step")) for line in said), said
    assert snapshot(client, run_id) == before
    assert checkpoint_files(checkpoint_dir) == on_disk


def test_a_resume_of_a_run_stopped_early_says_so_and_returns_its_scores_logging_nothing(make_cfg, client, caplog):
    stopped = recipe.train(make_cfg(*PATIENT))
    before = snapshot(client, stopped["run_id"])
    with caplog.at_level(logging.INFO):
        again = recipe.train(make_cfg(*PATIENT, "resume=last"))
    assert (
        f"{make_cfg().name} stopped early at step 15 already: nothing to train; raise trainer.early_stopping.patience "
        "to continue" in caplog.messages
    )
    assert again["step"] == 15 and again["run_id"] == stopped["run_id"]
    assert again["val/loss"] == stopped["val/loss"], "the scores of the same weights, evaluated again"
    assert snapshot(client, stopped["run_id"]) == before


class Noting:
    """Logs a text file at each validation, through the folder of files for MLflow."""

    def on_validation_end(self, run, metrics):
        run.log_text(f"{metrics['val/loss']}", f"notes/step_{run.step}.txt")


def test_a_run_whose_files_were_all_delivered_leaves_no_folder_for_them(make_cfg, client, checkpoint_dir):
    result = recipe.train(make_cfg("trainer.max_steps=20", "+callbacks.noting._target_=test_legs.Noting"))
    assert artifacts_of(client, result["run_id"], "notes") == ["notes/step_10.txt", "notes/step_20.txt"]
    assert not (checkpoint_dir / STAGING).exists()


def test_the_folder_for_files_stays_while_it_holds_one_or_is_a_link(make_cfg, tmp_path):
    untracked = make_cfg("mlflow.enabled=false").mlflow
    waiting = tmp_path / "waiting" / STAGING / "notes.txt.d" / "notes.txt"  # kept for replay
    waiting.parent.mkdir(parents=True)
    waiting.write_text("kept")
    linked, target = tmp_path / "linked", tmp_path / "elsewhere"
    target.mkdir()
    linked.mkdir()
    (linked / STAGING).symlink_to(target)
    for home in (tmp_path / "waiting", linked):
        Tracker(untracked, home).finish("FINISHED")
    assert waiting.read_text() == "kept"
    assert (linked / STAGING).is_symlink() and target.is_dir()
    emptied = tmp_path / "emptied"
    (emptied / STAGING).mkdir(parents=True)
    Tracker(untracked, emptied).finish("FINISHED")
    assert not (emptied / STAGING).exists()


def test_the_first_run_in_a_new_store_says_nothing_of_mlflows_tables(make_cfg, tmp_path, capfd):
    store = f"sqlite:///{tmp_path / 'new.db'}"
    run_id = recipe.train(make_cfg("trainer.max_steps=10", f"mlflow.tracking_uri={store}"))["run_id"]
    said = "".join(capfd.readouterr())
    assert "mlflow.store.db.utils" not in said and "alembic" not in said, said
    assert MlflowClient(store).get_run(run_id).info.status == "FINISHED"
    quieted = logging.getLogger("mlflow.store.db.utils")
    assert quieted.isEnabledFor(logging.WARNING) and not quieted.isEnabledFor(logging.INFO), "warnings still show"


def test_a_runs_mlflow_start_is_when_the_training_process_started_it_not_when_the_sender_got_to_it(
    make_cfg, client, monkeypatch
):
    asked, real_open = [], Tracker.open

    def open_noting_when(tracker, *arguments, **options):
        asked.append(int(time.time() * 1000))
        real_open(tracker, *arguments, **options)

    monkeypatch.setattr(Tracker, "open", open_noting_when)
    began = int(time.time() * 1000)
    run = client.get_run(recipe.train(make_cfg("trainer.max_steps=10"))["run_id"])
    # The sender creates the run once it has imported MLflow and read the request: after `asked`.
    assert began <= run.info.start_time <= asked[0] <= run.info.end_time
