"""What do atomic, verified checkpoints cost over a bare torch.save / torch.load?

For the demo model and for a model of about 100M parameters (each with its AdamW state), prints
the time of `onefile.save` against a bare `torch.save` of the same state dicts; the stall of
a background save (checkpoint.async_save: the time training waits, for the copy of the state
into reused CPU buffers, while the write goes on in its thread); and `resume.load` +
`load_state_dict` against a bare `torch.load` + `load_state_dict`, as ratios, the restore with
and without its verification (checkpoint.verify). Targets: save at most 1.15x, stall at most
0.25x a bare save (0.1x on a GPU, where the copy goes into pinned memory), restore with
verification at most 1.3x. Ours also fsyncs (a crash must not lose the file) and checks every
record's CRC-32 (a damaged file must not load); the fsync share is printed apart, since it is the
disk's speed rather than this code's. `--device cuda` (or xpu) keeps the model and its AdamW state
on the GPU, as training does: a bare save then copies them off the GPU too.

    python bench/checkpoint_overhead.py [--repeats 5] [--device cpu|cuda|xpu]
"""

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from {{cookiecutter.package}}.engine.checkpoint import onefile, resume
from {{cookiecutter.package}}.engine.checkpoint.background import Snapshot, Writer
from {{cookiecutter.package}}.engine.checkpoint.home import path_of
from {{cookiecutter.package}}.engine.checkpoint.schema import FORMAT_VERSION


def models() -> dict[str, nn.Module]:
    return {
        "demo MLP": nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)),
        "~100M parameters": nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)]),
    }


def settled(device: torch.device) -> None:
    """The device has done what was asked of it: a time read now includes that work."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def fastest(actions: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Each action's best time over `repeats` rounds, to the end of its work on the device. Within
    a round the order rotates, and dirty pages are synced before each timing, so that no action
    pays another's writeback or always runs first."""
    times: dict[str, list[float]] = {name: [] for name in actions}
    names = list(actions)
    for round_ in range(repeats):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            os.sync()
            settled(device)
            started = time.perf_counter()
            actions[name]()
            settled(device)
            times[name].append(time.perf_counter() - started)
    return {name: min(found) for name, found in times.items()}


def measure(name: str, model: nn.Module, folder: Path, repeats: int, device: torch.device) -> str:
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, model[0].in_features, device=device)).sum().backward()
    optimizer.step()  # AdamW state exists only after a step
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    # The small parts of a real checkpoint, which `load` checks are there; beside the weights
    # their size is nothing.
    small = {
        "format_version": FORMAT_VERSION,
        "step": 1,
        "position": {"epoch": 0, "sample": 64},
        "scheduler": {"last_epoch": 1},
        "scaler": {},
        "rng": {"ranks": [{"python": (3, (), None), "numpy": {}, "torch": torch.get_rng_state()}]},
        "probe": {"indices": torch.arange(256), "loss": 0.5},
        "tracker": {"run_id": None},
        "config": {"optimizer": {}, "scheduler": {}, "trainer": {}},
        "device": {"type": device.type},
        "amp": {},
        "versions": {},
    }
    ours = {**small, **state}
    home, bare = folder / "home", folder / "bare.pt"

    def restore(loaded: dict) -> None:
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])

    def fsynced_bare_save() -> None:
        with open(bare, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())

    save = fastest(
        {
            "bare": lambda: torch.save(state, bare),
            "fsynced": fsynced_bare_save,
            "ours": lambda: onefile.save(ours, home, keep_last=1),
        },
        repeats,
        device,
    )
    save_bare, save_fsynced, save_ours = save["bare"], save["fsynced"], save["ours"]
    stall = background_stall(ours, folder / "background", repeats, device)
    ours_path = path_of(home, 1)
    load = fastest(
        {
            "bare": lambda: restore(torch.load(bare, map_location="cpu", weights_only=True)),
            "ours": lambda: restore(resume.load(ours_path).state),
            "trusted": lambda: restore(resume.load(ours_path, verify=False).state),
        },
        repeats,
        device,
    )
    load_bare, load_ours, load_trusted = load["bare"], load["ours"], load["trusted"]
    return (
        f"{name} ({bare.stat().st_size / 1e6:,.1f} MB): save {save_ours * 1000:,.1f} ms vs bare "
        f"{save_bare * 1000:,.1f} ms = {save_ours / save_bare:.2f}x ({save_ours / save_fsynced:.2f}x against a "
        f"bare save that also fsyncs); background save stalls training {stall * 1000:,.1f} ms = "
        f"{stall / save_bare:.2f}x a bare save; restore {load_ours * 1000:,.1f} ms vs bare {load_bare * 1000:,.1f} ms = "
        f"{load_ours / load_bare:.2f}x (without verification {load_trusted / load_bare:.2f}x)"
    )


def background_stall(state: dict, home: Path, repeats: int, device: torch.device) -> float:
    """The best time training waits for a background save, as the Checkpointer starts one: the copy
    into buffers kept from the save before (so not the first; pinned, from a GPU), then the write
    handed over. Each write completes, untimed, before the next."""
    snapshot, writer, stalls = Snapshot(), Writer(), []
    try:
        for _ in range(repeats + 1):
            os.sync()
            settled(device)  # the steps before the save are not its stall
            started = time.perf_counter()
            copy = snapshot.take(state)
            writer.start(functools.partial(onefile.save, copy, home, keep_last=1))
            stalls.append(time.perf_counter() - started)
            writer.wait()
    finally:
        writer.close()
    return min(stalls[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda", "xpu"], default="cpu")
    args = parser.parse_args()
    if args.device != "cpu" and not getattr(torch, args.device).is_available():
        parser.error(f"--device {args.device}: torch.{args.device}.is_available() is False on this machine")
    device = torch.device(args.device)
    torch.manual_seed(0)
    for name, model in models().items():
        with tempfile.TemporaryDirectory() as folder:
            print(f"on {device}: {measure(name, model, Path(folder), args.repeats, device)}")


if __name__ == "__main__":
    main()
