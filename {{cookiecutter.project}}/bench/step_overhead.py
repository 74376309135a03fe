"""What does a training step cost in the runner, against the same step written by hand?

Times the steps after the first 200 (by then the MLflow run is open and the first saves are
done: start-up, which bench/startup.py measures) of `python run.py` with its defaults (MLflow on,
a checkpoint and a validation every 100 steps, the loss logged every 10, progress), from the
times MLflow holds for its logged losses, and of the two hand-written loops of bench/startup.py,
on the same data, model and optimizer, which do nothing else: one over a DataLoader, as most
loops are written, and one indexing the tensors, the least a step can cost. Each in a fresh
interpreter, alternating, medians of `--repeats`. Target: run.py / DataLoader loop <= 1.02x.

    python bench/step_overhead.py [--repeats 3] [--steps 2200]
"""

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

from mlflow import MlflowClient
from startup import DATALOADER, PLAIN, alternating, run, run_py, workspace

WARM_UP = 200  # steps left out of the timing


def step_ms(ended: dict[int, float], last: int) -> float:
    """Milliseconds a step from step WARM_UP to step `last`, from the times (in seconds) at which
    steps ended, each read once the device had done the step's work: how every benchmark here
    times a step, of a hand-written loop or of run.py."""
    return 1000 * (ended[last] - ended[WARM_UP]) / (last - WARM_UP)


def loop_ms(command: list[str], steps: int, cwd: Path) -> float:
    """Milliseconds a step of a hand-written loop, from the `step N ended at T` lines it prints
    every 100 steps."""
    ended = {}
    for line in run(command, cwd).splitlines():
        if line.startswith("step "):
            _, step, *_, seconds = line.split()
            ended[int(step)] = float(seconds)
    return step_ms(ended, steps)


def runner_ms(name: str, steps: int, cwd: Path, *overrides: str) -> float:
    """Milliseconds a step of `python run.py`, from the times its logged losses were taken (after
    `loss.item()`, which waits for the device). Its run is the store's newest: runs here go one at
    a time."""
    run(run_py(name, steps, *overrides), cwd)
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    everywhere = [experiment.experiment_id for experiment in client.search_experiments()]
    (found,) = client.search_runs(everywhere, order_by=["attributes.start_time DESC"], max_results=1)
    taken = client.get_metric_history(found.info.run_id, "train/loss")
    return step_ms({metric.step: metric.timestamp / 1000 for metric in taken}, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2200, help=f"a multiple of 100 above {WARM_UP}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = workspace(Path(folder))
        (work / "dataloader.py").write_text(DATALOADER)
        (work / "indexed.py").write_text(PLAIN)
        names = (f"steps-{number}" for number in itertools.count())  # a fresh run each time, never a resume

        def loop(script: str) -> float:
            return loop_ms([sys.executable, script, str(args.steps)], args.steps, work)

        measured = alternating(
            {
                "run.py": lambda: runner_ms(next(names), args.steps, work),
                "DataLoader loop": lambda: loop("dataloader.py"),
                "indexed loop": lambda: loop("indexed.py"),
            },
            args.repeats,
        )
    for name, milliseconds in measured.items():
        print(f"{name}: {milliseconds:.3f} ms a step")
    print(f"run.py / DataLoader loop: {measured['run.py'] / measured['DataLoader loop']:.2f}x (target <= 1.02)")
    print(f"run.py / indexed loop: {measured['run.py'] / measured['indexed loop']:.2f}x")


if __name__ == "__main__":
    main()
