"""A model and a dataset the template does not know, written into a package of their own, train
and resume through config alone: one class or function each, and one YAML file each."""

import os
import subprocess

import pytest
from conftest import configured, losses, run_cli, runs_named
from mlflow import MlflowClient

# Samples around four centres. The training set draws fresh noise each time a sample is read, as
# an augmentation would, from the global generator; it is not a TensorDataset.
TOYS = """
import torch
from torch import nn
from torch.utils.data import Dataset

from {{cookiecutter.package}}.engine.data import Data


class Noisy(Dataset):
    def __init__(self, centres, labels, noise):
        self.centres, self.labels, self.noise = centres, labels, noise

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        label = self.labels[index]
        return self.centres[label] + self.noise * torch.randn(self.centres.shape[1]), label


class Fixed(Dataset):
    def __init__(self, inputs, labels):
        self.inputs, self.labels = inputs, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index], self.labels[index]


def blobs(size: int, dim: int, noise: float = 0.5) -> Data:
    generator = torch.Generator().manual_seed(0)
    centres = 2 * torch.randn(4, dim, generator=generator)
    labels = torch.randint(0, 4, (size,), generator=generator)
    split = size // 4
    val_inputs = centres[labels[:split]] + noise * torch.randn(split, dim, generator=generator)
    return Data(
        train=Noisy(centres, labels[split:], noise),
        val=Fixed(val_inputs, labels[:split]),
        input_shape=(dim,),
        num_classes=4,
    )


class Bilinear(nn.Module):
    def __init__(self, input_shape: list[int], num_classes: int, rank: int = 4, dropout: float = 0.0):
        super().__init__()
        self.u, self.v = nn.Linear(input_shape[0], rank), nn.Linear(input_shape[0], rank)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(rank, num_classes)

    def forward(self, inputs):
        return self.out(self.dropout(self.u(inputs) * self.v(inputs)))
"""
OWN = ["model=bilinear", "data=blobs", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=100"]


def with_package(project, tmp_path, name: str, source: str, configs: dict[str, str]) -> tuple:
    """The project, with the package `name` beside it (importable through the environment
    returned) and a YAML file under configs/ naming each new component."""
    package = tmp_path / "packages" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(source)
    for path, text in configs.items():
        (project / "configs" / path).parent.mkdir(parents=True, exist_ok=True)  # your folder of the group
        (project / "configs" / path).write_text(text)
    return project, {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")]),
    }


@pytest.fixture
def own(project, tmp_path):
    return with_package(
        project,
        tmp_path,
        "toys",
        TOYS,
        {
            "model/bilinear.yaml": "_target_: toys.Bilinear\nrank: 8\ndropout: 0.1\n",
            "data/blobs.yaml": "_target_: toys.blobs\nsize: 512\ndim: 6\nbatch_size: 32\n",
        },
    )


def run(own, *overrides: str) -> subprocess.CompletedProcess:
    """`python run.py` in the project of `own` (or of `regression`), with its package importable
    (forked by the warm parent, which puts that folder first on the child's path)."""
    project, env = own
    return run_cli(project, *overrides, env=env, timeout=300)


def only_run(project, name: str):
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (found,) = runs_named(client, name)
    return client, found


@pytest.mark.slow
def test_a_model_and_a_dataset_from_another_package_train_and_resume_bit_for_bit(own):
    project, _ = own
    reference = run(own, *OWN, "trainer.max_steps=40", "name=reference")
    assert reference.returncode == 0, reference.stderr
    # Stopped mid-epoch (12 batches an epoch), halfway through the same 40-step schedule, then resumed.
    first = run(own, *OWN, "trainer.max_steps=20", "scheduler.total_steps=40")
    resumed = run(own, *OWN, "trainer.max_steps=40", "resume=last")
    assert first.returncode == 0 and resumed.returncode == 0, first.stderr + resumed.stderr
    assert "resumed at step 20 on cpu" in resumed.stdout and "(ok)" in resumed.stdout

    client, reference_run = only_run(project, "reference")
    _, resumed_run = only_run(project, configured().name)
    expected = losses(client, reference_run.info.run_id)
    assert sorted(expected) == list(range(1, 41))
    assert losses(client, resumed_run.info.run_id) == expected
    assert resumed_run.data.params["model"] == "Bilinear" and resumed_run.data.tags["model._target_"] == "toys.Bilinear"
    assert resumed_run.data.metrics["val/accuracy"] == reference_run.data.metrics["val/accuracy"]


@pytest.mark.slow
def test_a_typo_in_a_new_models_own_setting_is_refused_naming_the_setting(own):
    refused = run(own, *OWN, "+model.rnak=3")
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "error: model.rnak is not a setting of toys.Bilinear (did you mean model.rank?)"
    ]
    wrong_type = run(own, *OWN, "model.dropout=high")
    assert wrong_type.stderr.strip().splitlines()[-1] == "error: model.dropout='high' is not a number"


# A regression whose samples are dicts: y, two outputs of a linear function of x, with fresh noise
# each time a training sample is read; a model, an MSE loss and torchmetrics' metrics for it.
REGRESSION = """
import torch
from torch import nn
from torch.utils.data import Dataset

from {{cookiecutter.package}}.engine.data import Data


class Points(Dataset):
    def __init__(self, x, y, noise):
        self.x, self.y, self.noise = x, y, noise

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        noise = self.noise * torch.randn(self.y.shape[1]) if self.noise else 0
        return {"x": self.x[index], "y": self.y[index] + noise}


def points(size: int, features: int, noise: float = 0.1) -> Data:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(size, features, generator=generator)
    y = x @ torch.randn(features, 2, generator=generator)
    split = size // 8
    return Data(
        train=Points(x[split:], y[split:], noise), val=Points(x[:split], y[:split], 0.0), features=features, outputs=2
    )


class Regressor(nn.Module):
    def __init__(self, features: int, outputs: int, hidden: int = 16, dropout: float = 0.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Dropout(dropout))
        self.head = nn.Linear(hidden, outputs)

    def forward(self, x):
        return self.head(self.body(x))
"""
REGRESS = [
    "data=points",
    "model=regressor",
    "loss=mse",
    "metrics=regression",
    "task.inputs=x",
    "task.targets=y",
    "trainer.log_every_n_steps=1",
]


@pytest.fixture
def regression(project, tmp_path):
    return with_package(
        project,
        tmp_path,
        "regress",
        REGRESSION,
        {
            "data/points.yaml": "_target_: regress.points\nsize: 512\nfeatures: 5\nbatch_size: 32\n",
            "model/regressor.yaml": "_target_: regress.Regressor\nhidden: 16\ndropout: 0.1\n",
            "loss/mse.yaml": "_target_: torch.nn.MSELoss\n",
            "metrics/regression.yaml": "mse:\n  _target_: torchmetrics.MeanSquaredError\nr2:\n  _target_: torchmetrics.R2Score\n",
        },
    )


@pytest.mark.slow
def test_a_regression_over_dict_batches_trains_and_resumes_bit_for_bit_by_config_alone(regression):
    """448 training samples, 14 batches an epoch: the stop at step 20 is mid-epoch."""
    project, env = regression
    reference = run(regression, *REGRESS, "trainer.max_steps=40", "name=reference")
    assert reference.returncode == 0, reference.stderr
    first = run(regression, *REGRESS, "trainer.max_steps=20", "scheduler.total_steps=40", "checkpoint.every_n_steps=20")
    resumed = run(regression, *REGRESS, "trainer.max_steps=40", "resume=last")
    assert first.returncode == 0 and resumed.returncode == 0, first.stderr + resumed.stderr
    assert "resumed at step 20 on cpu" in resumed.stdout and "(ok)" in resumed.stdout

    client, reference_run = only_run(project, "reference")
    _, resumed_run = only_run(project, configured().name)
    expected = losses(client, reference_run.info.run_id)
    assert sorted(expected) == list(range(1, 41))
    assert losses(client, resumed_run.info.run_id) == expected
    for metric in ("val/loss", "val/mse", "val/r2"):
        assert resumed_run.data.metrics[metric] == reference_run.data.metrics[metric], metric
    # MSELoss is the mean per element, and each sample holds two: val/loss is val/mse.
    assert resumed_run.data.metrics["val/loss"] == pytest.approx(resumed_run.data.metrics["val/mse"], rel=1e-5)
    assert resumed_run.data.metrics["val/r2"] > 0  # it predicts better than the mean of the targets
