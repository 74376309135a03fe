"""Checkpoints written in the background (`checkpoint.async_save`): the training thread only
copies the state into CPU memory that training does not touch, and a writer thread writes that
copy while training goes on: rank 0's the one file, or every process's its shards (on a process
group of their own: collective steps from two threads on one group would interleave).

At most one write is in flight: the next save waits for it, and that is where its outcome, the
file or the error, comes back to the run. The copy goes into buffers kept from one save to the
next (pinned, on an accelerator, so the copy runs asynchronously), so a save allocates nothing
after the first: it stalls training for one memory copy of the state, not a write and an fsync.
"""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..devices import ACCELERATORS, is_dtensor


class Snapshot:
    """Copies of a state's tensors in CPU memory of their own, the same buffers at every save."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._on_accelerator = False

    def take(self, state: Any) -> Any:
        """`state` with each tensor replaced by its copy, complete when this returns."""
        self._on_accelerator = False
        copied = self._copy(state, ())
        if self._on_accelerator:  # the non-blocking copies must land before the writer reads them
            torch.accelerator.synchronize()
        return copied

    def _copy(self, value: Any, path: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path)
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key)) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(item, (*path, index)) for index, item in enumerate(value))
        return value  # numbers, strings, None: immutable

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        if is_dtensor(tensor):  # this process's shard, copied, and described as the original
            from torch.distributed.tensor import DTensor

            local = self._copy_tensor(tensor.to_local(), path)
            placement = {"shape": tensor.shape, "stride": tensor.stride(), "run_check": False}
            return DTensor.from_local(local, tensor.device_mesh, tensor.placements, **placement)
        on_accelerator = tensor.device.type in ACCELERATORS
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=on_accelerator)
            self._buffers[path] = buffer
        self._on_accelerator |= on_accelerator
        # Asynchronous only where `take` waits for the device: a copy from another device (mps)
        # left in flight could be written to disk before it landed.
        return buffer.copy_(tensor.detach(), non_blocking=on_accelerator)


class Writer:
    """One thread that runs writes, one at a time."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._in_flight: Future | None = None

    def start(self, write: Callable[[], Any]) -> None:
        if self._in_flight is not None:
            raise RuntimeError("a checkpoint write is already in flight; wait() for it first")
        self._in_flight = self._thread.submit(write)

    def wait(self) -> Any:
        """What the write in flight returned (the file, or the shards' checksums), once it has;
        None when none was in flight. What the write raised (a SaveError: a full disk), this raises."""
        in_flight, self._in_flight = self._in_flight, None
        return None if in_flight is None else in_flight.result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
