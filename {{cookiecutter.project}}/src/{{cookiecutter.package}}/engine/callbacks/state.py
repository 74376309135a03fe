"""What a callback's state may be: what a checkpoint holds and reads back, tensors and plain values,
judged by the restricted loader that reads checkpoints (files.load_restricted), each time the state is
saved; and dicts, lists and tuples that neither contain themselves nor nest deeper than MOST_NESTED,
which the judging walks through."""

import io
import os

import torch

from ..errors import shown
from ..files import load_restricted

MOST_NESTED = 100  # levels of dicts, lists and tuples in a callback's state: far more than a state needs


class Unholdable(Exception):
    """A state whose dicts, lists and tuples contain themselves, or nest deeper than MOST_NESTED: one
    that judging it would recurse through without end, or past Python's stack; `instead`, the fix."""

    def __init__(self, shape: str, instead: str) -> None:
        super().__init__(shape)
        self.instead = instead


def refused(state: object) -> str | None:
    """Why a checkpoint cannot hold `state`, a callback's `state_dict()`, and what to store instead,
    as a message goes on from "<the callback> holds "; None where it can."""
    try:
        light = _without_bytes(state)
    except Unholdable as shape:
        return f"a state {shape}, which a checkpoint does not take, so nothing is saved; {shape.instead}"
    if (found := _refused(light, "state_dict()")) is None:
        return None
    where, value = found
    kind = type(value).__qualname__
    instead = (
        "store str(path) instead"
        if isinstance(value, os.PathLike)
        else "store plain values instead: numbers, strings, tensors, and lists and dicts of them"
    )
    return (
        f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind} at {where}, which a checkpoint cannot hold (resume and "
        f"eval.py load only tensors and plain values), so nothing is saved; {instead}"
    )


def _refused(value: object, at: str) -> tuple[str, object] | None:
    """Where in `value`, a callback's state at `at` (its tensors on the meta device: _without_bytes),
    the restricted loader refuses what it finds, and that; None where it takes all of it.
    files.load_restricted is the one judge of what a checkpoint may hold: its refusal is searched for
    through the dicts, lists and tuples of `value`."""
    if _loads(value):
        return None
    if type(value) is dict:
        inside = [(f"a key of {at}", key) for key in value] + [(f"{at}[{key!r}]", item) for key, item in value.items()]
    elif type(value) in (list, tuple):
        inside = [(f"{at}[{index}]", item) for index, item in enumerate(value)]
    else:
        inside = []
    return next((found for where, item in inside if (found := _refused(item, where))), (shown(at), value))


def _loads(value: object) -> bool:
    """Whether `value`, written as a checkpoint writes it, reads back through the restricted loader."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        load_restricted(buffer, "a callback's state", device="meta")
    except Exception:  # what pickle cannot write at all (a lambda, an open file), or what the loader refuses
        return False
    return True


def _without_bytes(value: object) -> object:
    """`value` with the tensors of its dicts, lists and tuples on the meta device: the loader judges a
    tensor by its kind, and a large one (an average of the weights) is not copied to be judged. What
    is shared stays shared, as pickle keeps it. Unholdable where its dicts, lists and tuples (keys
    included) contain themselves or nest deeper than MOST_NESTED."""
    made: dict[int, object] = {}  # by id: each shared container walked once
    within: set[int] = set()  # the containers from `value` down to the one walked now

    def light(value: object, depth: int) -> object:
        if isinstance(value, torch.Tensor):
            try:
                return value.detach().to("meta")
            except (RuntimeError, NotImplementedError):  # a layout without a meta form: judged as it is
                return value
        if type(value) not in (dict, list, tuple):
            return value
        if id(value) in within:
            raise Unholdable(
                "that is recursive (a dict, list or tuple in it contains itself)", "store it without the loop"
            )
        if depth == MOST_NESTED:
            raise Unholdable(f"deeper than {MOST_NESTED} levels of dicts, lists and tuples", "store it flatter")
        if id(value) not in made:
            within.add(id(value))
            if type(value) is dict:
                made[id(value)] = {light(key, depth + 1): light(item, depth + 1) for key, item in value.items()}
            else:
                made[id(value)] = type(value)(light(item, depth + 1) for item in value)
            within.discard(id(value))
        return made[id(value)]

    return light(value, 0)
