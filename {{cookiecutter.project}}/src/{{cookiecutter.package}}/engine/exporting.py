"""export.py's recipe: a checkpoint's model weights, and nothing else of it, as one safetensors
file in the dtype asked for, with a sidecar JSON beside it that says how to build the model they
fit (its `_target_`, its settings and the data's facts it takes), the data's facts (a vocabulary
and labels turn a string into inputs and outputs into names) and where they came from. A few
lines of plain PyTorch load them (README "Exporting"); no pickle is written or read.

A sharded checkpoint is read into one model through the project's own loaders, which refuse a
crafted `.metadata` (checkpoint/sharded.py); its optimizer state is never read. The files are
created whole, or not at all, and never over a file that is there.
"""

import errno
import json
import logging
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from . import components
from .checkpoint.initial import lineage, load_weights
from .config import Config, check_values
from .data.contract import build_data
from .distributed import World, launcher_number
from .errors import RunError, reported
from .files import write_new
from .remembered import CommandLine
from .saved_model import check_trained_alike, find, settings

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(cfg: Config, which: str, out: str, dtype: str) -> Path:
    """The entry point of export.py: a problem the user can fix prints as one line, no traceback."""
    said = CommandLine.typed()
    return reported(lambda: export(cfg, which, Path(out), dtype, said))


def export(cfg: Config, which: str, out: Path, dtype: str, said: CommandLine | None = None) -> Path:
    """Writes the weights of the model `checkpoint=<which>` holds to `out` (…safetensors), their
    floating-point tensors in `dtype`, and its sidecar (….json); returns the sidecar's path. The
    model is the checkpoint's own, with what the command line `said` changed; without `said`, `cfg`'s."""
    cfg = settings(cfg, which, said)
    check_values(cfg)
    out, sidecar = paths(out)
    if dtype not in DTYPES:
        raise RunError(
            f"dtype={dtype}: export.py writes {', '.join(DTYPES)}; pass dtype=fp32 to keep the weights whole"
        )
    if launcher_number("WORLD_SIZE", 1) > 1:
        raise RunError("export.py reads any checkpoint in one process: run python export.py ..., not under torchrun")
    # On the CPU, one process: the weights are read and written, never run.
    saved = find(cfg, World(torch.device("cpu")), which)
    check_trained_alike(cfg, saved)
    source = lineage(saved)  # now: retention may prune it once it is read
    data = build_data(cfg.data)
    model = components.build("model", cfg.model, **data.facts)
    load_weights(model, saved, [], shards=False, fine_tuning=False)
    # Copies: tied weights (one tensor under two names) become two, which safetensors requires.
    tensors = {
        key: value.detach().to(DTYPES[dtype] if value.is_floating_point() else value.dtype, copy=True).contiguous()
        for key, value in model.state_dict().items()
    }
    described = {
        "model": components.described("model", cfg.model, **data.facts),
        "data": plain(data.facts),
        "dtype": dtype,
        "source": source,
        "score": saved.state.get("score"),  # optimized_metric at the checkpoint's step, when it was ranked
    }
    try:
        write_new(out, lambda scratch: save_weights(tensors, scratch))
        try:
            write_new(sidecar, lambda scratch: scratch.write_text(json.dumps(described, indent=1) + "\n"))
        except BaseException:
            out.unlink()  # ours, written a moment ago: no weights without the sidecar that says what they fit
            raise
    except FileExistsError:
        raise RunError(
            f"{out} or {sidecar} appeared while exporting, and stays as it was; pass out=<new name>.safetensors"
        ) from None
    except OSError as error:
        room = "free space there, or " if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        raise RunError(
            f"cannot write {out} ({error.strerror}); {room}pass out=<a path in a folder you can write>"
        ) from None
    size = out.stat().st_size / 2**20
    log.info(f"wrote {out} ({len(tensors)} tensors, {size:.1f} MiB, {dtype}) and {sidecar}: the model of {saved.path}")
    return sidecar


def plain(facts: dict) -> dict:
    """The data's facts that JSON holds; one it cannot (a tensor) is left out, with a warning."""
    kept = {}
    for key, value in facts.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            log.warning(f"the data's fact {key} (a {type(value).__name__}) is not plain data: left out of the sidecar")
            continue
        kept[key] = value
    return kept


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, which says a failed write (a full disk) as text in a SafetensorError:
    raised as the OSError it was."""
    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as error:
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def paths(out: Path) -> tuple[Path, Path]:
    """The weights' file and its sidecar's, refused where either is taken: nothing is overwritten."""
    out = out.expanduser().absolute()
    if out.suffix != ".safetensors":
        raise RunError(f"out={out}: the weights are written in safetensors; name the file <name>.safetensors")
    sidecar = out.with_suffix(".json")
    for path in (out, sidecar):
        if path.exists() or path.is_symlink():
            raise RunError(f"{path} is there already; export.py writes over nothing: pass out=<new name>.safetensors")
    if not out.parent.is_dir():
        raise RunError(f"out={out}: no folder {out.parent}; make it first, or pass out=<a path in a folder>")
    return out, sidecar
