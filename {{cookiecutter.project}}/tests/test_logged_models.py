"""mlflow.log_models: the best (and the final) checkpoint's model as an MLflow LoggedModel of the
run, logged by the sender process as the run finishes, with the metrics of its step, loadable by
`models:/<id>`; none from a run that stopped to come back."""

import logging
import os
import subprocess
import sys

import mlflow
import pytest
import torch
from conftest import configured, losses, new_experiment, run_cli, runs_named, start
from mlflow.entities import LoggedModelStatus
from test_distributed import CPU, store
from test_export import val_loss
from test_sharded import ALONE

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.home import best_of, path_of, step_of
from {{cookiecutter.package}}.engine.signals import Stopped
from {{cookiecutter.package}}.engine.tracking import tracker as tracking
from {{cookiecutter.package}}.engine.tracking.logged_models import log_models

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

PEAK = ["optimized_mode=max", "checkpoint.keep_last=2"]  # the best checkpoint is an early one (test_best.py)


def models_of(client, run_id: str) -> dict[str, mlflow.entities.LoggedModel]:
    """The run's logged models, by name; a name logged twice fails."""
    found = all_models_of(client, run_id)
    by_name = {model.name: model for model in found}
    assert len(by_name) == len(found), [model.name for model in found]
    return by_name


def all_models_of(client, run_id: str) -> list[mlflow.entities.LoggedModel]:
    """The run's logged models, oldest first, failed ones included."""
    experiment = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(experiment_ids=[experiment], filter_string=f"source_run_id = '{run_id}'")
    return sorted(found, key=lambda model: model.creation_timestamp)


def loaded(tracking_uri: str, model_id: str) -> torch.nn.Module:
    mlflow.set_tracking_uri(tracking_uri)
    return mlflow.pytorch.load_model(f"models:/{model_id}")


def test_the_best_model_is_logged_at_its_step_with_its_metrics_and_loads_to_its_val_loss(
    make_cfg, client, tracking_uri, checkpoint_dir
):
    trained = recipe.train(make_cfg(*PEAK, "mlflow.log_models=best"))
    logged = {step: values[-1] for step, values in losses(client, trained["run_id"], "val/loss").items()}
    best = max(logged, key=logged.get)
    (model,) = models_of(client, trained["run_id"]).values()
    assert model.name == "best" and model.tags["checkpoint"] == str(path_of(checkpoint_dir, best))
    linked = {metric.key: metric for metric in model.metrics}
    assert linked["val/loss"].value == logged[best] and linked["val/loss"].step == best
    assert linked["val/loss"].model_id == model.model_id
    val_fraction = make_cfg().data.val_fraction
    assert val_loss(loaded(tracking_uri, model.model_id), val_fraction) == pytest.approx(logged[best], rel=1e-5)


def test_a_model_traced_on_the_cpu_is_checked_on_the_cpu_where_mlflow_would_serve_on_a_gpu(
    make_cfg, client, monkeypatch, capfd
):
    """MLflow checks a logged model's input example through pyfunc, which places the model on a GPU
    wherever there is one (or where MLFLOW_DEFAULT_PREDICTION_DEVICE says): a model traced on the
    CPU is refused there, and every run on a GPU machine ended in a block of warnings."""
    monkeypatch.setenv("MLFLOW_DEFAULT_PREDICTION_DEVICE", "cuda")  # as pyfunc chooses where CUDA is
    trained = recipe.train(make_cfg("mlflow.log_models=best"))
    (model,) = models_of(client, trained["run_id"]).values()
    assert model.status == LoggedModelStatus.READY
    assert "Failed to validate serving input" not in capfd.readouterr().err


def test_the_sender_readies_model_logging_in_a_thread_while_the_run_trains():
    """torch, MLflow's PyTorch flavor and torch.export's first trace: seconds that the end of a
    short run waited for, done by the sender beside training once it opens a run that logs models."""
    check = (
        "import sys; from {{cookiecutter.package}}.engine.tracking.logged_models import prepare_model_logging\n"
        "assert 'torch' not in sys.modules\n"
        "prepare_model_logging().join()\n"
        "assert {'mlflow.pytorch', 'torch._dynamo'} <= set(sys.modules), 'not ready'"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=120)


@pytest.mark.parametrize(("which", "names"), [("both", {"best", "final"}), ("final", {"final"})])
def test_both_log_the_final_model_beside_the_best(make_cfg, client, checkpoint_dir, which, names):
    trained = recipe.train(make_cfg(*PEAK, f"mlflow.log_models={which}"))
    logged = {step: values[-1] for step, values in losses(client, trained["run_id"], "val/loss").items()}
    steps = {"best": max(logged, key=logged.get), "final": 40}
    assert steps["best"] != steps["final"]
    models = models_of(client, trained["run_id"])
    assert {name: model.tags["checkpoint"] for name, model in models.items()} == {
        name: str(path_of(checkpoint_dir, steps[name])) for name in names
    }


def test_a_run_stopped_to_come_back_logs_its_models_when_it_ends(make_cfg, client, sigterm_at, monkeypatch):
    sigterm_at(25)
    settings = ["name=come-back", "mlflow.log_models=best"]
    with pytest.raises(Stopped):
        recipe.train(make_cfg(*settings))
    (run,) = runs_named(client, "come-back")
    assert models_of(client, run.info.run_id) == {}
    monkeypatch.undo()
    resumed = recipe.train(make_cfg(*settings, "resume=last"))
    assert resumed["run_id"] == run.info.run_id
    assert set(models_of(client, run.info.run_id)) == {"best"}
    again = recipe.train(make_cfg(*settings, "resume=last"))  # at max_steps: trains nothing, the same best
    assert again["run_id"] == run.info.run_id
    assert set(models_of(client, run.info.run_id)) == {"best"}, "no second copy of the same checkpoint"


def test_a_sharded_checkpoint_is_logged_as_one_model(project, make_cfg):
    trained = run_cli(project, *ALONE, "trainer.max_steps=10", "checkpoint.every_n_steps=5", "mlflow.log_models=best")
    assert trained.returncode == 0, trained.stderr
    client = store(project)
    (run,) = runs_named(client, configured().name)
    (model,) = models_of(client, run.info.run_id).values()
    logged = {step: values[-1] for step, values in losses(client, run.info.run_id, "val/loss").items()}
    step = next(metric.step for metric in model.metrics if metric.key == "val/loss")
    val_fraction = make_cfg().data.val_fraction  # the project's, which its copy keeps
    assert val_loss(loaded(f"sqlite:///{project / 'mlflow.db'}", model.model_id), val_fraction) == pytest.approx(
        logged[step], rel=1e-5
    )


# A model torch.export cannot trace: which branch it takes depends on the data.
BRANCHY = """
import math
from torch import nn

class Branchy(nn.Module):
    def __init__(self, input_shape: list[int], num_classes: int) -> None:
        super().__init__()
        self.layer = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, inputs):
        flat = inputs.flatten(1)
        return self.layer(flat) if flat.sum() > 0 else self.layer(-flat)
"""


def test_a_model_that_cannot_be_logged_warns_and_the_run_ends_finished_with_its_metrics(project):
    (project / "branchy.py").write_text(BRANCHY)  # importable from the project folder, the sender's too
    (project / "configs" / "model").mkdir(exist_ok=True)  # an option of yours beside the engine's
    (project / "configs" / "model" / "branchy.yaml").write_text("_target_: branchy.Branchy\n")
    run = start(project, *CPU, "model=branchy", "trainer.max_steps=10", "mlflow.log_models=best")
    stdout, stderr = run.communicate(timeout=300)
    assert run.returncode == 0, stderr
    assert "the best model was not logged to MLflow" in stdout + stderr
    client = store(project)
    (logged,) = runs_named(client, configured().name)
    assert logged.info.status == "FINISHED" and "val/loss" in logged.data.metrics
    (failed,) = models_of(client, logged.info.run_id).values()  # MLflow lists the attempt as failed
    assert failed.status == LoggedModelStatus.FAILED


# The default model, but the first process to export it, the MLflow sender, is killed in the export
# (as the OOM killer would kill it), its model PENDING in MLflow.
KILLED_IN_EXPORT = """
import os, signal
import torch
from {{cookiecutter.package}}.models import MLP

class KilledInExport(MLP):
    def forward(self, inputs):
        if torch.compiler.is_exporting() and not os.path.exists({marker!r}):
            open({marker!r}, "x").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(inputs)
"""


@pytest.mark.parametrize("killed", ["mid-run", "in the export"])
def test_a_model_a_killed_sender_did_not_log_is_said_marked_failed_and_logged_once_by_a_resume(
    make_cfg, client, checkpoint_dir, tmp_path, monkeypatch, caplog, killed
):
    (tmp_path / "killing.py").write_text(KILLED_IN_EXPORT.format(marker=str(tmp_path / "exported")))
    monkeypatch.syspath_prepend(tmp_path)  # the model is built here, and in the sender
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    if killed == "mid-run":
        (tmp_path / "exported").touch()  # its export goes through
        real_step, steps = recipe.train_step, []

        def step_then_kill_the_sender(run, *args):
            steps.append(1)
            if len(steps) == 15:
                run.tracker._sender._child.kill()
            return real_step(run, *args)

        monkeypatch.setattr(recipe, "train_step", step_then_kill_the_sender)
    settings = ["mlflow.log_models=best", "model._target_=killing.KilledInExport"]
    with caplog.at_level(logging.WARNING):
        run_id = recipe.train(make_cfg(*settings))["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    best = best_of(checkpoint_dir)
    warned = [record.getMessage() for record in caplog.records if record.name == tracking.__name__]
    assert warned[-1] == (
        f"the best model (step {step_of(best)}, {best}) was not logged to MLflow: the sender process died (exit code "
        f"-9); run the same command with resume=last to log it (it trains no further)"
    )
    if killed == "in the export":  # its metrics and the end of the run were delivered: nothing else to say
        assert len(warned) == 1, warned
    statuses = {"mid-run": [], "in the export": [LoggedModelStatus.FAILED]}[killed]  # not PENDING for good
    assert [model.status for model in all_models_of(client, run_id)] == statuses

    assert recipe.train(make_cfg(*settings, "resume=last"))["run_id"] == run_id
    models = all_models_of(client, run_id)
    assert [model.status for model in models] == [*statuses, LoggedModelStatus.READY]
    assert models[-1].tags["checkpoint"] == str(best)


def test_a_model_a_dead_sender_left_pending_is_marked_failed_by_the_next_sender_of_its_run(client):
    """The training process, killed with its sender, could not mark it."""
    experiment = new_experiment(client, "left-pending")
    run_id = client.create_run(experiment).info.run_id
    logged = client.create_logged_model(experiment, source_run_id=run_id, name="best", tags={"checkpoint": "a"})
    client.finalize_logged_model(logged.model_id, LoggedModelStatus.READY)
    left = client.create_logged_model(experiment, source_run_id=run_id, name="best", tags={"checkpoint": "b"})
    log_models(client, run_id, {"checkpoints": [{"name": "best", "path": "a", "step": 10}]})  # logged already
    assert client.get_logged_model(left.model_id).status == LoggedModelStatus.FAILED
    assert client.get_logged_model(logged.model_id).status == LoggedModelStatus.READY
