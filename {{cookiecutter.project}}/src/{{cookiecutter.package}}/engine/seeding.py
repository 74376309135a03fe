"""Seeds and random-number state: what makes a run repeatable and a resumed run identical to an
unbroken one (dropout masks and any host-side randomness continue where they stopped)."""

import logging
import random

import numpy as np
import torch

from .distributed import World

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every cuda and xpu device


class RandomState:
    """Every random-number generator of every process, as a checkpoint part (state_dict,
    load_state_dict; both collective steps). Rank r gets back the state rank r saved; a rank the
    checkpoint has no state for (a resume on more processes) is seeded from (seed, rank), and its
    dropout masks then differ from an unbroken run's. The device's generators travel only between
    devices of the same type."""

    def __init__(self, world: World, seed: int) -> None:
        self.world, self.seed = world, seed

    def state_dict(self) -> dict:
        return {"ranks": self.world.gather(capture_rng(self.world.device))}

    def load_state_dict(self, state: dict) -> None:
        ranks = state["ranks"]
        if not isinstance(ranks, list) or not ranks:
            raise ValueError("the random state is a list with one entry per process")
        if len(ranks) != self.world.size:
            log.info(
                f"the checkpoint holds the random state of {len(ranks)} process(es), this run has {self.world.size}: "
                f"each process's dropout and other random draws continue, but not as an unbroken run's would"
            )
        if self.world.rank < len(ranks):
            restore_rng(ranks[self.world.rank], self.world.device)
        else:
            seed_everything(self.seed + self.world.rank)


def capture_rng(device: torch.device) -> dict:
    """Every generator's state, as plain values that `torch.load(weights_only=True)` accepts."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {**numpy_state["state"], "key": numpy_state["state"]["key"].tolist()}},
        "torch": torch.get_rng_state(),
    }
    if device.type in ("cuda", "xpu"):
        state["accelerator"] = {"type": device.type, "state": getattr(torch, device.type).get_rng_state(device)}
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
        getattr(torch, device.type).set_rng_state(accelerator["state"], device)
