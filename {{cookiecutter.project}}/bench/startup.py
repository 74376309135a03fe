"""How long does a short run take, start to end, against a hand-written script doing the same?

Runs `python run.py trainer.max_steps=100` (the defaults: MLflow on, checkpoints, validation)
and a plain PyTorch script this file carries (the same data, model, optimizer and steps, one
torch.save at the end, nothing else), each in a fresh interpreter, alternating, and prints the
ratio of their median wall times. Also a 1-step run with MLflow on and off: about the time to the
first training step, plus the end of the run. Target: at most 1.5x (stretch 1.3x).

    python bench/startup.py [--repeats 3] [--steps 100]
"""

import argparse
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]

# What a user would write by hand for the demo: no config, no tracking, no resume. BATCHES is an
# endless stream of (inputs, targets), 64 samples each.
SCRIPT = """
import itertools
import sys
import time
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

steps = int(sys.argv[1])
torch.manual_seed(0)
images, labels = load_digits(return_X_y=True)
images = torch.tensor(images, dtype=torch.float32) / 16
labels = torch.tensor(labels)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                      nn.Dropout(0.1), nn.Linear(64, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
for step, (inputs, targets) in enumerate(itertools.islice(BATCHES, steps), start=1):
    loss = nn.functional.cross_entropy(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    if step % 100 == 0:  # how bench/step_overhead.py times the steps
        print(f"step {step} ended at {time.perf_counter()}")
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "plain.pt")
print(f"loss {loss.item():.4f}")
"""
# Indexing the tensors with a random batch of indices: the least a step can cost.
PLAIN = SCRIPT.replace(
    "BATCHES", "((images[i], labels[i]) for i in iter(lambda: torch.randint(len(images), (64,)), None))"
)
# Over a DataLoader, as most loops are written: it fetches the samples one at a time and stacks them.
DATALOADER = SCRIPT.replace(
    "BATCHES",
    "(batch for _ in itertools.count() "
    "for batch in DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=True, drop_last=True))",
)


def run(command: list[str], cwd: Path) -> str:
    """What `command` prints; a failure ends the benchmark with its error."""
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"`{' '.join(command[1:])}` failed:\n{result.stderr}")
    return result.stdout


def timed(command: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    run(command, cwd)
    return time.perf_counter() - started


def workspace(folder: Path) -> Path:
    """`folder` with a copy of run.py and configs/, so that mlflow.db and checkpoints/ land there."""
    shutil.copy(PROJECT / "run.py", folder / "run.py")
    shutil.copytree(PROJECT / "configs", folder / "configs")
    return folder


def run_py(name: str, steps: int, *overrides: str) -> list[str]:
    """A run of `steps` steps under `name`: a fresh run each time a new name is given."""
    return [sys.executable, "run.py", f"trainer.max_steps={steps}", f"name={name}", *overrides]


def alternating(measures: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """The median of what each measure returns over `repeats` rounds, each round in another order,
    so that a slow minute of the machine does not fall on one measure."""
    found: dict[str, list[float]] = {name: [] for name in measures}
    names = list(measures)
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            found[name].append(measures[name]())
    return {name: statistics.median(values) for name, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = workspace(Path(folder))
        (work / "plain.py").write_text(PLAIN)
        names = (f"startup-{number}" for number in itertools.count())  # a fresh run each time, never a resume
        commands = {
            "plain script": lambda: [sys.executable, "plain.py", str(args.steps)],
            "run.py": lambda: run_py(next(names), args.steps),
            "run.py, 1 step": lambda: run_py(next(names), 1),
            "run.py, 1 step, mlflow.enabled=false": lambda: run_py(next(names), 1, "mlflow.enabled=false"),
        }
        timed(run_py(next(names), 1), work)  # creates the MLflow store's tables, as a user's first run did
        median = alternating(
            {name: lambda command=command: timed(command(), work) for name, command in commands.items()}, args.repeats
        )
    for name, seconds in median.items():
        print(f"{name}: {seconds:.2f} s")
    print(f"run.py / plain script, {args.steps} steps: {median['run.py'] / median['plain script']:.2f}x")


if __name__ == "__main__":
    main()
