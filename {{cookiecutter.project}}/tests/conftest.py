"""Shared fixtures: configs composed from the real configs/ folder, pointed at temporary stores."""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from omegaconf import DictConfig

PROJECT = Path(__file__).resolve().parents[1]

# Small and fast, on the CPU; each test overrides what it is about.
BASE = {
    "device": "cpu",
    "trainer.max_steps": "40",
    "trainer.log_every_n_steps": "1",
    "trainer.val_every_n_steps": "20",
    "checkpoint.every_n_steps": "10",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", help="also run the tests marked slow (what CI runs)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that runs `python run.py` in a subprocess (the `project` fixture) is slow: each pays
    the start-up of a fresh interpreter. Slow tests run with `--all`, or when `-m` picks them."""
    for item in items:
        if "project" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
    if config.getoption("--all") or config.option.markexpr:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    config.hook.pytest_deselected(items=slow)
    items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(scope="session")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite store for the session: creating its tables costs seconds."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def checkpoint_dir(tmp_path: Path) -> Path:
    return tmp_path / "checkpoints"


@pytest.fixture
def make_cfg(checkpoint_dir: Path, tracking_uri: str):
    """Composes configs/config.yaml like `python run.py key=value ...` would."""

    def make(*overrides: str) -> DictConfig:
        values = {**BASE, "checkpoint.dir": str(checkpoint_dir), "mlflow.tracking_uri": tracking_uri}
        values.update(override.split("=", 1) for override in overrides)
        with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
            return compose("config", overrides=[f"{key}={value}" for key, value in values.items()])

    return make


@pytest.fixture
def client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri)


def losses(client: MlflowClient, run_id: str, key: str = "train/loss") -> dict[int, list[float]]:
    """Every value logged for `key`, by step (a step logged again after a resume has two)."""
    by_step: dict[int, list[float]] = {}
    for metric in client.get_metric_history(run_id, key):
        by_step.setdefault(metric.step, []).append(metric.value)
    return by_step


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """run.py and configs/ copied to a temporary folder: `python run.py` there keeps its default
    paths (mlflow.db, checkpoints/) out of the real project."""
    shutil.copy(PROJECT / "run.py", tmp_path / "run.py")
    shutil.copytree(PROJECT / "configs", tmp_path / "configs")
    return tmp_path


def start(project: Path, *overrides: str, **popen) -> subprocess.Popen:
    """`python run.py ...` in `project`, as a person would type it."""
    return subprocess.Popen(
        [sys.executable, "run.py", *overrides],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def run_cli(project: Path, *overrides: str, timeout: float = 180) -> subprocess.CompletedProcess:
    process = start(project, *overrides)
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def wait_for_a_save(home, process: subprocess.Popen, timeout: float = 120) -> None:
    """Returns once `process` has written a checkpoint: it is past start-up and training."""
    pointer = home / "latest"
    before = pointer.read_text() if pointer.exists() else None
    deadline = time.monotonic() + timeout
    while not pointer.exists() or pointer.read_text() == before:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)


HOLDER = """
import os, pathlib, sys, time
from {{cookiecutter.package}}.checkpoint.home import claim
with claim(pathlib.Path(sys.argv[1])):
    if sys.argv[2] == "fork" and os.fork() == 0:  # a child, as a data-loader worker would be
        time.sleep(10)
        os._exit(0)
    print("held", flush=True)
    time.sleep(60)
"""


def hold(home: Path, fork: bool = False) -> subprocess.Popen:
    """Another process that claims `home` (and, with `fork`, forks a child that lives on)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(home), "fork" if fork else "-"], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder
