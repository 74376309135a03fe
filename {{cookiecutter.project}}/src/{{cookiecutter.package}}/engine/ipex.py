"""Intel Extension for PyTorch, opt-in (`device.ipex=true`, `pip install -e '.[ipex]'`).

IPEX is retired upstream: its last release requires torch 2.8.*, and native `torch.xpu` covers
XPU training without it. This path remains for projects that still run that stack.
"""

import torch
from torch import nn

from .config import AmpConfig
from .errors import RunError


def ipex_optimize(model: nn.Module, optimizer: torch.optim.Optimizer, amp: AmpConfig):
    """Returns the model and optimizer that `ipex.optimize` made; only those may be used after."""
    if not torch.__version__.startswith("2.8."):
        raise RunError(
            f"device.ipex=true needs torch 2.8.* (the last IPEX release requires it), found {torch.__version__}; "
            f"install the ipex extra in an environment with torch 2.8, or drop device.ipex"
        )
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError as error:
        raise RunError(
            f"device.ipex=true but IPEX does not import ({error}); pip install -e '.[ipex]', or drop device.ipex"
        ) from None
    dtype = torch.bfloat16 if amp.enabled and amp.dtype == "bfloat16" else None
    # In place: a copied optimizer would leave the LR scheduler driving the original.
    return ipex.optimize(model, optimizer=optimizer, dtype=dtype, inplace=True)
