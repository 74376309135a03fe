"""Shared fixtures: configs composed from the real configs/ folder, pointed at temporary stores."""

import atexit
import contextlib
import copy
import ctypes
import functools
import gc
import importlib.resources
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig
from warm_parent import WarmParent, WarmPopen, fork_from

from {{cookiecutter.package}}.engine.lifecycle.goodput import BUCKETS

# xdist's controller imports this file too, and starts its workers only after it: MLflow and the
# recipe (torch), 3 s together, are imported where a fixture uses them, in the workers.
if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

PROJECT = Path(__file__).resolve().parents[1]
# The folders a run's config is composed from, the first one's files winning (engine.config_roots.config_roots):
# the project's, then the engine's, found where its package is installed.
CONFIG_ROOTS = (PROJECT / "configs", Path(str(importlib.resources.files("{{cookiecutter.package}}.engine.configs"))))

# Small and fast, on the CPU; each test overrides what it is about.
BASE = {
    "device": "cpu",
    "trainer.max_steps": "40",
    "trainer.log_every_n_steps": "1",
    "trainer.val_every_n_steps": "20",
    "checkpoint.every_n_steps": "10",
}


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """How many pytest-xdist workers `-n auto` (pyproject.toml's addopts) starts: one a core, up to
    four, for the suite (`pytest`, `pytest --all`); none, the tests running in this process, for a
    file or test named on the command line, or a collection, where starting workers and their
    imports would cost more than they save, and for the SLURM tier (`-m slurm`), whose one cluster
    each worker would start again on the same ports. `-n <N>` chooses."""
    if config.args_source is pytest.Config.ArgsSource.ARGS or config.option.collectonly:
        return 0
    if "slurm" in config.option.markexpr:
        return 0
    return min(4, len(os.sched_getaffinity(0)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--all", action="store_true", help="also run the tests marked slow (what CI runs)")
    parser.addoption(
        "--cold-starts", action="store_true", help="start every `python run.py` as a new interpreter (no warm parent)"
    )


def pytest_configure(config: pytest.Config) -> None:
    global _COLD_STARTS
    _COLD_STARTS = config.getoption("--cold-starts")
    # The last thing at exit, as run.py's: a worker's shutdown would otherwise search torch's
    # million objects for garbage, 2 s that `pytest` waits for before it says it is done.
    atexit.register(gc.freeze)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`pytest` is your daily loop: your components' wiring and checks, one short training that
    stops and resumes bit for bit, an export, and the engine's fastest contracts. `pytest --all`
    (what CI runs) adds the tests marked slow: the modules of the engine's other contracts (their
    `pytestmark`, less the tests marked daily), and every test that runs `python run.py` in a
    subprocess (the `project` fixture: each pays a fresh interpreter's start-up). `-m` picks tests
    by mark; the SLURM tier runs only with `-m slurm`. A test file you add is in the daily loop."""
    for item in items:
        if {"project", "bare_project"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
    # The SLURM tier starts a cluster's daemons as root: only when asked for by name (-m slurm).
    if "slurm" not in config.option.markexpr:
        apart = [item for item in items if item.get_closest_marker("slurm")]
        config.hook.pytest_deselected(items=apart)
        items[:] = [item for item in items if not item.get_closest_marker("slurm")]
    if config.getoption("--all") or config.option.markexpr:
        return
    daily, beyond = [], []
    for item in items:
        (daily if item.get_closest_marker("daily") or not item.get_closest_marker("slow") else beyond).append(item)
    config.hook.pytest_deselected(items=beyond)
    items[:] = daily


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
        values = {**BASE, "mlflow.tracking_uri": tracking_uri}
        values.update(override.split("=", 1) for override in overrides)
        own_home = "checkpoint.dir" not in values
        composed = _composed(tuple(values.items()))
        if own_home:  # the test's, set as an override would set it
            composed.checkpoint.dir = str(checkpoint_dir)
        return composed

    return make


@functools.cache
def _compose(overrides: tuple[tuple[str, str], ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        return compose("config", overrides=[f"{key}={value}" for key, value in overrides])


def _composed(overrides: tuple[tuple[str, str], ...]) -> DictConfig:
    """What composing `overrides` gives, as Hydra gives it: the config files the overrides choose,
    composed once per pytest process (Hydra takes a fifth of a second for it, most of it reading
    the files), a copy of it for each test to change, then the values set on that copy by Hydra's
    own code for a command line's values, which it too applies after composing the files."""
    chosen = copy.deepcopy(_compose(tuple((key, value) for key, value in overrides if _chooses(key))))
    values = [f"{key}={value}" for key, value in overrides if not _chooses(key)]
    ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(values), chosen)
    return chosen


def _chooses(key: str) -> bool:
    """Whether an override of `key` chooses config files (a group's option, Hydra's own settings, a
    package) rather than sets a value: Hydra reads these while it composes the files."""
    bare = key.lstrip("+~")
    return bare.startswith("hydra") or "@" in bare or any((root / bare).is_dir() for root in CONFIG_ROOTS)


def configured(*overrides: str) -> DictConfig:
    """What `python run.py <overrides>` composes from the project's configs: the run's name, folder and
    settings as the user chose them, which a test reads here rather than asserting the template's values."""
    return _composed(tuple(tuple(override.split("=", 1)) for override in overrides))


@pytest.fixture
def client(tracking_uri: str) -> "MlflowClient":
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def new_experiment(client: "MlflowClient", name: str) -> str:
    """An experiment of `client`'s sqlite store whose artifacts lie beside the store, as the engine
    files a run's (tracking/mlflow_store.py): MLflow's default is ./mlruns of the folder pytest runs
    in, your project."""
    database = Path(client.tracking_uri.removeprefix("sqlite:///"))
    return client.create_experiment(name, artifact_location=(database.parent / "mlruns").as_uri())


@pytest.fixture
def sigterm_at(monkeypatch):
    """Sends this process SIGTERM during training step `step`, as a cluster scheduler would."""

    def arm(step: int) -> None:
        from {{cookiecutter.package}}.engine import train as recipe

        calls = []
        real_step = recipe.train_step

        def step_then_signal(*args):
            result = real_step(*args)
            calls.append(1)
            if len(calls) == step:
                os.kill(os.getpid(), signal.SIGTERM)
            return result

        monkeypatch.setattr(recipe, "train_step", step_then_signal)

    return arm


def runs_named(client: "MlflowClient", name: str, filter_string: str = "") -> "list[Run]":
    """The MLflow runs of `name=` (the param `name`: training runs, sweep jobs, evaluations), newest
    first, in every experiment of the store: the project's, and any of the older grouping by name."""
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    found = " and ".join(filter(None, [f"params.name = '{name}'", filter_string]))
    return client.search_runs(experiments, found) if experiments else []


def losses(client: "MlflowClient", run_id: str, key: str = "train/loss") -> dict[int, list[float]]:
    """Every value logged for `key`, by step (a step logged again after a resume has two)."""
    by_step: dict[int, list[float]] = {}
    for metric in client.get_metric_history(run_id, key):
        by_step.setdefault(metric.step, []).append(metric.value)
    return by_step


@pytest.fixture(scope="session")
def blank_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLflow store whose tables are made, once a pytest process: a run that makes its own store
    spends a second of CPU on MLflow's migrations, which a test's copy of the project skips."""
    from mlflow import MlflowClient

    database = tmp_path_factory.mktemp("blank-store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{database}").search_experiments()
    return database


@pytest.fixture
def project(tmp_path: Path, blank_store: Path) -> Path:
    return copy_project(tmp_path, blank_store)


@pytest.fixture
def bare_project(tmp_path: Path) -> Path:
    """A project as the template makes it, no MLflow store in it: for a test of the store's making."""
    return copy_project(tmp_path)


def copy_project(folder: Path, store: Path | None = None) -> Path:
    """run.py, eval.py, export.py and configs/ copied to `folder`: `python run.py` there keeps its
    default paths (mlflow.db, checkpoints/) out of the real project; `store`, a blank MLflow store
    copied as its mlflow.db, saves the first run the store's making."""
    for script in ("run.py", "eval.py", "export.py"):
        shutil.copy(PROJECT / script, folder / script)
    shutil.copytree(PROJECT / "configs", folder / "configs")
    if store is not None:
        shutil.copy(store, folder / "mlflow.db")
    return folder


def start(
    project: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
    script: str = "run.py",
    cold: bool = False,
    **popen,
) -> subprocess.Popen:
    """`python run.py ...` (or another `script`) in `project`, as a person would type it, forked by
    this worker's warm parent where it can be (tests/warm_parent.py), or a new interpreter (`cold`,
    for a test that finds the run's MLflow sender among its children)."""
    command = [sys.executable, script, *overrides]
    popen = {"cwd": project, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "env": env, **popen}
    return started(command, cold=cold, **popen)


def started(command: list[str], cold: bool = False, **popen) -> subprocess.Popen:
    """`subprocess.Popen(command, **popen)`, forked by this worker's warm parent where it can be;
    killed when the test ends if it runs still (no_process_outlives_its_test)."""
    warm = None if cold else _warm_parent()
    if warm is not None and warm.can_start(command, popen.get("env"), popen):
        process = WarmPopen(warm, command, **popen)
    else:
        process = subprocess.Popen(command, **popen)  # a new interpreter: this process forks only senders
    _STARTED.append(process)
    return process


def started_by(pid: int) -> dict[int, dict[str, str]]:
    """The processes that process `pid` started and that run still, each with its environment: its
    own children, and those this worker's warm parent forked at its request (its MLflow sender,
    torchrun's workers where torchrun was forked)."""
    found = {child: env for warm in _WARM for child, env in warm.started_by(pid).items()}
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    for child in map(int, children):
        with contextlib.suppress(FileNotFoundError):  # a child that ended meanwhile
            found[child] = environ(child)
    return found


def environ(pid: int) -> dict[str, str]:
    """The environment process `pid` started with (a child of this worker's warm parent: as asked for)."""
    for warm in _WARM:
        if (forked := warm.environ(pid)) is not None:
            return forked
    with open(f"/proc/{pid}/environ", "rb") as variables:
        return dict(item.decode().split("=", 1) for item in variables.read().split(b"\0") if b"=" in item)


def command(pid: int) -> list[str]:
    """The command line process `pid` started with (a child of this worker's warm parent: as asked for)."""
    for warm in _WARM:
        if (forked := warm.command(pid)) is not None:
            return forked
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


_WARM: list[WarmParent] = []  # this worker's, once a test has started a run


def _warm_parent() -> WarmParent | None:
    """This worker's warm parent, started on first use; None with `--cold-starts`."""
    if _COLD_STARTS:
        return None
    if not _WARM:
        _WARM.append(WarmParent())
    return _WARM[0]


def pytest_sessionstart() -> None:
    fork_from(_warm_parent, senders_only=True)  # the senders of the runs a test trains in this process


def pytest_sessionfinish() -> None:
    for warm in _WARM:
        warm.stop()


_STARTED: list[subprocess.Popen] = []  # by `started`, in the test running now
_COLD_STARTS = False  # --cold-starts


@pytest.fixture(autouse=True)
def no_process_outlives_its_test() -> Iterator[None]:
    """A process the test started and left running (it failed before it stopped a run of a million
    steps) is killed as the test ends, rather than training on, and loading the machine, for hours."""
    yield
    kill_what_runs_still()


def kill_what_runs_still() -> None:
    """Kills each process `started` in this test that runs still, and waits for its end."""
    while _STARTED:
        process = _STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.communicate()


def run_cli(
    project: Path,
    *overrides: str,
    timeout: float = 180,
    script: str = "run.py",
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    process = start(project, *overrides, script=script, env=env)
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def wait_for_a_save(home, process: subprocess.Popen) -> None:
    """Returns once `process` has written a checkpoint: it is past start-up and training. Waits for
    that, or for the process to end (a failure, with its output), however long a busy machine takes."""
    pointer = home / "latest"
    before = pointer.read_text() if pointer.exists() else None
    while not pointer.exists() or pointer.read_text() == before:
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)


def wait_for_exit(pid: int) -> None:
    """Returns once `pid` (any process, not only a child) has ended: the kernel says so on a pidfd."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        select.select([pidfd], [], [])
    finally:
        os.close(pidfd)


def signal_pending(pid: int, signal_number: int) -> bool:
    """Whether `signal_number` waits, undelivered, for `pid` (a stopped process keeps it so); False
    once `pid` is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
    except FileNotFoundError:
        return False
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(pending & (1 << (signal_number - 1)))


GATES = Path(__file__).resolve().parent / "gates"


class SaveGate:
    """Holds a run at its first checkpoint commit, so that a test acts at a known step instead of
    racing the run. The processes started with `env` import tests/gates/sitecustomize.py: the first
    one to commit a checkpoint (the rename of step_N.pt, or of the folder step_N, from its
    temporary; with `match`, only a commit whose path holds that text) tells this gate its pid and
    waits, in the thread that commits, until the gate is released; `when="before"` holds it before
    the rename, with the save still in progress; `each=True` holds the first commit of each
    process instead (one per attempt of a job that torchrun restarts)."""

    def __init__(self, path: Path, when: str = "after", match: str = "", each: bool = False) -> None:
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(str(self.path))
        self._listener.listen()
        self._held: socket.socket | None = None
        pythonpath = os.pathsep.join(filter(None, [str(GATES), os.environ.get("PYTHONPATH")]))
        self.env = {
            **os.environ,
            "PYTHONPATH": pythonpath,
            "TEST_SAVE_GATE": str(self.path),
            "TEST_SAVE_GATE_WHEN": when,
            "TEST_SAVE_GATE_MATCH": match,
            "TEST_SAVE_GATE_EACH": str(int(each)),
        }

    def wait(self, process: subprocess.Popen) -> int:
        """The pid of the process held at the gate, once one is; fails if `process` ends first."""
        pidfd = os.pidfd_open(process.pid)
        try:
            ready, _, _ = select.select([self._listener, pidfd], [], [])
        finally:
            os.close(pidfd)
        assert self._listener in ready, process.communicate()
        self._held, _ = self._listener.accept()
        with self._held.makefile() as told:
            return int(told.readline())

    def release(self) -> None:
        if self._held is not None:
            self._held.close()  # the held process reads the end of the connection and goes on
            self._held = None

    def close(self) -> None:
        self.release()
        self._listener.close()


@pytest.fixture
def save_gate(tmp_path: Path) -> Iterator[Callable[..., SaveGate]]:
    """save_gate(when="after", match="", each=False): a SaveGate in this test's folder, closed when
    the test ends."""
    gates: list[SaveGate] = []

    def make(when: str = "after", match: str = "", each: bool = False) -> SaveGate:
        gates.append(SaveGate(tmp_path / f"gate{len(gates)}.sock", when, match, each))
        return gates[-1]

    yield make
    for gate in gates:
        gate.close()


HOLDER = """
import os, pathlib, sys
from {{cookiecutter.package}}.engine.checkpoint.claim import claim
with claim(pathlib.Path(sys.argv[1])):
    if sys.argv[2] == "fork" and os.fork() == 0:  # a child, as a data-loader worker would be
        sys.stdin.read()  # lives on until the test lets go of the holder's stdin
        os._exit(0)
    print("held", flush=True)
    sys.stdin.read()  # holds until killed, or until the test lets go of its stdin
"""


def hold(home: Path, fork: bool = False) -> subprocess.Popen:
    """Another process that claims `home` (and, with `fork`, forks a child that lives on)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(home), "fork" if fork else "-"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def goodput_of(run: "Run") -> dict[str, float]:
    """The `goodput/*` metrics of `run` (their last values, without the prefix), checked to add up:
    the buckets to the wall time the legs' clocks read, each within 10 ms a leg (the resolution of a
    process's start time), and the fraction to training's share of it."""
    found = {
        key.removeprefix("goodput/"): value for key, value in run.data.metrics.items() if key.startswith("goodput/")
    }
    buckets = sum(found[f"{bucket}_s"] for bucket in BUCKETS)
    assert buckets == pytest.approx(found["wall_s"], abs=0.01 * found["legs"]), found
    assert found["fraction"] == pytest.approx(found["train_s"] / found["wall_s"]), found
    assert min(found.values()) >= 0, found
    return found


# --- an S3 server on localhost, for checkpoint.remote (tests/test_remote.py) ----------------------

SECRET = "sekrit-3b9d1e07c4"  # the S3 server's, shown nowhere; the same in every xdist worker (it names tests)
MOTO_LINE = re.compile(r"Running on (http://127\.0\.0\.1:\d+)")


@dataclass
class Server:
    url: str
    process: subprocess.Popen

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The server stops answering, its objects kept (a restart would lose its buckets)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no server outlives a killed pytest


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """moto's S3 server on a free port of localhost, for the session (one per xdist worker), its
    conditional writes atomic as S3's (s3_server.py)."""
    pytest.importorskip("s3fs", reason="pip install -e '.[remote]'")
    pytest.importorskip("moto.server", reason="an S3 server on localhost: pip install -e '.[remote,s3-server]'")
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, Path(__file__).with_name("s3_server.py"), "-H", "127.0.0.1", "-p", "0"],
            stdout=output, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while (found := MOTO_LINE.search(log.read_text())) is None:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"moto's server did not start within 60 s: {log.read_text()}"
            time.sleep(0.02)
        yield Server(found[1], process)
    finally:
        os.kill(process.pid, signal.SIGCONT)
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def s3_env(s3_server: Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment a cloud machine's credentials come from, pointed at the server."""
    values = {
        "AWS_ENDPOINT_URL": s3_server.url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": SECRET,  # moto takes any: a secret that must show nowhere
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(key, raising=False)
    return values


@pytest.fixture
def bucket(s3_env) -> tuple[str, object]:
    """A fresh bucket, and boto3's client: the URL `s3://<bucket>/runs`, and a client that
    sees the store as another program would."""
    import boto3

    name = f"t-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=name)
    return f"s3://{name}/runs", s3


def made_a_fifo(shard: Path) -> str:
    """A data file replaced by a FIFO under a run; returns what the refusal of it names."""
    shard.unlink()
    os.mkfifo(shard)
    return "it is a FIFO now"


def unlinked(shard: Path) -> str:
    """A data file removed under a run; returns what the refusal of it names."""
    shard.unlink()
    return "No such file or directory"
