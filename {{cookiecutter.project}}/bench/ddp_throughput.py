"""What does strategy=ddp buy on this machine, and what does the per-step stop agreement cost?

Trains with run.py itself, one process against two under torchrun (gloo, one thread each, the
same global batch), on the demo MLP and on a wide one whose gradient all-reduce is large, and
prints the global samples per second of each (the median of the logged windows, past the first
quarter) and their ratio. Then times the stop agreement (`Preemption.agreed`: a one-element
all-reduce at every step) in a two-process group, as a share of a demo step.

    python bench/ddp_throughput.py [--steps 300]

On a 2-core machine two processes share the cores with the MLflow sender and the data loading,
so a ratio near 1 is what to expect here; on GPUs, each process has its own device.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from mlflow import MlflowClient

PROJECT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
MODELS = {"demo MLP": [], "wide MLP (~9M parameters)": ["model.hidden_sizes=[2048,2048,2048]"]}


def samples_per_s(launch: list[str], settings: list[str], store: Path, name: str) -> float:
    common = ["device=cpu", "device.cpu_threads=1", "trainer.log_every_n_steps=10", "checkpoint.every_n_steps=100000"]
    uri = f"sqlite:///{store / 'mlflow.db'}"
    command = [*launch, "run.py", *common, *settings, f"name={name}", f"mlflow.tracking_uri={uri}"]
    command.append(f"checkpoint.dir={store / name}")
    subprocess.run(command, cwd=PROJECT, check=True, capture_output=True)
    client = MlflowClient(uri)
    everywhere = [experiment.experiment_id for experiment in client.search_experiments()]
    (run,) = client.search_runs(everywhere, f"params.name = '{name}'")
    windows = [metric.value for metric in client.get_metric_history(run.info.run_id, "train/samples_per_s")]
    return statistics.median(windows[len(windows) // 4 :])


def stop_agreement_cost() -> None:
    """Run by torchrun: the time of one agreement, as rank 0 sees it."""
    from {{cookiecutter.package}}.engine.distributed import World
    from {{cookiecutter.package}}.engine.lifecycle.preemption import Preemption

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = World(torch.device("cpu"), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), 2, "gloo")
    preemption = Preemption()
    for _ in range(100):  # warm-up
        preemption.agreed(world)
    started = time.perf_counter()
    for _ in range(2000):
        preemption.agreed(world)
    if world.is_main:
        print(f"{(time.perf_counter() - started) / 2000 * 1e6:.1f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--agreement", action="store_true", help=argparse.SUPPRESS)  # the torchrun worker
    args = parser.parse_args()
    if args.agreement:
        stop_agreement_cost()
        return
    steps = [f"trainer.max_steps={args.steps}", "model.dropout=0"]
    print(f"{'model':28} {'1 process':>12} {'2 processes':>12} {'ratio':>7}   (global samples/s)")
    demo_step_ms = None
    with tempfile.TemporaryDirectory() as folder:
        for number, (label, model) in enumerate(MODELS.items()):
            store = Path(folder) / str(number)  # a store of its own: MLflow keeps a store's connection open
            store.mkdir()
            one = samples_per_s([sys.executable], [*steps, *model, "data.batch_size=64"], store, "one")
            two = samples_per_s(TORCHRUN, [*steps, *model, "strategy=ddp", "data.batch_size=32"], store, "two")
            print(f"{label:28} {one:12.0f} {two:12.0f} {two / one:7.2f}")
            demo_step_ms = demo_step_ms or 1000 * 64 / two
    agreement = subprocess.run(
        [*TORCHRUN, str(Path(__file__).resolve()), "--agreement"], check=True, capture_output=True, text=True
    )
    microseconds = float(agreement.stdout.split()[-1])
    print(
        f"stop agreement: {microseconds:.0f} us a step, {microseconds / 10 / demo_step_ms:.2f}% of a demo ddp step "
        f"({demo_step_ms:.2f} ms)"
    )


if __name__ == "__main__":
    main()
