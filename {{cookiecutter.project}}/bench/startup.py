"""How long does a short run take, start to end, against a hand-written script doing the same? And
each command, against `import torch`?

Runs `python run.py trainer.max_steps=100` (the defaults: MLflow on, checkpoints, validation)
and a plain PyTorch script this file carries (the same data, model, optimizer and steps, one
torch.save at the end, nothing else), each in a fresh interpreter, alternating, and prints the
ratio of their median wall times; and a 1-step run with MLflow off. Target: at most 1.5x (stretch 1.3x).

Then each command as a person types it, start to end: `run.py` for one step (about the time to the
first training step, plus the end of the run), `eval.py` and `export.py` of a run, and `compare` of
two, each the least of `--repeats` (a busy machine only adds) and that as a multiple of `python -c
"import torch"`; beside them, torch imported and a torch.optim optimizer built, which imports
torch._dynamo (Optimizer.add_param_group is wrapped in torch._disable_dynamo, and step imports it
for graph_break): the floor of any command that trains.

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
from collections.abc import Callable, Iterator
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
    """`folder` with a copy of the scripts and configs/, so that mlflow.db and checkpoints/ land there."""
    for script in ("run.py", "eval.py", "export.py"):
        shutil.copy(PROJECT / script, folder / script)
    shutil.copytree(PROJECT / "configs", folder / "configs")
    return folder


def run_py(name: str, steps: int, *overrides: str) -> list[str]:
    """A run of `steps` steps under `name`: a fresh run each time a new name is given."""
    return [sys.executable, "run.py", f"trainer.max_steps={steps}", f"name={name}", *overrides]


def alternating(commands: dict[str, Callable[[], list[str]]], work: Path, repeats: int) -> dict[str, list[float]]:
    """The wall times of each command (its line made afresh for each start) over `repeats` rounds, each
    round in another order, so that a slow minute of the machine does not fall on one command."""
    found: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            found[name].append(timed(commands[name](), work))
    return found


def started(work: Path, names: Iterator[str]) -> dict[str, Callable[[], list[str]]]:
    """Each command as a person types it, over the runs `startup-0` and `startup-1` (`main` trains them
    first); a run's name and an export's file new at each start."""
    python, exports = sys.executable, itertools.count()
    return {
        "import torch": lambda: [python, "-c", "import torch"],
        "import torch, an optimizer built": lambda: [python, "-c", OPTIMIZER],
        "run.py, 1 step": lambda: run_py(next(names), 1),
        "eval.py": lambda: [python, "eval.py", "name=startup-0"],
        "export.py": lambda: [python, "export.py", "name=startup-0", f"out=export-{next(exports)}.safetensors"],
        "compare": lambda: [python, "-m", "{{cookiecutter.package}}.engine.compare", "startup-0", "startup-1"],
    }


# The least a command that trains imports: torch, and torch._dynamo, which torch.optim imports.
OPTIMIZER = "import torch; torch.optim.AdamW([torch.zeros(1, requires_grad=True)])"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        work = workspace(Path(folder))
        (work / "plain.py").write_text(PLAIN)
        names = (f"startup-{number}" for number in itertools.count())  # a fresh run each time, never a resume
        # startup-0 and startup-1, which eval.py, export.py and compare read; the first creates the
        # MLflow store's tables, as a user's first run did.
        timed(run_py(next(names), 1), work)
        timed(run_py(next(names), 1, "optimizer.lr=1e-3"), work)
        short = {
            "plain script": lambda: [sys.executable, "plain.py", str(args.steps)],
            "run.py": lambda: run_py(next(names), args.steps),
            "run.py, 1 step, mlflow.enabled=false": lambda: run_py(next(names), 1, "mlflow.enabled=false"),
        }
        median = {name: statistics.median(times) for name, times in alternating(short, work, args.repeats).items()}
        least = {name: min(times) for name, times in alternating(started(work, names), work, args.repeats).items()}
    for name, seconds in median.items():
        print(f"{name}: {seconds:.2f} s")
    print(f"run.py / plain script, {args.steps} steps: {median['run.py'] / median['plain script']:.2f}x")
    print(f"\neach command's start to end, the least of {args.repeats}, against import torch:")
    for name, seconds in least.items():
        print(f"{name}: {seconds:.2f} s, {seconds / least['import torch']:.2f}x")


if __name__ == "__main__":
    main()
