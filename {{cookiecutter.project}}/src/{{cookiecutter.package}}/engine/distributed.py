"""Training as one of several processes (`strategy=ddp` or `fsdp`): which process this is, its
device, the process group, and the few collective steps the recipe takes (how the model is spread
over the processes is strategies.py's). With `strategy=single` the world is this process alone and
every collective step returns what it was given, so the recipe reads the same either way.

Processes come from torchrun (`torchrun --nproc-per-node=4 run.py strategy=ddp`), which sets
RANK, LOCAL_RANK and WORLD_SIZE, or from SLURM through submitit (`hydra/launcher=slurm`), whose
job environment is translated into the same variables here. `python run.py strategy=fsdp` alone
is a group of one process, so that a sharded run can be continued or evaluated on one device.
"""

import contextlib
import logging
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig

from .config import continuing
from .devices import ACCELERATORS, resolve_device
from .errors import RunError

if TYPE_CHECKING:
    from .config import Config

log = logging.getLogger(__name__)

BACKENDS = {"cuda": "nccl", "xpu": "xccl"}  # and gloo for every other device
T = TypeVar("T")


@dataclass
class World:
    """This process's place among the processes of the job, and its device."""

    device: torch.device
    rank: int = 0
    local_rank: int = 0  # on this machine: the index of its accelerator
    size: int = 1
    backend: str | None = None  # of the process group; None: no group (strategy=single)

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints and talks to MLflow."""
        return self.rank == 0

    def on_main(self, work: Callable[[], T]) -> T:
        """Runs `work` on rank 0 and returns its result on every rank. A RunError it raises is
        raised on every rank, so that all stop together with the same one-line message instead
        of waiting for rank 0 until the process group times out."""
        if self.backend is None:
            return work()
        result, error = None, None
        if self.is_main:
            try:
                result = work()
            except RunError as raised:
                error = raised
            except Exception as raised:  # a bug: the others stop, rank 0 keeps its traceback
                self.broadcast((None, RunError(f"rank 0 failed: {type(raised).__name__}: {raised}")))
                raise
        result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result

    @contextlib.contextmanager
    def held_by_main(self, context: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
        """Enters `context()` on rank 0 alone, for the life of the block (the checkpoint lock)."""
        with contextlib.ExitStack() as stack:
            self.on_main(lambda: stack.enter_context(context()))
            yield

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        if self.backend is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        if self.backend is None:
            return [value]
        gathered = [None] * self.size
        dist.all_gather_object(gathered, value)
        return gathered

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of `tensor` over the ranks (a sum and a division: gloo has no AVG)."""
        if self.backend is None:
            return tensor
        total = tensor.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total / self.size

    def max(self, value: int) -> int:
        """The largest of every rank's `value`: how ranks agree on a flag, such as a stop."""
        if self.backend is None:
            return value
        flag = torch.tensor([value], device=self.device if self.backend != "gloo" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def launcher_number(variable: str, default: int | None = None) -> int:
    """The launcher's variable `variable` (torchrun's, SLURM's), a whole number, or `default` where it is
    unset. Any other value was set by hand: a one-line error naming it, not int()'s traceback."""
    value = os.environ.get(variable)
    if value is None and default is not None:
        return default
    if value is not None and value.isascii() and value.isdigit():
        return int(value)
    found = (
        f"{variable} is unset while WORLD_SIZE is set" if value is None else f"{variable}={value} is no whole number"
    )
    raise RunError(
        f"{found}: torchrun and SLURM set it for each process they start; unset the variables set by hand, or start "
        f"the job with torchrun or SLURM"
    )


def script() -> str:
    """The script that Hydra started (run.py, eval.py), for a message that repeats the command."""
    return f"{HydraConfig.get().job.name}.py" if HydraConfig.initialized() else "run.py"


@contextlib.contextmanager
def join(cfg: "Config") -> Iterator[World]:
    """This process's World for the life of the block: its device resolved (a missing
    accelerator fails here, before anything is built) and, under strategy=ddp, the process
    group joined and left. A launch that does not match `strategy` is a one-line error."""
    adopt_slurm_tasks()
    size = launcher_number("WORLD_SIZE", 1)
    if cfg.strategy.type == "single":
        if size > 1:
            raise RunError(
                f"this process is one of {size} (started by torchrun or SLURM), but strategy=single trains in "
                f"one; add strategy=ddp, or start it with python {script()}"
            )
        yield World(resolve_device(cfg.device))
        return
    alone = "WORLD_SIZE" not in os.environ
    if alone and cfg.strategy.type == "ddp":
        arguments = " ".join(sys.argv[1:])
        raise RunError(
            f"strategy={cfg.strategy.type} runs one process per device, started by torchrun: "
            f"torchrun --nproc-per-node=<devices> {script()} {arguments}"
        )
    check_device_per_process(cfg)
    rank, local_rank = (0, 0) if alone else (launcher_number("RANK"), launcher_number("LOCAL_RANK"))
    if cfg.device.type != "cpu":
        cfg.device.index = local_rank
    device = resolve_device(cfg.device)
    if device.type in ACCELERATORS:
        getattr(torch, device.type).set_device(device)  # object collectives use the current device
    backend = backend_for(cfg.device.backend, device)
    quiet_unless_main(rank)
    timeout = timedelta(seconds=cfg.strategy.timeout_s)
    with said_in_one_line(
        cfg.strategy.timeout_s,
        f" while the {size} processes met, so none trained; check that each was started (on many nodes: every "
        f"torchrun with the same --rdzv-endpoint), then start the job again",
    ):
        # A group of one (fsdp without torchrun) needs no rendezvous: its store is in memory.
        meeting = contextlib.nullcontext(dist.HashStore()) if alone else store_of_this_attempt(rank, timeout)
        with meeting as store:
            dist.init_process_group(
                backend,
                timeout=timeout,
                device_id=device if device.type in ACCELERATORS else None,
                **({"store": store, "rank": rank, "world_size": size} if store is not None else {}),
            )
    lost = False
    try:
        with said_in_one_line(
            cfg.strategy.timeout_s,
            ", so this one stops too; the reason is in the first lines of the process that stopped; then continue "
            f"the job from its newest checkpoint with {continuing(cfg)}",
        ):
            yield World(device, rank, local_rank, size, backend)
    except PeerLost:
        lost = True
        raise
    finally:
        if not lost:  # else rank 0 may be the one gone: there is none to wait for
            leave_after_main(rank)
        dist.destroy_process_group()


ATTEMPT_STORE = "continuum/store of this attempt"


@contextlib.contextmanager
def main_first(cfg: "Config", what: str) -> Iterator[Callable[[], None] | None]:
    """Before the process group exists: the launch's rank 0 does `what` in the block while the other
    processes wait at its start, until rank 0 calls the `done` it is given (they are given None); a
    failure of rank 0's before that stops them too, in its line; none waits longer than
    strategy.timeout_s. They meet in torchrun's store, in an attempt's own part of it
    (store_of_this_attempt), which rank 0 keeps open for its block. One process does the block at
    once; processes that torchrun did not start cannot meet before their group, and are refused."""
    adopt_slurm_tasks()
    size = launcher_number("WORLD_SIZE", 1)
    if size == 1:
        yield lambda: None
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        raise RunError(
            f"rank 0 must {what} before the other {size - 1} processes start, and only processes that torchrun "
            f"started can wait for it: start them with torchrun (under SLURM: srun torchrun ...)"
        )
    rank, timeout_s, post = launcher_number("RANK"), cfg.strategy.timeout_s, f"continuum/rank 0 first: {what}"
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        try:
            with store_of_this_attempt(rank, timeout, post) as store:
                store.wait([MAIN_SAID], timeout)
                said = store.get(MAIN_SAID).decode()
        except dist.DistError:
            raise PeerLost(
                f"rank 0 did not {what} within strategy.timeout_s={timeout_s} s, so this process stops; the reason "
                f"is in rank 0's first lines"
            ) from None
        if said:
            raise RunError(said)
        yield None
        return
    told = []

    def done() -> None:
        store.set(MAIN_SAID, "")
        told.append(True)

    with store_of_this_attempt(0, timeout, post) as store:
        try:
            yield done
        except BaseException as error:
            if not told:  # failed before `done`: the others wait for this line
                failed = f"rank 0 failed to {what}: {type(error).__name__}: {error}"
                store.set(MAIN_SAID, str(error) if isinstance(error, RunError) else failed)
            raise


MAIN_SAID = "said"  # "" once rank 0's work is done, else the line its failure said


@contextlib.contextmanager
def store_of_this_attempt(rank: int, timeout: timedelta, post: str = ATTEMPT_STORE) -> Iterator[dist.Store | None]:
    """Under torchrun, the store for the process group to meet in: torchrun's own, under a prefix
    that no attempt before used; None elsewhere, where init_process_group's own rendezvous is new
    each time. torchrun hands every attempt of a job it restarts (--max-restarts) one store, which
    still holds the keys of the attempt before: a group that met there unprefixed waited for
    processes that were gone or connected to their old addresses (pytorch/pytorch#135712), and
    torchrun's restart count cannot tell the attempts apart, for each node counts its own.

    Rank 0 draws the prefix and posts it, under `post`, with the port of a small store it opens for the while:
    a post whose port does not answer with that prefix is the attempt before's, and is read
    again until rank 0's new one is there. Rank 0 closes its store once every process has joined
    the group (the block), so that the group lives in torchrun's store, which outlives rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        yield None
        return
    host, deadline = os.environ["MASTER_ADDR"], time.monotonic() + timeout.total_seconds()
    torchruns = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), timeout=timeout)
    if rank == 0:
        token = secrets.token_hex(8)
        answers = dist.TCPStore(host, 0, is_master=True, timeout=timeout)
        answers.set("token", token)
        torchruns.set(post, f"{answers.port} {token}")
        yield dist.PrefixStore(f"attempt {token}", torchruns)
        return
    while True:
        port, token = torchruns.get(post).decode().split()
        if answering(host, int(port), token, timeout):
            break
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"rank 0 posted no store for this attempt: timed out after {timeout}")
        time.sleep(0.05)
    yield dist.PrefixStore(f"attempt {token}", torchruns)


def answering(host: str, port: int, token: str, timeout: timedelta) -> bool:
    """Whether a store at `port` holds `token`: False if nothing listens there (a closed port
    refuses at once, where a store's client would retry until its timeout) or another store does."""
    try:
        socket.create_connection((host, port), timeout=timeout.total_seconds()).close()
        store = dist.TCPStore(host, port, timeout=timeout)
        return store.check(["token"]) and store.get("token").decode() == token
    except (OSError, dist.DistError):
        return False


class PeerLost(RunError):
    """Another process of the job went away or went quiet."""


@contextlib.contextmanager
def said_in_one_line(timeout_s: int, then: str) -> Iterator[None]:
    """A collective step of the block that failed because another process went away or went quiet
    becomes one line: what peer_lost says, followed by `then`."""
    try:
        yield
    except Exception as error:
        if (lost := peer_lost(error, timeout_s)) is None:
            raise
        raise PeerLost(lost + then) from None


# How gloo, NCCL and the c10d store say that the other end of a collective step went away or went
# quiet: a DistError or a plain RuntimeError, whose text starts with the C++ source that raised it.
# A failure of this process's own (a CUDA error, tensors of another size on each rank) says none of
# these and keeps its traceback.
PEER_GONE = re.compile(
    r"Connection (reset|closed|refused)|by peer|Broken pipe|remote process exited|Socket closed|timed? ?out",
    re.IGNORECASE,
)


def peer_lost(error: Exception, timeout_s: int) -> str | None:
    """What a failed collective step says about the other processes, in a few words; None when
    `error` is not one."""
    text = str(error).strip()
    if not isinstance(error, dist.DistNetworkError | dist.DistStoreError) and not (
        isinstance(error, RuntimeError) and PEER_GONE.search(text)
    ):
        return None
    log.debug("the collective step that failed", exc_info=error)
    if re.search(r"timed? ?out", text, re.IGNORECASE):
        return f"another process of this job did not answer within strategy.timeout_s={timeout_s} s"
    detail = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else type(error).__name__)  # the C++ source
    return f"another process of this job is gone ({detail.split('. ')[0]})"


def leave_after_main(rank: int) -> None:
    """Holds the other ranks until rank 0 is done (a minute at most, in case it died): torchrun
    stops every process once one exits with an error, and a run stopped by a signal exits with
    one, while rank 0 may still be writing the end of the run to MLflow."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("rank 0 done", "1")
        return
    with contextlib.suppress(RuntimeError):  # rank 0 is gone or stuck: leave all the same
        store.wait(["rank 0 done"], timedelta(seconds=60))


def backend_for(configured: str | None, device: torch.device) -> str:
    return configured or BACKENDS.get(device.type, "gloo")


def check_device_per_process(cfg: "Config") -> None:
    if cfg.device.index != 0:
        raise RunError(
            f"device.index={cfg.device.index}: under strategy={cfg.strategy.type} each process takes the "
            f"accelerator of its LOCAL_RANK; choose the devices with CUDA_VISIBLE_DEVICES (or "
            f"ZE_AFFINITY_MASK on xpu) and leave device.index out"
        )
{%- if cookiecutter.ipex %}
    if cfg.device.ipex:
        raise RunError(
            f"device.ipex=true is for one process; drop it under strategy={cfg.strategy.type} (device=xpu trains)"
        )
{%- endif %}


def quiet_unless_main(rank: int) -> None:
    """Ranks other than 0 print warnings and errors only, each line marked with the rank."""
    if rank == 0:
        return
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for handler in root.handlers:
        handler.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s"))


def adopt_slurm_tasks() -> None:
    """Under submitit (hydra/launcher=slurm with tasks_per_node or nodes above 1), sets the
    variables torchrun would have set, from SLURM's: the first node hosts the rendezvous."""
    if "WORLD_SIZE" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") not in ("slurm", "local"):
        return
    import submitit  # only here: the sweeps extra

    job = submitit.JobEnvironment()
    os.environ.update(
        RANK=str(job.global_rank),
        LOCAL_RANK=str(job.local_rank),
        WORLD_SIZE=str(job.num_tasks),
        LOCAL_WORLD_SIZE=str(job.num_tasks // job.num_nodes),
        MASTER_ADDR=os.environ.get("MASTER_ADDR", job.hostnames[0]),
        # The same on every task of the job, and different between jobs sharing a node.
        MASTER_PORT=os.environ.get("MASTER_PORT", str(20000 + int(re.sub(r"\D", "", job.job_id) or 0) % 20000)),
    )
