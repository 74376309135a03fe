"""Does MLflow logging slow training down? One number answers it.

Trains the demo with `trainer.log_every_n_steps=1` into a fresh sqlite store, and again with
`mlflow.enabled=false`, alternating the two, and prints the ratio of their median training
steps per second (start-up and the checkpoint at the end excluded). The target is at most 1.05.

    python bench/logging_overhead.py [--steps 2000] [--repeats 3] [key=value ...]
"""

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

from {{cookiecutter.package}}.engine.train import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def steps_per_s(folder: Path, overrides: list[str]) -> float:
    store = f"sqlite:///{folder / 'mlflow.db'}"
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(
            "config", [f"checkpoint.dir={folder / 'checkpoints'}", f"mlflow.tracking_uri={store}", *overrides]
        )
    return train(cfg)["train/mean_steps_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="more config overrides, e.g. device=cuda")
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # No save among the timed steps, only the last one, after them: saves are
    # bench/checkpoint_overhead.py's to time, and the first one waits for the MLflow sender to
    # have opened the run (start-up, bench/startup.py's).
    common = [
        f"trainer.max_steps={arguments.steps}",
        "trainer.log_every_n_steps=1",
        f"checkpoint.every_n_steps={arguments.steps + 1}",
        *arguments.overrides,
    ]
    runs: dict[str, list[float]] = {"mlflow off": [], "mlflow on": []}
    for _ in range(arguments.repeats):
        for name, switch in (("mlflow off", "mlflow.enabled=false"), ("mlflow on", "mlflow.enabled=true")):
            with tempfile.TemporaryDirectory() as folder:
                runs[name].append(steps_per_s(Path(folder), [*common, switch]))
    off, on = (statistics.median(values) for values in runs.values())
    for name, values in runs.items():
        print(
            f"{name:>10}: {', '.join(f'{value:,.0f}' for value in values)} steps/s (median {statistics.median(values):,.0f})"
        )
    print(f"slowdown from logging every step: {off / on:.3f}x (target <= 1.05)")


if __name__ == "__main__":
    main()
