"""The models out: a run's checkpoints logged as MLflow models (LoggedModels) by its sender process
as the run finishes (`mlflow.log_models`), what is readied for that while the run trains, and
which checkpoints of a run still lack a model.
"""

import contextlib
import logging
import os
import threading
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import LoggedModelStatus

from ..errors import first_line

log = logging.getLogger(__name__)


def unlogged(client: MlflowClient, run_id: str, checkpoints: list[dict]) -> list[dict]:
    """Of `checkpoints` (name, path, step), those the run has no READY model of. A model of the run
    still PENDING is one its sender died logging (only the run's sender logs its models, and only as
    it ends): it is marked FAILED, as MLflow marks one whose logging raised, not shown in progress
    for good."""
    experiment = client.get_run(run_id).info.experiment_id
    logged = client.search_logged_models(experiment_ids=[experiment], filter_string=f"source_run_id = '{run_id}'")
    for model in logged:
        if model.status == LoggedModelStatus.PENDING:
            client.finalize_logged_model(model.model_id, LoggedModelStatus.FAILED)
    ready = {model.tags.get("checkpoint") for model in logged if model.status == LoggedModelStatus.READY}
    return [checkpoint for checkpoint in checkpoints if checkpoint["path"] not in ready]


def prepare_model_logging() -> threading.Thread:
    """What logging a model needs that the model does not: torch, MLflow's PyTorch flavor and
    torch.export's first trace (3 s on a CPU), in a thread of the sender while the run trains, on
    the core training leaves free (devices.set_cpu_threads), so that the end of a run waits only
    for its own model's trace and files."""

    def warm_up() -> None:
        with contextlib.suppress(Exception):  # whatever fails here fails again in log_models, which says so
            import mlflow.pytorch  # noqa: F401
            import torch

            torch.set_num_threads(1)  # beside training; a model's trace is not arithmetic
            torch.export.export(torch.nn.Linear(1, 1), (torch.zeros(1, 1),))

    thread = threading.Thread(target=warm_up, daemon=True)
    thread.start()
    return thread


def log_models(client: MlflowClient, run_id: str, asked: dict) -> None:
    """Each checkpoint `asked` names as an MLflow model of the run (a LoggedModel: the Models tab,
    `search_logged_models`, `models:/<id>`), at its step, with the run's metrics of that step,
    unless the run has a model of that checkpoint already (a resume that did not change the best;
    one whose logging failed, which MLflow lists as FAILED, or that a killed sender left PENDING,
    is tried again: see `unlogged`).
    The model is built from its description, given the checkpoint's weights through the project's
    own loaders, on the CPU, and saved as a graph traced by `torch.export` ("pt2"), which loads
    without this project's code; an example of two samples leaves its batch size free. Whatever
    fails warns: the checkpoints stay, and the run's metrics and end are delivered already."""
    try:
        if not (left := unlogged(client, run_id, asked["checkpoints"])):
            return
        import mlflow.pytorch  # torch and its flavor (3 s) only in a sender that logs a model
        import torch
        from hydra.utils import instantiate

        from ..checkpoint.initial import load_weights
        from ..checkpoint.resume import load

        experiment = client.get_run(run_id).info.experiment_id
        # MLflow files a model in the active store and experiment. Set here, not as the sender starts:
        # setting the store resets MLflow's tracing, which a run whose models are not logged never uses.
        mlflow.set_tracking_uri(client.tracking_uri)
        mlflow.set_experiment(experiment_id=experiment)
        # The model is traced on the CPU, where it loads on any machine; MLflow checks its example
        # through pyfunc, which would place it on a GPU wherever one is, and refuse it there.
        os.environ["MLFLOW_DEFAULT_PREDICTION_DEVICE"] = "cpu"
        example = torch.tensor(asked["example"]["values"], dtype=getattr(torch, asked["example"]["dtype"]))
        requirements = [f"torch=={torch.__version__.split('+')[0]}"]  # a local build tag (+cpu) is no pip version
    except Exception as error:
        log.warning(f"no model was logged to MLflow ({first_line(error)}); the checkpoints stay: export.py writes one")
        return
    for checkpoint in left:
        try:
            model = instantiate(asked["model"])
            # Written and sealed by this run moments ago: read without checking every byte again.
            load_weights(model, load(Path(checkpoint["path"]), verify=False), [], shards=False, fine_tuning=False)
            mlflow.pytorch.log_model(
                model.eval(),
                name=checkpoint["name"],
                step=checkpoint["step"],
                run_id=run_id,
                input_example=example.numpy(),  # numpy: MLflow infers a TensorSpec signature from it
                serialization_format="pt2",
                pip_requirements=requirements,
                tags={"checkpoint": checkpoint["path"]},
            )
        except Exception as error:
            log.warning(
                f"the {checkpoint['name']} model was not logged to MLflow ({first_line(error)}); its checkpoint "
                f"{checkpoint['path']} stays, and export.py writes its weights"
            )
