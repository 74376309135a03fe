"""What does a sharded checkpoint (strategy=fsdp) cost over bare torch.distributed.checkpoint?

Shards an MLP over two processes (FSDP2, gloo, CPU) with AdamW state, then times, alternating
within one run so that both sides see the same machine:
- save: the project's (shards, their checksums, state.pt, fsyncs, the rename, `latest`) against a
  bare `dcp.save` of the same model and optimizer state;
- restore: the project's (checksums verified, restricted metadata unpickler, `dcp.load`, set
  into the model) against a bare `dcp.load` + `set_state_dict`;
- the stall of the project's background save (`checkpoint.async_save`: the copy into buffers kept
  from the save before, then the write handed to a thread), and that of a bare `dcp.async_save`,
  each until training could go on, against the synchronous `dcp.save`.
It prints the medians and their ratios.

    python bench/sharded_checkpoint.py [--width 4096] [--repeats 5]

It starts itself under torchrun. The default width gives ~50M parameters (~600 MB with AdamW).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from {{cookiecutter.package}}.engine.checkpoint import sharded
from {{cookiecutter.package}}.engine.checkpoint.background import Snapshot, Writer
from {{cookiecutter.package}}.engine.checkpoint.home import path_of
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.checkpoint.schema import FORMAT_VERSION
from {{cookiecutter.package}}.engine.distributed import World


def timed(times: list[float], work, *arguments, **keywords):
    """Appends to `times` how long `work(...)` takes on the slowest process, and returns its result.
    Dirty pages are written out first, so that no operation pays for the previous one's writes."""
    os.sync()
    dist.barrier()
    started = time.perf_counter()
    result = work(*arguments, **keywords)
    dist.barrier()
    times.append(time.perf_counter() - started)
    return result


def measure(width: int, repeats: int, scratch: Path) -> None:
    dist.init_process_group("gloo")
    world = World(torch.device("cpu"), dist.get_rank(), dist.get_rank(), dist.get_world_size(), "gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(3)))
    mesh = init_device_mesh("cpu", (world.size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()  # the optimizer's state exists, as in a checkpoint taken mid-run
    home = Path(world.broadcast(str(scratch)))
    keys = ("bare save", "save", "bare restore", "restore", "background stall", "async stall")
    times: dict[str, list[float]] = {key: [] for key in keys}
    # The background save's collectives get a group of their own: sharing the default one with the
    # barriers of the training thread deadlocks.
    background = (Snapshot(), Writer(), sharded.background_group(timeout_s=600))

    def ours_save(step: int) -> None:
        # Retention happens outside the timing (keep_last=repeats), as the bare side's deletion does.
        sharded.save(minimal_state(step), model, optimizer, home, repeats, world)

    def ours_background(step: int) -> sharded.Pending:
        return sharded.begin(minimal_state(step), model, optimizer, home, world, background)

    def ours_restore(step: int) -> None:
        path = path_of(home, step, folder=True)
        saved = load(path, verify=world.is_main)  # rank 0 verifies, as a restore does
        sharded.load_into(model, optimizer, saved)

    def state_now() -> dict:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def bare_save(folder: Path) -> None:
        dcp.save(state_now(), checkpoint_id=folder)

    def start_async_save(folder: Path):
        return dcp.async_save(state_now(), checkpoint_id=folder, process_group=background[2])

    def bare_restore(folder: Path) -> None:
        state = state_now()
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    for step in range(1, repeats + 1):
        bare = home / f"bare-{step}"
        # Each pair in turns, bare first then ours first: neither always follows the other.
        pairs = [
            [(times["bare save"], bare_save, bare), (times["save"], ours_save, step)],
            [(times["bare restore"], bare_restore, bare), (times["restore"], ours_restore, step)],
        ]
        for pair in pairs:
            for measured in pair if step % 2 else reversed(pair):
                timed(*measured)
        pending = timed(times["async stall"], start_async_save, home / f"async-{step}")
        pending.result()
        # Its own steps, after those of `ours_save`: the background writes fill buffers kept from
        # the write before, as a run's do from its second save on.
        sharded.finish(
            timed(times["background stall"], ours_background, repeats + step), background[1], home, 2 * repeats, world
        )
        if world.is_main:
            shutil.rmtree(bare)
            shutil.rmtree(path_of(home, step, folder=True))
    if world.is_main:
        median = {key: statistics.median(values) for key, values in times.items()}
        parameters = sum(p.numel() for p in model.parameters())
        print(f"{parameters / 1e6:.0f}M parameters with AdamW state, 2 processes (gloo, CPU), median of {repeats}:")
        for key, value in median.items():
            print(f"  {key:13} {value * 1000:8.1f} ms")
        print(f"save / bare dcp.save:                {median['save'] / median['bare save']:.2f}x (target <= 1.15x)")
        print(
            f"restore / bare dcp.load:             {median['restore'] / median['bare restore']:.2f}x (target <= 1.15x)"
        )
        print(
            f"background save stall / dcp.save:   {median['background stall'] / median['bare save']:.2f}x "
            f"(target <= 0.25x)"
        )
        print(f"bare dcp.async_save stall / dcp.save: {median['async stall'] / median['bare save']:.2f}x")
    background[1].close()
    dist.destroy_process_group()


def minimal_state(step: int) -> dict:
    """What state.pt holds beside the shards' checksums, in form: next to the shards its parts are small."""
    parts = {
        "scheduler": {"last_epoch": step},
        "scaler": {},
        "position": {"epoch": 0, "sample": 0},
        "probe": {"indices": torch.arange(256), "loss": 0.0},
        "tracker": {"run_id": None},
        "rng": {"ranks": []},
    }
    meta = {"config": {}, "device": {"type": "cpu"}, "amp": {}, "versions": {}}
    return {"format_version": FORMAT_VERSION, "step": step, **meta, **parts}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    arguments = parser.parse_args()
    if "RANK" in os.environ:
        measure(arguments.width, arguments.repeats, Path(os.environ["BENCH_SCRATCH"]))
    else:
        with tempfile.TemporaryDirectory() as scratch:
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
            environment = {**os.environ, "BENCH_SCRATCH": scratch, "OMP_NUM_THREADS": "1"}
            subprocess.run([*command, *sys.argv[1:]], env=environment, check=True)
