"""The default bake, with a team's own defaults in its configs, is a working project: it installs,
passes its own suite, lints clean, and trains and resumes its second model from the command line."""

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from own_defaults import choose_own_defaults

# Bounds a hung generated suite so CI fails with output instead of stalling.
TIMEOUT_S = 3600


def run(
    command: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a command in the bake; on failure show its output, which is the only diagnosis."""
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    if result.returncode != 0:
        pytest.fail(
            f"`{' '.join(command)}` exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def run_shown(
    command: list[str], cwd: Path, env: dict[str, str], capsys: pytest.CaptureFixture[str], log: str
) -> None:
    """Run the bake's own suite, which takes many minutes, with its progress shown as it comes
    (past pytest's capture, where pytest runs in one process), so that `make test` never looks
    hung, and kept as `log` in CI's folder (CONTINUUM_CI_DIR, see `stage`); on failure, as `run`."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    watchdog = watched(process)
    output = bytearray()
    folder = os.environ.get("CONTINUUM_CI_DIR")
    kept = open(Path(folder, log), "wb") if folder else contextlib.nullcontext()  # noqa: SIM115
    try:
        with capsys.disabled(), kept:
            print(f"\n`{' '.join(command[1:])}` in the bake:", flush=True)
            while chunk := os.read(process.stdout.fileno(), 4096):
                output += chunk
                if folder:
                    kept.write(chunk)
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
    finally:
        watchdog.cancel()
    if process.wait() != 0:
        pytest.fail(
            f"`{' '.join(command)}` exited {process.returncode}\n{output.decode(errors='replace')}"
        )


def watched(process: subprocess.Popen) -> threading.Timer:
    """A bound on a suite, started: past TIMEOUT_S it is interrupted as Ctrl-C would, so that pytest
    names the failures it has seen so far (a killed suite names none), and killed a minute later if
    it has not ended by then."""

    def interrupt() -> None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()

    watchdog = threading.Timer(TIMEOUT_S, interrupt)
    watchdog.start()
    return watchdog


def run_beside(
    name: str, command: list[str], cwd: Path, env: dict[str, str], folder: Path, log: str
) -> Callable[[pytest.CaptureFixture[str]], None]:
    """Starts `command` now, its output going to `log` (in CI's folder, else in `folder`); returns
    the wait for its end, which shows that output and fails as `run` does. It is timed as the stage
    `name` from now to its own end, not to the wait's."""
    path = Path(os.environ.get("CONTINUUM_CI_DIR") or folder, log)
    with open(path, "wb") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT
        )
    watchdog = watched(process)
    began = time.monotonic()
    timed = threading.Thread(target=lambda: (process.wait(), record_stage(name, began)))
    timed.start()

    def wait(capsys: pytest.CaptureFixture[str]) -> None:
        timed.join()
        watchdog.cancel()
        shown = path.read_text(errors="replace")
        with capsys.disabled():
            print(f"\n`{' '.join(command[1:])}` in the bake, beside the rest:\n{shown}", flush=True)
        if process.returncode != 0:
            pytest.fail(f"`{' '.join(command)}` exited {process.returncode}\n{shown}")

    return wait


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Times a stage of CI's (record_stage)."""
    began = time.monotonic()
    yield
    record_stage(name, began)


def record_stage(name: str, began: float) -> None:
    """A stage of CI's, begun at `began` (time.monotonic()), has ended: .ci/run names a folder in
    CONTINUUM_CI_DIR, and prints as it ends the seconds of each stage (its file `stages`) and the
    slowest tests of each suite's log."""
    if folder := os.environ.get("CONTINUUM_CI_DIR"):
        with open(Path(folder, "stages"), "a") as stages:
            stages.write(f"{time.monotonic() - began:6.0f} s  {name}\n")


def files_of(project: Path) -> set[Path]:
    """The project's files and folders, less the caches Python and ruff keep beside the code."""
    caches = {"__pycache__", ".ruff_cache"}
    return {
        path.relative_to(project)
        for path in project.rglob("*")
        if not caches & set(path.relative_to(project).parts)
    }


def in_parallel() -> list[str]:
    """pytest-xdist's options for the bake's suite: its tests wait for a subprocess most of the
    time, and each keeps to folders, stores and ports of its own (ports of the kernel's choosing),
    so two or more run side by side; work stealing keeps the workers busy to the end."""
    if importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(min(4, max(2, os.cpu_count() or 2))), "--dist", "worksteal"]


@pytest.mark.slow
def test_a_bake_with_its_users_own_defaults_installs_passes_its_own_tests_and_lints_clean(
    bake: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every group's defaults changed where a user changes them (own_defaults.py): the tests that
    ship with a project hold the engine to its contracts, never to a value the user is meant to
    change, and leave the project as they found it (a test's runs, stores and artifacts go to its
    own folders). The stock defaults are the generated README's, whose chain runs `pytest` in a
    stock bake (test_readmes.py)."""
    project = bake(tmp_path)
    choose_own_defaults(project)
    # The venv already holds every runtime dependency and setuptools; no network needed.
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    run([*pip, "-e", str(project)], cwd=project)
    # The READMEs' tests install bakes of their own into this venv meanwhile, each taking the
    # editable install's name: this bake's engine comes first on the path of all that runs here.
    own = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(project / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    before = files_of(project)
    suite = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=30"]
    # The SLURM tier in one process of its own: it starts one cluster, where each worker would
    # start its own on the same ports (it skips, saying why, where it cannot start one). Its jobs
    # wait on SLURM's clock most of their minutes, so it runs beside the rest of the suite.
    slurm = run_beside(
        "the bake's SLURM tier: pytest -m slurm (beside --all)",
        [*suite, "-rs", "-m", "slurm"],
        project,
        own,
        tmp_path,
        "bake-slurm.log",
    )
    with stage("the bake's suite: pytest --all"):
        run_shown([*suite, "--all", *in_parallel()], project, own, capsys, "bake-all.log")
    slurm(capsys)
    written = sorted(map(str, files_of(project) - before))
    assert not written, f"the bake's suite wrote into the project it tests: {written[:5]}"
    run([sys.executable, "-m", "ruff", "check", "."], cwd=project)
    run([sys.executable, "-m", "ruff", "format", "--check", "."], cwd=project)
    # The second model, a class and a YAML file only, from the command line: half of its schedule,
    # then a resume that the continuity check finds exact.
    cnn = [
        sys.executable,
        "run.py",
        "model=cnn",
        "scheduler.total_steps=40",
        "mlflow.enabled=false",
    ]
    run([*cnn, "trainer.max_steps=20"], cwd=project, env=own)
    resumed = run([*cnn, "trainer.max_steps=40", "resume=last"], cwd=project, env=own)
    assert "resumed at step 20 on cpu" in resumed.stdout and "(ok)" in resumed.stdout
