"""Mixed precision per device type: autocast with the device's own type, and a GradScaler that is
on only for float16 (bfloat16 has float32's range and needs no loss scaling)."""

from contextlib import AbstractContextManager

import torch

from .config import AmpConfig
from .errors import RunError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(amp: AmpConfig, device: torch.device) -> AbstractContextManager:
    return torch.autocast(device.type, dtype=DTYPES[amp.dtype], enabled=amp.enabled)


def build_scaler(amp: AmpConfig, device: torch.device) -> torch.amp.GradScaler:
    if amp.dtype not in DTYPES:
        raise RunError(f"amp.dtype={amp.dtype!r} is not supported; use amp=bf16, amp=fp16 or amp=off")
    return torch.amp.GradScaler(device.type, enabled=amp.enabled and amp.dtype == "float16")


def describe(amp: AmpConfig) -> str:
    return f"autocast {amp.dtype}" if amp.enabled else "off"
