"""What a run records about itself: every setting, where and how it really ran. MLflow shows it
(params, tags, the config artifact); a checkpoint keeps the config and versions. What code it ran
from (git, the template, the packages) the MLflow sender finds, off the trainer's path: origin.py."""

import hashlib
import json
import platform
import re
from collections.abc import Set, Sized
from pathlib import PurePath

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from .components import RESERVED
from .data.contract import Data
from .data.loaders import global_batch
from .devices import describe
from .distributed import World

PARAM_NAME = re.compile(r"[\w\-. /]+")  # what MLflow admits in a param's name


# Settings that say where a run keeps things, not what it trains: tags, so that the UI's compare
# views and parallel coordinates show what differs in training.
WHERE = ("checkpoint.dir", "checkpoint.remote", "mlflow.tracking_uri")


def record(cfg: DictConfig, world: World, lineage: dict[str, str]) -> tuple[dict[str, str], dict[str, str], str]:
    """What a run records of itself: every setting that shapes training as a param, each
    component by its short name (`optimizer=AdamW`; its `_target_` whole as a tag); where and how
    it really ran as tags (what the MLflow UI needs to compare runs), with the tags of its
    `lineage` (where its weights came from: checkpoint/initial.py); and the resolved config."""
    device = world.device
    tags = {
        "strategy": cfg.strategy.type,
        "world_size": str(world.size),
        "backend": world.backend or "none",
        "device": str(device),
        "device.type": device.type,
        "device.index": str(device.index if device.index is not None else 0),
        "device.name": describe(device),
        "amp": cfg.amp.dtype if cfg.amp.enabled else "off",
        "torch": str(torch.__version__),
{%- if cookiecutter.ipex %}
        "ipex": str(cfg.device.ipex).lower(),
{%- endif %}
    }
    tags.update(lineage)
    params = {
        **flat_params(cfg),
        "global_batch": str(global_batch(cfg, world.size)),
    }  # a resume on more processes changes it
    del params["mlflow.run_name"]  # the run's own name, and it may differ on resume
    # MLflow shows the experiment itself; a run resumed under another grouping stays in its own.
    del params["mlflow.experiment_name"]
    if not cfg.amp.enabled:  # a dtype beside the tag amp=off would read as a contradiction
        del params["amp.dtype"]
    # A setting left null (off, or the library's default) is absent rather than "None": the compare
    # views then show only what some run sets (and, for a run without it, MLflow's "unknown").
    params = {key: value for key, value in params.items() if value != "None"}
    tags.update({key: params.pop(key) for key in WHERE if key in params})
    for key in [key for key in params if key.endswith("._target_")]:
        component = key.removesuffix("._target_")
        tags[key] = params.pop(key)
        params[component] = tags[key].rsplit(".", 1)[-1]
    return params, tags, OmegaConf.to_yaml(cfg, resolve=True)


def run_name(cfg: DictConfig) -> str:
    """The MLflow run's name: `name`, then what the command line changed, less what does not change
    what the run trains (resume, device, ...: the exclude_keys of Hydra's override_dirname), each
    path by its last part (`titled`), as in `demo optimizer=sgd,optimizer.lr=0.1` or
    `cls data.dir=mytexts`. A resumed run keeps the name it was given first."""
    if not HydraConfig.initialized():
        return cfg.name
    hydra = HydraConfig.get()
    return f"{cfg.name} {titled(hydra.overrides.task, set(hydra.job.config.override_dirname.exclude_keys))}".strip()


def titled(overrides: list[str], leaving: Set[str]) -> str:
    """What a person typed, to name a run by (a sweep job's whole name, a single run's after its
    `name`): the overrides sorted as Hydra's override_dirname sorts them, less those `leaving` names,
    each path-valued one by its last part (`data.dir=mytexts`): an absolute path says where a machine
    keeps a file, not what the run trains, and would crowd out the rest of the name."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    kept = sorted((override for override in parsed if override.key_or_group not in leaving), key=lambda o: o.input_line)
    return ",".join(
        f"{override.get_key_element()}={PurePath(value).name or value}"
        if isinstance(value := override.value(), str) and "/" in value
        else override.input_line
        for override in kept
    )


def flat_params(cfg: DictConfig) -> dict[str, str]:
    return flatten(OmegaConf.to_container(cfg, resolve=True))


# The splits by MLflow's dataset context tag (`mlflow.data.context`), as its runs list shows them.
CONTEXTS = {"train": "training", "val": "validation", "test": "test"}


def datasets(cfg: DictConfig, data: Data, splits: tuple[str, ...]) -> list[dict]:
    """The data a run reads, the `splits` of it, as MLflow dataset inputs (its runs list's Dataset
    column): the data component's name, a digest of its settings and the split (MLflow keeps one
    input per digest), its `_target_` as source, the split and its size. Two runs on other data,
    or another split of it, differ at a glance. The loader's settings (batch size, workers) change
    no sample and are left out."""
    settings = {
        key: value for key, value in OmegaConf.to_container(cfg, resolve=True).items() if key not in RESERVED["data"]
    }
    found = {"train": data.train, "val": data.val, "test": data.test}
    return [
        {
            "name": settings["_target_"].rsplit(".", 1)[-1],
            "digest": hashlib.sha256(json.dumps([settings, split], sort_keys=True).encode()).hexdigest()[:8],
            "source": settings["_target_"],
            "context": CONTEXTS[split],
            "samples": len(found[split]) if isinstance(found[split], Sized) else None,  # a stream's is unknown
        }
        for split in splits
        if found[split] is not None
    ]


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """One param per setting; a mapping whose keys are not names (the globs of
    optimizer.lr_multipliers), as one value: MLflow refuses `*` in a param's name."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and all(PARAM_NAME.fullmatch(str(name)) for name in value):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = str(value)
    return flat


def library_versions() -> dict[str, str]:
    # str(): torch.__version__ is a TorchVersion, which weights_only loading refuses.
    return {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": np.__version__}
