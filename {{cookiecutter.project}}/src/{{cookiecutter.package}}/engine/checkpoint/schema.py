"""What a checkpoint of format 3 holds, checked when it is read, and read through named accessors.

A checkpoint is a plain dict: the metadata of the run that saved it (META) and one entry per part,
each the `state_dict()` of the object the recipe handed over under that name. A one-file checkpoint
holds every part; a folder checkpoint holds the parts written as shards (SHARDED_PARTS) in its
shard files, and the rest, with the shards' sizes and checksums, in its `state.pt`.
"""

from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import CheckpointError
from ..moved import current_targets

# The layout below; a checkpoint of any other is refused in one line that names its format.
FORMAT_VERSION = 3
META = {"format_version": int, "step": int, "config": dict, "device": dict, "amp": dict, "versions": dict}
# The keys each part of format 3 must hold, so that a checkpoint without them is named at once (and
# skipped by resume=last) instead of failing mid-restore; the values are the part's own to check
# when it loads them. A part the recipe hands over that is not named here is checked for presence.
PART_KEYS = {
    "model": (),
    "optimizer": ("state", "param_groups"),
    "scheduler": ("last_epoch",),
    "scaler": (),  # empty when the scaler is off
    "position": ("epoch", "sample"),
    "probe": ("indices", "loss"),
    "tracker": ("run_id",),
    "monitor": ("waited",),
    "rng": ("ranks",),
}
# Parts added to format 3 after its first checkpoints: one without them restores them fresh.
LATER_PARTS = ("monitor", "callbacks", "data")
# Metadata a checkpoint may hold (a dict, or None): where its weights came from (fine-tuning) and
# its optimized_metric at its step (checkpoint.keep_best).
OPTIONAL_META = ("source", "score")
SHARDED_PARTS = ("model", "optimizer")  # written by every process, each its shards, under strategy=fsdp
STATE = "state.pt"  # in a folder checkpoint: everything but the shards


def check(path: Path, state: object, sharded: bool) -> None:
    """Raises a CheckpointError naming `path` and what is wrong, unless `state` is a complete
    checkpoint of format 3 (of a folder checkpoint: its `state.pt`); names the targets of its
    config by their paths now (moved.py)."""
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        found = state.get("format_version") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{path} has format {found!r}; this project reads format {FORMAT_VERSION}: resume it with the "
            f"version of the project that wrote it, or start a new run with name=<new name>"
        )
    parts = {
        part: keys
        for part, keys in PART_KEYS.items()
        if not (sharded and part in SHARDED_PARTS) and not (part in LATER_PARTS and part not in state)
    }
    if problems := _problems(state, parts, {**META, "shards": dict} if sharded else META):
        raise CheckpointError(f"{path} is not a complete checkpoint: {'; '.join(problems)}")
    # Saved before the engine's folders, its config names some of the engine's components by
    # their old paths: every reader of it (a resume, eval.py, export.py, compare) sees them now's.
    current_targets(state["config"])


def _problems(state: dict, parts: dict[str, tuple[str, ...]], meta: dict[str, type]) -> list[str]:
    problems = [f"{key} is missing" for key in (*meta, *parts) if key not in state]
    expected = {**meta, **dict.fromkeys(parts, dict)}
    problems += [
        f"{key} is a {type(state[key]).__name__}"
        for key, kind in expected.items()
        if key in state and not isinstance(state[key], kind)
    ]
    if problems:
        return problems
    problems += [f"{part}.{key} is missing" for part, keys in parts.items() for key in keys if key not in state[part]]
    if type(state["step"]) is not int or state["step"] < 0:
        problems.append(f"step={state['step']!r} is not a count")
    if not isinstance(state["device"].get("type"), str):
        problems.append("device.type is missing")
    problems += [
        f"{key} is a {type(state[key]).__name__}"
        for key in OPTIONAL_META
        if not isinstance(state.get(key), dict | None)
    ]
    if odd := [key for key, value in state.get("model", {}).items() if not torch.is_tensor(value)]:
        problems.append(f"model holds non-tensors at {', '.join(map(str, odd[:3]))}")
    return problems


class Checkpoint(NamedTuple):
    """A checkpoint read from `path` (checked by `check`), and what its readers ask of it."""

    path: Path
    state: dict

    @property
    def step(self) -> int:
        return self.state["step"]

    @property
    def sharded(self) -> bool:
        """A folder of shards (strategy=fsdp), rather than one file."""
        return "shards" in self.state

    @property
    def config(self) -> dict:
        """The resolved config of the run that saved it, as plain values."""
        return self.state["config"]

    def setting(self, group: str, key: str) -> object:
        """A setting of the run that saved it, None where that run's config had none."""
        node = self.config.get(group)
        return node.get(key) if isinstance(node, dict) else None

    @property
    def run_name(self) -> str | None:
        return self.config.get("name")

    @property
    def device_type(self) -> str:
        return self.state["device"]["type"]

    @property
    def amp(self) -> dict:
        return self.state["amp"]

    @property
    def processes(self) -> int:
        """How many processes trained it: one random state each."""
        return len(self.part("rng")["ranks"])

    def weights(self, leaving: frozenset[str] = frozenset()) -> dict:
        """A one-file checkpoint's model weights, but the keys `leaving` names."""
        return {key: value for key, value in self.part("model").items() if key not in leaving}

    def part(self, name: str) -> dict:
        """The saved state_dict of the part handed over as `name`."""
        if name not in self.state:
            raise CheckpointError(
                f"{self.path} holds no {name}, which this run saves; resume from a checkpoint of this version "
                f"of the project, or start a new run with name=<new name>"
            )
        return self.state[name]
