"""What the tests' warm parent (tests/warm_parent.py) saves a test that starts a run: the run forked
from a process that has imported torch, Hydra, MLflow's store and the engine, against the same run
in a new interpreter, as a test without it would start it; and forked into a folder whose MLflow
store is made already, as the tests' `project` fixture copies one (conftest.blank_store), against one
whose run makes it (MLflow's migrations).

Starts `python run.py trainer.max_steps=1` (the defaults: MLflow on, its sender a process of its
own, a checkpoint) `--runs` times each way, alternating, and prints each way's median wall seconds
and the CPU seconds its processes took (the run and its sender: the children's CPU time that their
reaper collects, our own for a new interpreter, the warm parent's for a fork), and the ratios.

    python bench/warm_parent.py [--runs 5]
"""

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow import MlflowClient

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT / "tests"))
from warm_parent import WarmParent, WarmPopen  # noqa: E402 (the tests' module, beside this folder)

WAYS = ("new interpreter", "forked", "forked, store made")


def reaped_cpu_s(pid: int | None) -> float:
    """CPU seconds of the children that `pid` (None: this process) has waited for, and theirs."""
    if pid is None:
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")  # cutime, cstime


def one_run(start, reaper: int | None, folder: Path, store: Path | None) -> tuple[float, float]:
    """Wall and CPU seconds of one run, started by `start(command)`, in a folder of its own, where
    `store` (if any) is copied as its mlflow.db first."""
    folder.mkdir()
    if store is not None:
        shutil.copy(store, folder / "mlflow.db")
    command = [sys.executable, "run.py", "trainer.max_steps=1", f"checkpoint.dir={folder}/checkpoints"]
    command += [f"mlflow.tracking_uri=sqlite:///{folder}/mlflow.db", f"hydra.run.dir={folder}/outputs"]
    cpu, began = reaped_cpu_s(reaper), time.monotonic()
    process = start(command)
    if process.wait() != 0:
        raise SystemExit(f"`{' '.join(command)}` exited {process.returncode}")
    return time.monotonic() - began, reaped_cpu_s(reaper) - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs each way")
    args = parser.parse_args()
    os.chdir(PROJECT)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    began = time.monotonic()
    parent = WarmParent()
    # Its first request other than a sender's imports what a run needs besides: its start's too.
    WarmPopen(parent, [sys.executable, "run.py", "--help"], **quiet).wait()
    print(f"the warm parent's start (once per pytest worker): {time.monotonic() - began:.1f} s wall")
    cold = (lambda command: subprocess.Popen(command, **quiet), None)
    forked = (lambda command: WarmPopen(parent, command, **quiet), parent.process.pid)
    taken: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    try:
        with tempfile.TemporaryDirectory() as scratch:
            store = Path(scratch, "mlflow.db")
            MlflowClient(tracking_uri=f"sqlite:///{store}").search_experiments()
            ways = {WAYS[0]: (*cold, None), WAYS[1]: (*forked, None), WAYS[2]: (*forked, store)}
            for number in range(args.runs):
                for index, (way, (start, reaper, made)) in enumerate(ways.items()):
                    taken[way].append(one_run(start, reaper, Path(scratch, f"{index}-{number}"), made))
    finally:
        parent.stop()
    medians = {way: [statistics.median(column) for column in zip(*runs, strict=True)] for way, runs in taken.items()}
    for way, (wall, cpu) in medians.items():
        print(f"{way:>24}: {wall:5.2f} s wall, {cpu:5.2f} CPU-s (median of {args.runs})")
    (cold_wall, cold_cpu), (warm_wall, warm_cpu), (made_wall, made_cpu) = medians.values()
    print(f"forked / new interpreter: {warm_wall / cold_wall:.2f}x wall, {warm_cpu / cold_cpu:.2f}x CPU")
    print(f"forked, store made / forked: {made_wall / warm_wall:.2f}x wall, {made_cpu / warm_cpu:.2f}x CPU")


if __name__ == "__main__":
    main()
