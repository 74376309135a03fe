"""How long does a short run take, start to end, against a hand-written script doing the same?

Runs `python run.py trainer.max_steps=100` (the defaults: MLflow on, checkpoints, validation)
and a plain PyTorch script this file carries (the same data, model, optimizer and steps, one
torch.save at the end, nothing else), each in a fresh interpreter, alternating, and prints the
ratio of their median wall times. Also a 1-step run with MLflow on and off: about the time to the
first training step, plus the end of the run. Target: at most 1.5x (stretch 1.3x).

    python bench/startup.py [--repeats 3] [--steps 100]
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]

# What a user would write by hand for the demo: no config, no tracking, no resume.
PLAIN = """
import sys
import torch
from sklearn.datasets import load_digits
from torch import nn

steps = int(sys.argv[1])
torch.manual_seed(0)
images, labels = load_digits(return_X_y=True)
images = torch.tensor(images, dtype=torch.float32) / 16
labels = torch.tensor(labels)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                      nn.Dropout(0.1), nn.Linear(64, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
for step in range(steps):
    batch = torch.randint(len(images), (64,))
    loss = nn.functional.cross_entropy(model(images[batch]), labels[batch])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "plain.pt")
print(f"loss {loss.item():.4f}")
"""


def timed(command: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"`{' '.join(command[1:])}` failed:\n{result.stderr}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        # A copy of run.py and configs/: mlflow.db and checkpoints/ land in the copy.
        work = Path(folder)
        shutil.copy(PROJECT / "run.py", work / "run.py")
        shutil.copytree(PROJECT / "configs", work / "configs")
        (work / "plain.py").write_text(PLAIN)
        runs = 0

        def ours(steps: int, *overrides: str) -> list[str]:
            nonlocal runs
            runs += 1  # each run its own name: a fresh run, never a resume
            return [sys.executable, "run.py", f"trainer.max_steps={steps}", f"name=startup-{runs}", *overrides]

        commands = {
            "plain script": lambda: [sys.executable, "plain.py", str(args.steps)],
            "run.py": lambda: ours(args.steps),
            "run.py, 1 step": lambda: ours(1),
            "run.py, 1 step, mlflow.enabled=false": lambda: ours(1, "mlflow.enabled=false"),
        }
        timed(ours(1), work)  # creates the MLflow store's tables, as a user's first run did
        times: dict[str, list[float]] = {name: [] for name in commands}
        names = list(commands)
        for round_ in range(args.repeats):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                times[name].append(timed(commands[name](), work))
    median = {name: statistics.median(found) for name, found in times.items()}
    for name, seconds in median.items():
        print(f"{name}: {seconds:.2f} s")
    print(f"run.py / plain script, {args.steps} steps: {median['run.py'] / median['plain script']:.2f}x")


if __name__ == "__main__":
    main()
