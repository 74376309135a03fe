"""Typed schemas for `configs/`: one dataclass per config group.

The YAML files choose the values; these classes fix the keys and their types. Hydra merges every
YAML file into its schema, so a misspelt key, `optimizer.lr=abc` or `amp.enabled=maybe` stops the
run at composition time, before any work starts, with Hydra's own message.
"""

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, OmegaConf

from .errors import RunError


@dataclass
class DeviceConfig:
    type: str = MISSING  # cpu | cuda | xpu | auto
    index: int = 0
    backend: str = MISSING  # torch.distributed backend for scale-out: gloo, nccl, xccl
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
class OptimizerConfig:
    name: str = MISSING  # adamw | sgd
    lr: float = MISSING
    weight_decay: float = 0.0
    betas: list[float] | None = None  # adamw
    fused: bool | None = None  # adamw; None lets torch choose
    momentum: float | None = None  # sgd
    nesterov: bool = False  # sgd


@dataclass
class SchedulerConfig:
    name: str = MISSING  # constant | cosine
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine: the final lr as a fraction of optimizer.lr


@dataclass
class ContinuityConfig:
    probe_size: int = MISSING  # validation samples in the fixed probe batch
    rtol: float = MISSING  # allowed relative drift when the device type or AMP dtype changed
    on_mismatch: str = MISSING  # warn | error


@dataclass
class CheckpointConfig:
    dir: str = MISSING
    every_n_steps: int = MISSING
    keep_last: int = MISSING
    continuity: ContinuityConfig = field(default_factory=ContinuityConfig)


@dataclass
class DataConfig:
    name: str = MISSING
    batch_size: int = MISSING
    val_fraction: float = MISSING
    num_workers: int = 0


@dataclass
class ModelConfig:
    name: str = MISSING
    hidden_sizes: list[int] = MISSING
    dropout: float = 0.0


@dataclass
class MlflowConfig:
    enabled: bool = MISSING
    tracking_uri: str = MISSING
    experiment_name: str = MISSING
    run_name: str | None = None
    system_metrics: bool = False  # CPU, memory, disk, network and GPU as system/* metrics (needs psutil)


@dataclass
class TrainerConfig:
    max_steps: int = MISSING  # optimizer steps
    log_every_n_steps: int = MISSING
    val_every_n_steps: int = MISSING
    grad_accum_steps: int = MISSING  # batches per optimizer step
    grad_clip: float | None = MISSING  # max gradient norm; null: no clipping
    compile: bool = MISSING  # torch.compile the model
    channels_last: bool = MISSING  # NHWC memory format, for convolutional models


@dataclass
class Config:
    device: DeviceConfig = field(default_factory=DeviceConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    experiment: str = MISSING
    seed: int = MISSING
    resume: str | None = None  # null | last | auto | <path to a checkpoint file or folder>


def project_root() -> str:
    """The folder that holds `configs/`, so stores and checkpoints do not move with the cwd or
    with Hydra's timestamped output folder."""
    for source in HydraConfig.get().runtime.config_sources:
        if source.provider == "main" and source.schema == "file":
            return str(Path(source.path).resolve().parent)
    raise RuntimeError("the primary config folder is not a file path")


def check_values(cfg: Config) -> None:
    """What types cannot say, checked before any work starts: ranges and closed choices."""
    at_least_one = {
        "trainer.log_every_n_steps": cfg.trainer.log_every_n_steps,
        "trainer.val_every_n_steps": cfg.trainer.val_every_n_steps,
        "checkpoint.every_n_steps": cfg.checkpoint.every_n_steps,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
        "checkpoint.continuity.probe_size": cfg.checkpoint.continuity.probe_size,
        "data.batch_size": cfg.data.batch_size,
        "trainer.grad_accum_steps": cfg.trainer.grad_accum_steps,
    }
    problems = [f"{key}={value} must be at least 1" for key, value in at_least_one.items() if value < 1]
    if cfg.trainer.max_steps < 0:
        problems.append(f"trainer.max_steps={cfg.trainer.max_steps} must not be negative")
    if cfg.trainer.grad_clip is not None and cfg.trainer.grad_clip <= 0:
        problems.append(f"trainer.grad_clip={cfg.trainer.grad_clip} must be positive, or null for no clipping")
    if cfg.checkpoint.continuity.on_mismatch not in ("warn", "error"):
        problems.append(
            f"checkpoint.continuity.on_mismatch={cfg.checkpoint.continuity.on_mismatch} must be warn or error"
        )
    if problems:
        raise RunError("; ".join(problems))


ConfigStore.instance().store(name="config_schema", node=Config)
OmegaConf.register_new_resolver("project_root", project_root, replace=True)
