"""How the model is spread over the processes (`strategy=`), chosen once: the recipe asks the
strategy to build, wrap and accumulate, and the checkpoint and validation ask it whether the model
is sharded and whether a forward is a collective step.

- single: one process, the whole model.
- ddp: every process holds the whole model in DistributedDataParallel, which averages gradients.
- fsdp: every process holds a shard of each parameter and of its optimizer state (FSDP2); a
  forward gathers the parameters from all, so validation keeps every process in step.
"""

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .config import Config
from .devices import ACCELERATORS
from .distributed import World


class Single:
    """strategy=single, and what ddp and fsdp share."""

    shards = False  # each process holds a shard of the model: checkpoints are folders of shards
    collective_forward = False  # a forward is a step of all processes together

    def __init__(self, cfg: Config, world: World) -> None:
        self.cfg, self.world = cfg, world

    def build(self, build_model: Callable[[], nn.Module]) -> nn.Module:
        """The model `build_model()` makes, on this process's device, with every submodule that
        exists now: a structural change (a new head, frozen layers) belongs in the constructor."""
        layout = torch.channels_last if self.cfg.trainer.channels_last else torch.preserve_format
        return build_model().to(self.world.device, memory_format=layout)

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as training calls it."""
        return model

    def holding_gradients(self, wrapped: nn.Module) -> contextlib.AbstractContextManager:
        """Around a backward whose gradients stay on this process (all but the last micro-batch of
        an accumulated step): averaging them once, at the last, gives the same for less traffic."""
        return contextlib.nullcontext()


class DataParallel(Single):
    """strategy=ddp."""

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model in DistributedDataParallel, which needs it on its device, broadcasts rank 0's
        weights now, so that every process starts from the same ones, and averages the gradients
        in every backward."""
        return DistributedDataParallel(
            model,
            device_ids=[self.world.device.index] if self.world.device.type in ACCELERATORS else None,
            find_unused_parameters=self.cfg.strategy.find_unused_parameters,
        )

    def holding_gradients(self, wrapped: nn.Module) -> contextlib.AbstractContextManager:
        return wrapped.no_sync()


class Sharded(Single):
    """strategy=fsdp."""

    shards = True
    collective_forward = True

    def build(self, build_model: Callable[[], nn.Module]) -> nn.Module:
        """The model built on the meta device (shapes only, no memory), sharded over the processes,
        each block named in `strategy.blocks` as a unit and then the whole, given memory on this
        process's device, and set to the weights `build_model()` makes on rank 0: the same weights
        a single process would start from, whatever the number of processes."""
        # Imported here: torch.distributed.checkpoint and fsdp take 1.5 s to import, which no other strategy uses.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        cfg, world = self.cfg, self.world
        with torch.device("meta"):
            model = build_model()
        # An explicit mesh of this device type: without one, older torch put a gloo model on CUDA.
        mesh = init_device_mesh(world.device.type, (world.size,))
        # bf16: parameters gathered and computed in bf16, gradients reduced in fp32. fp16 keeps fp32
        # parameters (its GradScaler unscales fp32 gradients); autocast chooses each op's dtype as in one process.
        policy = (
            MixedPrecisionPolicy(torch.bfloat16, torch.float32)
            if cfg.amp.enabled and cfg.amp.dtype == "bfloat16"
            else MixedPrecisionPolicy()
        )
        shard = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": cfg.strategy.reshard_after_forward}
        blocks = set(cfg.strategy.blocks)
        for module in list(model.modules())[1:]:
            if type(module).__name__ in blocks:
                fully_shard(module, **shard)
        fully_shard(model, **shard)
        model.to_empty(device=world.device)
        weights = build_model().state_dict() if world.is_main else {}
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return model

    @contextlib.contextmanager
    def holding_gradients(self, wrapped: nn.Module) -> Iterator[None]:
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)


def choose(cfg: Config, world: World) -> Single:
    """The strategy `strategy.type` names; ddp over a group of one process is one process."""
    if cfg.strategy.type == "fsdp":
        return Sharded(cfg, world)
    return DataParallel(cfg, world) if world.backend is not None else Single(cfg, world)
