"""What the order of an epoch costs at any size: the training loader's time to its first batch at
the start of an epoch and at 1%, 50% and 99.9% of it (what a resume waits for), and the memory the
loader takes to get there, from a million to a billion samples, for the order new runs draw
(`feistel`: each step's samples computed as it comes, engine/data/order.py) and the one of checkpoints
from before it (`randperm`: the epoch listed whole), each in a fresh process.

    python bench/data.py [--sizes 1e6,1e7,1e9] [--listed-up-to 1e7]

Targets: the first batch at any position within 1.1x of the epoch's start; memory flat (within a few
MB) from 10^6 to 10^9 samples.
"""

import argparse
import json
import subprocess
import sys
import time

import numpy as np

# One process per measurement, so that each starts from the same memory: a map-style dataset of
# `size` samples that makes each from its index (no data in memory), behind the project's loader.
MEASURE = """
import json, sys, time
import torch
from omegaconf import OmegaConf
from torch.utils.data import Dataset
from {{cookiecutter.package}}.engine.data.loaders import batches, build_loader
from {{cookiecutter.package}}.engine.data.position import Position
from {{cookiecutter.package}}.engine.distributed import World

class Counting(Dataset):
    def __init__(self, size): self.size = size
    def __len__(self): return self.size
    def __getitem__(self, index): return torch.tensor([float(index)]), index % 10

def resident():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

size, fraction, order, repeats = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cfg = OmegaConf.create({"batch_size": 64, "num_workers": 0})
device = OmegaConf.create({"pin_memory": False})
loader = build_loader(Counting(size), cfg, device, seed=0, world=World(torch.device("cpu")))
position = Position(epoch=3, sample=int(size * fraction) // 64 * 64, order=order)
before = resident()
stream = batches(loader, position)  # held, with all it took, while its memory is read
next(stream)
held = resident() - before
del stream
seconds = []
for _ in range(repeats):  # the first batch of a new process, a resume's, without the process's start
    began = time.perf_counter()
    next(batches(loader, position))
    seconds.append(time.perf_counter() - began)
print(json.dumps({"seconds": min(seconds), "bytes": held}))
"""


def measure(size: int, fraction: float, order: str, repeats: int) -> dict:
    command = [sys.executable, "-c", MEASURE, str(size), str(fraction), order, str(repeats)]
    found = subprocess.run(command, capture_output=True, text=True)
    if found.returncode:
        return {"failed": found.stderr.strip().splitlines()[-1]}
    return json.loads(found.stdout)


def indices_per_second() -> float:
    from {{cookiecutter.package}}.engine.data.order import Shuffle

    shuffle, positions = Shuffle(10**9, 0), np.arange(1_000_000)
    began = time.perf_counter()
    shuffle(positions)
    return len(positions) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,1e9")
    parser.add_argument("--listed-up-to", type=float, default=1e7, help="the randperm order past this is skipped")
    parser.add_argument("--repeats", type=int, default=20, help="first batches timed; the least is shown")
    args = parser.parse_args()
    sizes = [int(float(size)) for size in args.sizes.split(",")]
    print(f"order: {indices_per_second() / 1e6:.1f} M indices a second (one core, a billion samples)")
    print("order     samples  position  first batch  ratio  memory")
    for order in ("feistel", "randperm"):
        for size in sizes:
            if order == "randperm" and size > args.listed_up_to:
                continue
            cold = None
            for fraction in (0.0, 0.01, 0.5, 0.999):
                found = measure(size, fraction, order, args.repeats if order == "feistel" else 3)
                if "failed" in found:
                    print(f"{order:8} {size:9.0e}  {fraction:7.1%}  failed: {found['failed']}")
                    break
                seconds, memory = found["seconds"], found["bytes"]
                cold = cold or seconds
                print(
                    f"{order:8} {size:9.0e}  {fraction:7.1%}  {seconds * 1e3:8.2f} ms  {seconds / cold:5.2f}x"
                    f"  {memory / 2**20:7.1f} MiB"
                )


if __name__ == "__main__":
    main()
