"""Which device a run uses, a preflight that fails before anything is built, and the placement
audit that proves every tensor the first step touches is on that device."""

import functools
import logging
import platform
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .config import DeviceConfig
from .errors import RunError

log = logging.getLogger(__name__)

ACCELERATORS = ("cuda", "xpu")
# One per core by default; read once, before anything changes it.
DEFAULT_THREADS = torch.get_num_threads()


def resolve_device(cfg: DeviceConfig) -> torch.device:
    """The device the config asks for, or a one-line error saying why it cannot be had."""
    kind = cfg.type
    if kind == "auto":
        present = [accelerator for accelerator in ACCELERATORS if getattr(torch, accelerator).is_available()]
        kind = present[0] if present else "mps" if torch.backends.mps.is_available() else "cpu"
        log.info(f"device=auto chose {kind}")
    if kind in ("cpu", "mps"):
        return torch.device(kind)
    if kind not in ACCELERATORS:
        raise RunError(f"device.type={kind!r} is not a device this project knows; use device=cpu, cuda, xpu or auto")
    backend = getattr(torch, kind)
    if not backend.is_available():
        raise RunError(
            f"device={kind} was asked for, but torch.{kind}.is_available() is False "
            f"(this torch build is {torch.__version__}); use device=auto or device=cpu, "
            f"or install a torch build with {kind} support"
        )
    if cfg.index >= backend.device_count():
        raise RunError(
            f"device.index={cfg.index} was asked for, but torch.{kind}.device_count() is "
            f"{backend.device_count()}; pick an index from 0 to {backend.device_count() - 1}"
        )
    return torch.device(kind, cfg.index)


def set_cpu_threads(cfg: DeviceConfig) -> None:
    """Leaves a core free unless told otherwise: with every core in torch's thread pool, any other
    work (the MLflow sender, data workers) stalls the pool's spinning threads, and a 2-core
    machine trains five times slower; a small model loses almost nothing with one thread fewer."""
    torch.set_num_threads(cfg.cpu_threads or max(1, DEFAULT_THREADS - 1))


def describe(device: torch.device) -> str:
    """`cuda:0 (NVIDIA H100 80GB HBM3)`: the evidence a person needs that the run is where they meant."""
    if device.type in ACCELERATORS:
        return f"{device} ({getattr(torch, device.type).get_device_name(device.index)})"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"cpu ({platform.machine()}, {threads} thread{'' if threads == 1 else 's'})"
    return str(device)


def audit_placement(
    device: torch.device,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Stops the run, naming each tensor that is not on `device`, before the first step (or the
    evaluation: no optimizer, no scaler).

    The two usual causes get their own hint: a submodule created after `model.to(device)` (a new
    head for fine-tuning), and optimizer state restored before the model was moved.
    """
    misplaced_model = [
        f"model.{name} is on {tensor.device}"
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if not _on(tensor, device)
    ]
    names = {param: name for name, param in model.named_parameters()}
    misplaced_state = []
    for group in optimizer.param_groups if optimizer is not None else []:
        # Non-fused, non-capturable optimizers keep `step` as a CPU scalar on purpose.
        cpu_step_allowed = not (group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            if param not in names:
                misplaced_state.append(
                    f"the optimizer holds a {tuple(param.shape)} parameter on {param.device} that the model no longer has"
                )
                continue
            for key, value in optimizer.state.get(param, {}).items():
                if not torch.is_tensor(value) or _on(value, device):
                    continue
                if key == "step" and cpu_step_allowed and value.device.type == "cpu" and value.dim() == 0:
                    continue
                misplaced_state.append(f"optimizer state {key!r} of model.{names[param]} is on {value.device}")
    scaler_device = getattr(scaler, "_device", device.type)
    misplaced_scaler = (
        []
        if scaler is None or not scaler.is_enabled() or scaler_device == device.type
        else [f"GradScaler is for {scaler_device}"]
    )

    problems = misplaced_model + misplaced_state + misplaced_scaler
    if not problems:
        return
    hints = []
    if misplaced_model:
        hints.append(
            "a submodule was created or replaced after model.to(device): build the whole model before moving it"
        )
    if misplaced_state:
        hints.append(
            "the optimizer was built, or its state loaded, before the model moved: "
            "move the model first, then build the optimizer and load its state"
        )
    if misplaced_scaler:
        hints.append("the GradScaler was built for another device type")
    raise RunError(
        f"{len(problems)} tensor(s) not on {device}: {'; '.join(problems)}. Likely cause: {'; '.join(hints)}"
    )


def is_dtensor(value: object) -> bool:
    """Whether `value` is a DTensor (fsdp's shard of a tensor), without importing
    torch.distributed.tensor, a third of a second of every start-up: none exists before it is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def to_device(batch: Any, device: torch.device, non_blocking: bool, channels_last: bool) -> Any:
    """A batch to the device whole: a tensor, or a tuple, namedtuple, list or dict of them (nested:
    what the loader's collation makes of the samples), laid out as the model is (NHWC for images
    under channels_last); anything else as it is."""
    if isinstance(batch, torch.Tensor):
        memory_format = torch.channels_last if channels_last and batch.dim() == 4 else torch.preserve_format
        return batch.to(device, non_blocking=non_blocking, memory_format=memory_format)
    place = functools.partial(to_device, device=device, non_blocking=non_blocking, channels_last=channels_last)
    if isinstance(batch, Mapping):
        return {key: place(value) for key, value in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple takes its fields one by one
        return type(batch)(*map(place, batch))
    if isinstance(batch, list | tuple):
        return type(batch)(map(place, batch))
    return batch
