"""Seeds and random-number state: what makes a run repeatable and a resumed run identical to an
unbroken one (dropout masks and any host-side randomness continue where they stopped)."""

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every cuda and xpu device


class RandomState:
    """Every random-number generator of the process, as a checkpoint part (state_dict,
    load_state_dict). The device's generators travel only between devices of the same type."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def state_dict(self) -> dict:
        return capture_rng(self.device)

    def load_state_dict(self, state: dict) -> None:
        restore_rng(state, self.device)


def capture_rng(device: torch.device) -> dict:
    """Every generator's state, as plain values that `torch.load(weights_only=True)` accepts."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()}},
        "torch": torch.get_rng_state(),
    }
    if device.type in ("cuda", "xpu"):
        state["accelerator"] = {"type": device.type, "states": getattr(torch, device.type).get_rng_state_all()}
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    """Restores host generators always, and device generators only when the checkpoint was written
    on the same kind of device: a cuda generator state means nothing to an xpu."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            **numpy_state,
            "state": {**numpy_state["state"], "key": np.array(numpy_state["state"]["key"], dtype=np.uint32)},
        }
    )
    torch.set_rng_state(state["torch"])
    accelerator = state.get("accelerator")
    if accelerator is not None and accelerator["type"] == device.type:
        getattr(torch, device.type).set_rng_state_all(accelerator["states"])
