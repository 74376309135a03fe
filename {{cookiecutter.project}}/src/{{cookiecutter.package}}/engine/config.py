"""Typed schemas for `configs/`.

Two kinds of config group. The run's own settings (strategy, device, amp, checkpoint, mlflow, trainer) have a
dataclass each: Hydra merges the YAML files into them, so a misspelt key or `amp.enabled=maybe`
stops the run at composition, with Hydra's message. The components (data, task, model, loss,
metrics, optimizer, scheduler, callbacks) name what builds them with `_target_`, and their schema is its signature:
`check_values` checks them against it (components.py) before anything is built, as it checks
what Hydra lets through (a key added with `+`, a value out of range).
"""

import difflib
import functools
import math
import os
import re
import time
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import components
from .errors import RunError, typed


@dataclass
class DeviceConfig:
    type: str = MISSING  # cpu | cuda | xpu | auto
    index: int = 0
    backend: str | None = None  # of the process group (ddp, fsdp); None: gloo, or nccl on cuda, xccl on xpu
    amp_dtype: str = MISSING  # the autocast dtype that suits the device: what amp=auto uses
    pin_memory: bool = False
    non_blocking: bool = False
    cpu_threads: int = 0  # torch's CPU threads; 0: all cores but one, left to data loading and MLflow
{%- if cookiecutter.ipex %}
    ipex: bool = False  # call ipex.optimize after the restore (opt-in, see src/*/ipex.py)
{%- endif %}


@dataclass
class AmpConfig:
    enabled: bool = MISSING
    dtype: str = MISSING  # bfloat16 | float16 (float16 also turns the GradScaler on)


@dataclass
class ContinuityConfig:
    probe_size: int = MISSING  # validation samples in the fixed probe, evaluated in batches of data.batch_size
    rtol: float = MISSING  # allowed relative drift when the device type or AMP dtype changed
    on_mismatch: str = MISSING  # warn | error


@dataclass
class CheckpointConfig:
    dir: str = MISSING
    every_n_steps: int = MISSING
    every_s: float | None = 300.0  # also a save this long after the last (at a logging step); null: off
    keep_last: int = MISSING
    verify: bool = True  # checksums checked while a checkpoint loads (configs/checkpoint/default.yaml)
    async_save: bool = True  # written by a background thread while training goes on (checkpoint/background.py)
    keep_best: bool = True  # `best` names the checkpoint of the best optimized_metric; retention keeps it
    remote: str | None = None  # a store's folder the home is mirrored to (checkpoint/remote/run_folder.py); null: none
    remote_wait_s: float = 25.0  # how long a run's end waits for its newest checkpoint to be remote
    remote_lease_s: float = 60.0  # the remote claim's lease, renewed every third of it; at most 3600
    continuity: ContinuityConfig = field(default_factory=ContinuityConfig)


@dataclass
class MlflowConfig:
    enabled: bool = MISSING
    tracking_uri: str = MISSING
    experiment_name: str = MISSING
    run_name: str | None = None
    system_metrics: bool = False  # CPU, memory, disk, network and GPU as system/* metrics (needs psutil)
    parent_run_id: str | None = None  # nests the run under another: a sweep's jobs under the sweep's run
    log_models: str = "none"  # best | final | both | none: the models logged as the run finishes
    untracked_content: bool = False  # copy untracked files into provenance/git.diff, not only their names (origin.py)


@dataclass
class EarlyStoppingConfig:
    patience: int | None = None  # validations without improvement of optimized_metric before the run stops; null: off
    min_delta: float = 0.0  # what counts as an improvement: more than this


@dataclass
class TrainerConfig:
    max_steps: int = MISSING  # optimizer steps
    log_every_n_steps: int = MISSING
    progress_every_s: float = 30.0  # off a terminal: a progress line at most this often (at logging steps)
    val_every_n_steps: int = MISSING
    # Validation's size: an integer, that many batches of data.batch_size; a float, that fraction of the
    # split (1.0: all of it); from its first sample. Any: a value that is neither is refused by
    # check_values in one line, where this type's union would fail Hydra's merge in a traceback's lines.
    limit_val_batches: Any = 1.0
    grad_accum_steps: int = MISSING  # batches per optimizer step
    grad_clip: float | None = MISSING  # max gradient norm; null: no clipping
    compile: bool = MISSING  # torch.compile the model
    channels_last: bool = MISSING  # NHWC memory format, for convolutional models
    on_nonfinite: str = MISSING  # stop | skip_step | warn: what a NaN or infinite loss does
    nonfinite_patience: int = MISSING  # consecutive skipped non-finite steps before the run stops
    hook_timeout_s: float | None = 600.0  # a callback's hook running longer stops the run (hooks.py); null: no bound
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)  # monitor.py


@dataclass
class InitConfig:
    """Fine-tuning (checkpoint/initial.py): a fresh run's weights from another run's checkpoint, read at a
    fresh start only; and the parameters that do not train, at every start."""

    checkpoint: str | None = None  # a checkpoint file or folder, <home>/latest, or a run name; null: as built
    ignore: list[str] = field(default_factory=list)  # globs of model keys not loaded: they keep their new values
    freeze: list[str] = field(default_factory=list)  # globs of parameters that do not train (param_groups.py)


@dataclass
class StrategyConfig:
    type: str = MISSING  # single: one process | ddp, fsdp: one per device, started by torchrun (distributed.py)
    find_unused_parameters: bool = False  # ddp: for models whose forward skips some parameters
    blocks: list[str] = field(default_factory=list)  # fsdp: class names of the modules sharded as units
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after each forward (less memory)
    timeout_s: int = 1800  # how long a rank waits for the others at a collective step before failing


@dataclass
class Config:
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    init: InitConfig = field(default_factory=InitConfig)
    # Components, each a `_target_` and its settings, checked against its signature (components.py).
    data: Any = MISSING
    task: Any = MISSING  # what a batch holds for the model, and how its outputs become the loss (tasks.py)
    model: Any = MISSING
    loss: Any = MISSING
    metrics: Any = MISSING  # {name: component}, each logged as val/<name>
    optimizer: Any = MISSING
    scheduler: Any = MISSING
    callbacks: dict[str, Any] = field(default_factory=dict)  # {name: component}, called at the run's points (hooks.py)
    name: str = MISSING  # names the checkpoint home and the MLflow run
    seed: int = MISSING
    resume: str | None = None  # null | last | auto | <path to a checkpoint file or folder>
    standby: bool = False  # start warm now, continue the run when the leg that trains it ends (standby.py)
    optimized_metric: str = MISSING  # a sweep job's value; ranks checkpoints; early stopping watches it (monitor.py)
    optimized_mode: str = MISSING  # min | max: whether a lower or a higher optimized_metric is better


def home_of(cfg: DictConfig, name: str) -> Path:
    """The checkpoint home of the run `name` under this config: checkpoint.dir with that name."""
    return Path(OmegaConf.merge(cfg, {"name": name}).checkpoint.dir)


def continuing(cfg: DictConfig, resume: str = "last") -> str:
    """The words after `python run.py` that continue this run: its name, its home and remote copy
    where the command line set them (a resume takes checkpoint.dir and checkpoint.remote from there,
    never from a checkpoint), and `resume=`.
    A suggestion without the name would continue the configs' default run instead."""
    words = [f"name={typed(cfg.name)}"]
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    said = {override.lstrip("+~").split("=", 1)[0] for override in overrides}
    for key in ("checkpoint.dir", "checkpoint.remote"):
        if key in said and OmegaConf.select(cfg, key) is not None:
            words.append(f"{key}={typed(OmegaConf.select(cfg, key))}")
    return " ".join([*words, f"resume={typed(resume)}"])


def project_root() -> str:
    """The folder that holds `configs/`, so stores and checkpoints do not move with the cwd or
    with Hydra's timestamped output folder."""
    return str(configs_folder().resolve().parent)


def configs_folder() -> Path:
    """The project's `configs/`, where Hydra found this command's config."""
    for source in HydraConfig.get().runtime.config_sources:
        if source.provider == "main" and source.schema == "file":
            return Path(source.path)
    raise RuntimeError("the primary config folder is not a file path")


def launch_time(pattern: str) -> str:
    """`${launch_time:%H-%M-%S}`: like Hydra's `${now:}`, but the same in every process of a
    torchrun job, so that all ranks agree on one output folder."""
    return time.strftime(pattern, time.localtime(_launched()))


@functools.cache
def _launched() -> float:
    """Rank 0's clock, shared through torchrun's own store (up before any worker starts)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return time.time()
    import torch.distributed as dist  # under torchrun only: the resolvers compose before torch is imported

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    key = f"launch_time/{os.environ['TORCHELASTIC_RUN_ID']}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    if os.environ["RANK"] == "0":
        store.set(key, repr(time.time()))
    return float(store.get(key))


def if_main_process(value: str) -> str | None:
    """`${if_main_process:.hydra}`: the value on rank 0, null on the others (Hydra then writes
    its config files once)."""
    return value if launched_as_main() else None


def launched_as_main() -> bool:
    """Whether the launcher (torchrun, SLURM) made this process rank 0, or none: one process."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"


def check_values(cfg: Config) -> None:
    """What types cannot say, checked before any work starts: unknown keys, ranges, closed
    choices, a safe name, and every component's settings. Every problem found is named, in one line."""
    check_resolved(cfg)
    if missing := unset(cfg):  # before anything reads them: a read of one raises with a traceback
        raise RunError("; ".join(missing))
    problems = unknown_keys(cfg, Config) + components.problems(cfg)
    for key, rule, explained in RULES:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key}={value} must be a finite number")
        elif isinstance(value, int | float) and not rule(value):  # a value of the wrong type is named by its schema
            problems.append(f"{key}={value} {explained}")
    for key, choices in CHOICES.items():
        if (value := OmegaConf.select(cfg, key)) not in choices:
            problems.append(f"{key}={value} must be one of {', '.join(choices)}")
    if cfg.device.type == "cpu" and cfg.device.index != 0:
        problems.append(f"device.index={cfg.device.index} means nothing on device=cpu; leave device.index out")
    if not NAME.fullmatch(cfg.name) or {".", ".."} & set(cfg.name.split("/")):
        problems.append(
            f"name={cfg.name!r} must be a plain name (letters, digits, '-', '_', '.', and '/' "
            f"for nesting; no '.' or '..' part, not absolute), because it names a folder under checkpoints/; "
            f"to keep checkpoints elsewhere, set checkpoint.dir=<path>"
        )
    if problem := limit_problem(cfg.trainer.limit_val_batches):
        problems.append(problem)
    metrics = cfg.metrics if isinstance(cfg.metrics, DictConfig) else {}
    if cfg.optimized_metric not in (known := ["val/loss", "train/loss", *(f"val/{name}" for name in metrics)]):
        problems.append(
            f"optimized_metric={cfg.optimized_metric} is not a metric of this run; one of {', '.join(known)}"
        )
    if problems:
        raise RunError("; ".join(problems))


def limit_problem(limit: object) -> str | None:
    """What is wrong with trainer.limit_val_batches=`limit`, or None: a whole number of batches, or a
    fraction of the split (a bool is no number here, though Python counts it an int)."""
    if (type(limit) is int and limit >= 1) or (type(limit) is float and 0 < limit <= 1):
        return None
    return (
        f"trainer.limit_val_batches={limit} must be a number of validation batches (an integer, at least 1) or a "
        f"fraction of the validation split (above 0, at most 1.0; 1.0 validates all of it)"
    )


def unset(node: DictConfig, path: str = "") -> list[str]:
    """The settings the configs leave `???` for the command line to give (`data.dir` of token shards)."""
    found = []
    for key in node:
        if OmegaConf.is_missing(node, key):
            found.append(f"{path}{key} has no value; give it one: {path}{key}=<value>")
        elif isinstance(node[key], DictConfig):
            found += unset(node[key], f"{path}{key}.")
    return found


def check_resolved(cfg: DictConfig) -> None:
    """Hydra resolves `${...}` only when a value is read: a reference to nothing fails here, not mid-run."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as error:
        reason = str(error).splitlines()[0]
        raise RunError(f"{error.full_key}: {reason}; fix the interpolation it holds") from None


NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
CHOICES = {
    "strategy.type": ("single", "ddp", "fsdp"),
    "checkpoint.continuity.on_mismatch": ("warn", "error"),
    "trainer.on_nonfinite": ("stop", "skip_step", "warn"),
    "optimized_mode": ("min", "max"),
    "mlflow.log_models": ("best", "final", "both", "none"),
}
# (key, what a valid value satisfies, what to say otherwise); a None value (an option that is
# off, such as grad_clip=null) is not checked.
RULES = [
    *((key, lambda v: v >= 1, "must be at least 1") for key in (
        "trainer.log_every_n_steps", "trainer.val_every_n_steps", "trainer.grad_accum_steps",
        "trainer.nonfinite_patience", "checkpoint.every_n_steps", "checkpoint.keep_last",
        "checkpoint.continuity.probe_size", "data.batch_size", "strategy.timeout_s",
        "trainer.early_stopping.patience",
    )),
    *((key, lambda v: v >= 0, "must not be negative") for key in (
        "trainer.max_steps", "checkpoint.continuity.rtol", "data.num_workers", "device.cpu_threads",
        "trainer.progress_every_s", "trainer.early_stopping.min_delta",
    )),
    ("trainer.grad_clip", lambda v: v > 0, "must be positive, or null for no clipping"),
    ("trainer.hook_timeout_s", lambda v: v > 0, "must be positive, or null for no bound"),
    ("checkpoint.every_s", lambda v: v > 0, "must be positive (seconds between saves), or null to save by step only"),
    ("seed", lambda v: 0 <= v < 2**31, "must be between 0 and 2147483647 (each process draws from seed + its rank)"),
]  # fmt: skip
# A component's own ranges (optimizer.lr=-1, model.dropout=1.5) are its constructor's to refuse.


def unknown_keys(node: object, schema: type, prefix: str = "") -> list[str]:
    """Keys the schema does not have, with the nearest known name: `+optimzer=sgd` (Hydra's own
    suggestion for a misspelt key) would otherwise add a setting that nothing reads."""
    known = {field.name: field.type for field in fields(schema)}
    found = []
    for key in node:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"known here: {', '.join(known)}"
            found.append(f"{prefix}{key} is not a setting ({hint})")
        elif is_dataclass(known[key]):  # components (typed Any) are checked by components.py
            found += unknown_keys(node[key], known[key], f"{prefix}{key}.")
    return found


ConfigStore.instance().store(name="config_schema", node=Config)
# Used in configs/config.yaml, so registered where run.py finds them before it imports torch.
OmegaConf.register_new_resolver("project_root", project_root, replace=True)
OmegaConf.register_new_resolver("launch_time", launch_time, replace=True)
OmegaConf.register_new_resolver("if_main_process", if_main_process, replace=True)
