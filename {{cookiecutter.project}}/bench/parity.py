"""Is a step of the runner as fast as the same step written by hand, on this device?

For the demo MLP on the digits and for the GPT of models.py (`experiment=char_lm`, its sizes by
flag), times the steps after the first 200 of `python run.py`, with the defaults' validation and
saves (every 100 steps) and without any in the window, against two hand-written loops of the same
model, data, optimizer (AdamW, fused with `--fused`) and precision (`--amp`) that do nothing else:
one that indexes the tensors on the device, the least a step can cost, and one over a DataLoader
(pinned and non_blocking on an accelerator), as most loops are written. The runner's steps are
timed from the times MLflow holds for its logged losses, the loops' from the times they print,
each taken once the device has caught up (bench/step_overhead.py). Each in a fresh interpreter,
alternating, medians of `--repeats`. Targets (issue 36, on a GPU): the GPT <= 1.02x the indexed
loop without validation or saves, <= 1.05x with the defaults; the MLP <= 1.05x the DataLoader loop.

    python bench/parity.py --device cuda --amp bf16 --fused --width 512 --depth 8 --heads 8 --block 256 --batch 64
    python bench/parity.py --device cpu --models mlp --repeats 5
"""

import argparse
import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
from startup import alternating, workspace
from step_overhead import WARM_UP, loop_ms, runner_ms

# The loop a user would write around the project's own model and data: the same classes run.py
# builds, with the same settings, and nothing but the steps.
LOOP = """
import itertools
import json
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from {{cookiecutter.package}} import datasets, models

spec = json.loads(sys.argv[1])
device, steps = torch.device(spec["device"]), spec["steps"]
torch.set_num_threads(max(1, torch.get_num_threads() - 1))  # as run.py does: one core left to the rest
torch.manual_seed(0)
if spec["model"] == "mlp":
    data = datasets.digits(val_fraction=0.2)
    model = models.MLP(input_shape=[1, 8, 8], num_classes=10, hidden_sizes=[128, 64], dropout=0.1)
    batch = 64
else:
    data = datasets.python_source(block_size=spec["block"], max_chars=spec["max_chars"], val_fraction=0.1)
    model = models.GPT(data.facts["vocab_size"], spec["block"], spec["width"], spec["depth"], spec["heads"], 0.1)
    batch = spec["batch"]
inputs, targets = data.train.tensors
model.to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=spec["fused"] or None)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
if spec["feed"] == "indexed":
    inputs, targets = inputs.to(device), targets.to(device)
    batches = ((inputs[i], targets[i]) for i in iter(lambda: torch.randint(len(inputs), (batch,), device=device), None))
else:
    accelerated = device.type != "cpu"
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=batch, shuffle=True, drop_last=True,
                        pin_memory=accelerated)
    batches = ((x.to(device, non_blocking=accelerated), y.to(device, non_blocking=accelerated))
               for _ in itertools.count() for x, y in loader)
dtype = {"off": None, "bf16": torch.bfloat16}[spec["amp"]]
for step, (x, y) in enumerate(itertools.islice(batches, steps), start=1):
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    if step % 100 == 0:
        loss.item()  # the device has caught up: the time is the step's end, as run.py's logged losses' are
        print(f"step {step} ended at {time.perf_counter()}")
"""

QUIET = 10**9  # validation and saves every this many steps: none in the window
FEEDS = {"indexed": "hand-written, indexed on the device", "loader": "hand-written, DataLoader"}
GPT_SIZES = ("width", "depth", "heads")  # run.py's model.<size>; block and batch are the data's
RUNNERS = {"defaults": "run.py, defaults (validation and save every 100 steps)", "quiet": "run.py, none in the window"}


def runner_overrides(spec: dict) -> list[str]:
    """run.py's settings for what `spec` describes: the model, its data, precision and optimizer."""
    fused = "true" if spec["fused"] else "null"
    overrides = [f"device={spec['device']}", f"amp={spec['amp']}", f"optimizer.fused={fused}"]
    overrides += ["trainer.log_every_n_steps=10"]
    if spec["model"] == "gpt":
        overrides += ["experiment=char_lm", f"data.max_chars={spec['max_chars']}", f"data.block_size={spec['block']}"]
        overrides += [f"data.batch_size={spec['batch']}", *(f"model.{key}={spec[key]}" for key in GPT_SIZES)]
    return overrides


def describe(spec: dict) -> str:
    model = "MLP on the digits, batch 64"
    if spec["model"] == "gpt":
        model = f"GPT width {spec['width']}, depth {spec['depth']}, {spec['heads']} heads, {spec['block']} tokens"
        model += f", batch {spec['batch']}"
    return f"{model}, amp {spec['amp']}, {'fused ' if spec['fused'] else ''}AdamW, on {spec['device']}"


def measure(spec: dict, work: Path, repeats: int) -> dict[str, float]:
    names = (f"parity-{spec['model']}-{number}" for number in itertools.count())  # a fresh run each time
    quiet = [f"trainer.val_every_n_steps={QUIET}", f"checkpoint.every_n_steps={QUIET}"]
    base, steps = runner_overrides(spec), spec["steps"]
    loop = [sys.executable, "loop.py"]
    measures = {
        label: lambda feed=feed: loop_ms([*loop, json.dumps({**spec, "feed": feed})], steps, work)
        for feed, label in FEEDS.items()
    }
    measures[RUNNERS["quiet"]] = lambda: runner_ms(next(names), steps, work, *base, *quiet)
    measures[RUNNERS["defaults"]] = lambda: runner_ms(next(names), steps, work, *base)
    return alternating(measures, repeats)


def report(spec: dict, measured: dict[str, float], repeats: int) -> str:
    lines = [f"{describe(spec)}: ms a step over steps {WARM_UP}-{spec['steps']}, median of {repeats}"]
    loops = {feed: measured[label] for feed, label in FEEDS.items()}
    for label, milliseconds in measured.items():
        line = f"  {label}: {milliseconds:.3f}"
        if label in RUNNERS.values():
            line += " = " + ", ".join(f"{milliseconds / loops[feed]:.2f}x {feed}" for feed in FEEDS)
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda", "xpu"], default="cpu")
    parser.add_argument("--models", nargs="+", choices=["mlp", "gpt"], default=["mlp", "gpt"])
    parser.add_argument("--amp", choices=["off", "bf16"], default="off")
    parser.add_argument("--fused", action="store_true", help="fused AdamW (optimizer.fused=true)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000, help=f"a multiple of 100 above {WARM_UP}")
    sizes = parser.add_argument_group("the GPT (experiment=char_lm's by default)")
    for flag, default in (("width", 64), ("depth", 2), ("heads", 4), ("block", 64), ("batch", 32)):
        sizes.add_argument(f"--{flag}", type=int, default=default)
    sizes.add_argument("--max-chars", type=int, default=1_000_000, help="of the standard library's source")
    args = parser.parse_args()
    if args.steps % 100 or args.steps <= WARM_UP:
        parser.error(f"--steps must be a multiple of 100 above {WARM_UP}")
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        parser.error(f"--device {args.device}: torch.{args.device}.is_available() is False on this machine")
    common = {key: value for key, value in vars(args).items() if key not in ("models", "repeats")}
    with tempfile.TemporaryDirectory() as folder:
        work = workspace(Path(folder))
        (work / "loop.py").write_text(LOOP)
        for model in args.models:
            spec = {**common, "model": model}
            print(report(spec, measure(spec, work, args.repeats), args.repeats), flush=True)


if __name__ == "__main__":
    main()
