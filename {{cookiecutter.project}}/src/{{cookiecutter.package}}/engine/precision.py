"""Mixed precision per device type: autocast with the device's own type, and a GradScaler that is
on only for float16 (bfloat16 has float32's range and needs no loss scaling)."""

import logging
import warnings
from contextlib import AbstractContextManager, nullcontext

import torch

from .config import AmpConfig
from .errors import RunError

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast(amp: AmpConfig, device: torch.device) -> AbstractContextManager:
    if not amp.enabled:  # torch.autocast(enabled=False) still costs microseconds at every step
        return nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[amp.dtype])


class Scaler(torch.amp.GradScaler):
    """The GradScaler, restored from whatever the checkpoint holds: a run that turns fp16 on
    starts a fresh scaler, one that turns it off skips the saved state, and each says so."""

    def load_state_dict(self, state: dict) -> None:
        if self.is_enabled() and not state:
            log.info("the checkpoint has no GradScaler state (amp was not fp16): starting a fresh GradScaler")
        elif not self.is_enabled() and state:
            log.info("amp is no longer fp16: the checkpoint's GradScaler state is not needed and is skipped")
        elif state:
            super().load_state_dict(state)


def build_scaler(amp: AmpConfig, device: torch.device) -> Scaler:
    """Checks that this torch can autocast to `amp.dtype` on this device, then builds the scaler:
    on for float16 only."""
    if amp.dtype not in DTYPES:
        raise RunError(f"amp.dtype={amp.dtype!r} is not supported; use amp=bf16, amp=fp16 or amp=off")
    if amp.enabled and not _autocast_works(amp, device):
        raise RunError(
            f"amp.dtype={amp.dtype} autocast is not supported on {device.type} by this torch ({torch.__version__}); "
            f"use amp=bf16 or amp=off"
        )
    scaled = amp.enabled and amp.dtype == "float16"
    if scaled and device.type == "xpu" and not torch.xpu.get_device_properties(device).has_fp64:
        # The scaler's inf checks and unscaling need float64, which some Arc GPUs lack.
        log.warning(f"{device} has no float64, which the fp16 GradScaler needs; amp=bf16 needs no scaler")
    return Scaler(device.type, enabled=scaled)


def _autocast_works(amp: AmpConfig, device: torch.device) -> bool:
    # An unsupported dtype only warns and leaves autocast off; asking is the reliable test.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with autocast(amp, device):
            return torch.is_autocast_enabled(device.type)


def describe(amp: AmpConfig) -> str:
    return f"autocast {amp.dtype}" if amp.enabled else "off"


def setting(amp: AmpConfig) -> dict:
    """The AMP setting as a checkpoint records it: a resume under another is not held to exact equality."""
    return {"enabled": amp.enabled, "dtype": amp.dtype}
