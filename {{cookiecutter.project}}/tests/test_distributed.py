"""strategy=ddp for real: two processes under torchrun, gloo on the CPU, no mocked process group.
The first tests need no processes: how the data is cut, and how a launch is read."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import IO

import pytest
import torch
import torch.distributed as dist
from conftest import (
    configured,
    environ,
    goodput_of,
    losses,
    run_cli,
    runs_named,
    signal_pending,
    start,
    started,
    started_by,
    wait_for_a_save,
    wait_for_exit,
)
from hydra.core.hydra_config import HydraConfig
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine import distributed, train
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.data.loaders import EpochSampler
from {{cookiecutter.package}}.engine.data.position import Position
from {{cookiecutter.package}}.engine.errors import RunError

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# Exact equality across world sizes is not to be had: the two processes sum their gradients in
# another order than one process does. Over 30 AdamW steps the drift stays far below this.
SAME_GLOBAL_BATCH_RTOL = 1e-4


def shards(size: int, batch_size: int, world_size: int, start: int = 0) -> list[list[int]]:
    """The global batches of epoch 0 as the ranks draw them, each rank's share in rank order."""
    per_rank = []
    for rank in range(world_size):
        sampler = EpochSampler(size, seed=0, batch_size=batch_size, rank=rank, world_size=world_size)
        sampler.set_position(Position(0, start))
        drawn = list(sampler)
        assert len(drawn) == len(sampler)
        per_rank.append([drawn[i : i + batch_size] for i in range(0, len(drawn), batch_size)])
    return [sum(batch, []) for batch in zip(*per_rank, strict=True)]


def test_ranks_share_each_global_batch_of_the_one_permutation():
    assert shards(100, batch_size=6, world_size=1) == shards(100, batch_size=3, world_size=2)
    assert len(shards(100, batch_size=3, world_size=2)) == 16  # 100 // 6: only whole global batches


def test_a_position_in_samples_continues_the_same_order_with_another_number_of_processes():
    one = sum(shards(120, batch_size=12, world_size=1), [])
    assert sum(shards(120, batch_size=4, world_size=2, start=24), []) == one[24:]
    assert sum(shards(120, batch_size=4, world_size=3, start=36), []) == one[36:]


def test_a_position_after_the_last_whole_batch_of_an_epoch_draws_nothing_more_from_it():
    """Where a checkpoint lands when it is saved at the last full batch of an epoch."""
    for world_size in (1, 2):
        assert shards(100, batch_size=3, world_size=world_size, start=98) == []
        assert shards(100, batch_size=3, world_size=world_size, start=100) == []


def test_the_process_group_backend_follows_the_device_unless_configured():
    chosen = [distributed.backend_for(None, torch.device(kind)) for kind in ("cpu", "cuda", "xpu", "mps")]
    assert chosen == ["gloo", "nccl", "xccl", "gloo"]
    assert distributed.backend_for("gloo", torch.device("cuda")) == "gloo"


def test_a_slurm_task_gets_the_variables_torchrun_would_set(monkeypatch):
    launched_here = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {name: value for name, value in os.environ.items() if name not in launched_here})
    slurm = {
        "SUBMITIT_EXECUTOR": "slurm",
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    distributed.adopt_slurm_tasks()
    launched = {name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    assert launched == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert os.environ["MASTER_ADDR"] == "gpu07" and os.environ["MASTER_PORT"] == str(20000 + 4242)


@pytest.mark.parametrize(
    ("overrides", "launched", "message"),
    [
        (["strategy=ddp"], {}, "started by torchrun: torchrun --nproc-per-node=<devices> run.py"),
        ([], {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, "one of 2 (started by torchrun or SLURM)"),
        (["strategy=ddp", "device=cuda", "device.index=1"], {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
         "each process takes the accelerator of its LOCAL_RANK"),
    ],
)  # fmt: skip
def test_a_launch_that_does_not_match_the_strategy_is_refused(make_cfg, monkeypatch, overrides, launched, message):
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # as python run.py starts: no job of another test's
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RunError, match=re.escape(message)), distributed.join(make_cfg(*overrides)):
        pass


CPU = ["device=cpu", "device.cpu_threads=1"]


def torchrun(
    project: Path,
    *overrides: str,
    processes: int = 2,
    device: list[str] = CPU,
    strategy: str = "ddp",
    env: dict[str, str] | None = None,
    restarts: int = 0,
    output: IO | int = subprocess.PIPE,
    rendezvous: tuple[str, ...] = ("--standalone",),
    script: str = "run.py",
    cold: bool = False,
) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node=2 --max-restarts=0 run.py strategy=ddp device=cpu ...`
    (or another `script`) in `project`, its stdout and stderr to `output` (a file for a job that
    says more than a pipe holds before the test reads it). Forked by the warm parent, which forks
    its workers too, unless `cold`: for a test that needs a worker's parent to be torchrun
    (conftest's `started_by` and `command` find the forked workers and their senders)."""
    launch = [*rendezvous, f"--nproc-per-node={processes}", f"--max-restarts={restarts}"]
    command = [sys.executable, "-m", "torch.distributed.run", *launch, script]
    settings = [f"strategy={strategy}", *device, "trainer.log_every_n_steps=1", *overrides]
    popen = {"cwd": project, "stdout": output, "stderr": output, "text": True, "env": env}
    return started([*command, *settings], cold=cold, **popen)


def finished(process: subprocess.Popen, timeout: float = 300) -> str:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stdout + stderr
    return stdout + stderr


def store(project: Path) -> MlflowClient:
    return MlflowClient(f"sqlite:///{project / 'mlflow.db'}")


def only_run(client: MlflowClient, name: str):
    (run,) = runs_named(client, name)
    return run


def ranks(process: subprocess.Popen) -> dict[int, int]:
    """torchrun's workers: {rank: pid}, once both have started (or a failure, if torchrun ends)."""
    while True:
        assert process.poll() is None, process.communicate()
        found = {int(env["RANK"]): pid for pid, env in started_by(process.pid).items() if "RANK" in env}
        if len(found) == 2:
            return found
        time.sleep(0.1)


@pytest.fixture
def torchruns_store(monkeypatch) -> dist.TCPStore:
    """The store torchrun shares with every attempt of its workers, as the workers are told of it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True)
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


@pytest.mark.parametrize("before", ["nothing listens", "another store"])
def test_an_attempt_meets_in_the_store_its_own_rank_0_opened_not_in_the_one_posted_before(torchruns_store, before):
    another = dist.TCPStore("127.0.0.1", 0, is_master=True)
    if before == "nothing listens":
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            port = closed.getsockname()[1]
    else:
        port = another.port
    torchruns_store.set(distributed.ATTEMPT_STORE, f"{port} 0123456789abcdef")  # the attempt before's post
    torchruns_store.set("key", "of a group that met in torchrun's store as it is")
    with (
        pytest.raises(dist.DistStoreError, match="rank 0 posted no store for this attempt"),
        distributed.store_of_this_attempt(1, timedelta(seconds=1)),
    ):
        pass

    with (
        distributed.store_of_this_attempt(0, timedelta(seconds=60)) as opened,
        distributed.store_of_this_attempt(1, timedelta(seconds=60)) as joined,
    ):
        assert not joined.check(["key"]), "a key of the attempt before"
        opened.set("from rank 0", "here")
        assert joined.get("from rank 0") == b"here"


def test_processes_that_do_not_all_meet_stop_within_the_timeout_in_one_line(make_cfg, monkeypatch, torchruns_store):
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    said = (
        "another process of this job did not answer within strategy.timeout_s=2 s while the 2 processes met, so none "
        "trained; check that each was started (on many nodes: every torchrun with the same --rdzv-endpoint), then "
        "start the job again"
    )
    with (
        pytest.raises(RunError, match=f"^{re.escape(said)}$"),
        distributed.join(make_cfg("strategy=ddp", "strategy.timeout_s=2")),
    ):
        pass


RANK_1 = """
from omegaconf import OmegaConf
from {{cookiecutter.package}}.engine import distributed
from {{cookiecutter.package}}.engine.errors import reported

found = distributed.answering


def answering(*arguments):
    if answered := found(*arguments):
        print("found rank 0's store", flush=True)
    return answered


distributed.answering = answering


def wait():
    with distributed.main_first(OmegaConf.create({"strategy": {"timeout_s": 60}}), "fetch"):
        print("went on", flush=True)


reported(wait)
"""


def test_when_rank_0_fails_at_what_it_does_first_the_others_stop_in_its_line(make_cfg, monkeypatch, torchruns_store):
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    other = subprocess.Popen([sys.executable, "-c", RANK_1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RunError), distributed.main_first(make_cfg("strategy=ddp"), "fetch") as done:
        assert done is not None
        assert other.stdout.readline() == "found rank 0's store\n"  # it waits for rank 0 now
        raise RunError("checkpoint.remote: the store refused (AccessDenied); check its credentials")
    stdout, stderr = other.communicate(timeout=60)
    assert other.returncode == 2 and stdout == "", stdout + stderr
    assert stderr == "[rank 1] error: checkpoint.remote: the store refused (AccessDenied); check its credentials\n"


def test_processes_that_torchrun_did_not_start_are_refused_what_rank_0_must_do_first(make_cfg, monkeypatch):
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    said = (
        "rank 0 must fetch before the other 1 processes start, and only processes that torchrun started can wait "
        "for it: start them with torchrun (under SLURM: srun torchrun ...)"
    )
    with (
        pytest.raises(RunError, match=f"^{re.escape(said)}$"),
        distributed.main_first(make_cfg("strategy=ddp"), "fetch"),
    ):
        pass


def test_ddp_trains_as_one_process_would_on_the_same_global_batch(project):
    output = finished(torchrun(project, "name=ddp", "model.dropout=0", "data.batch_size=32", "trainer.max_steps=30"))
    assert "2 processes (gloo), this is rank 0" in output and "finished at step 30" in output
    (folder,) = (project / "outputs").glob("*/*")  # one Hydra folder for both ranks, its files written once
    assert sorted(path.name for path in folder.iterdir()) == [".hydra", "run.log"]
    single = run_cli(project, "name=single", "model.dropout=0", "data.batch_size=64", "trainer.max_steps=30")
    assert single.returncode == 0, single.stderr

    client = store(project)
    ddp, one = only_run(client, "ddp"), only_run(client, "single")
    assert {key: ddp.data.tags[key] for key in ("strategy", "world_size", "backend")} == {
        "strategy": "ddp", "world_size": "2", "backend": "gloo"
    }  # fmt: skip
    ddp_losses, one_losses = losses(client, ddp.info.run_id), losses(client, one.info.run_id)
    assert sorted(ddp_losses) == list(range(1, 31)) and all(len(values) == 1 for values in ddp_losses.values())
    for step, (value,) in one_losses.items():
        assert ddp_losses[step][0] == pytest.approx(value, rel=SAME_GLOBAL_BATCH_RTOL), step
    assert ddp.data.metrics["val/accuracy"] == pytest.approx(one.data.metrics["val/accuracy"], abs=0.01)


def stopped_by_sigterm(project: Path, gate, *overrides: str, strategy: str = "ddp", env: dict | None = None) -> dict:
    """A torchrun job of `overrides` (its name among them), stopped by a SIGTERM to torchrun: held at
    its first save (training goes no further than its next save, which waits for this one), the job
    is stopped, torchrun told, and only continued once torchrun has passed the SIGTERM on to both
    ranks, so the stop lands at the second save at the latest however slow this machine is. Returns
    the checkpoint it stopped with, checked to be the one its stop line names."""
    process = torchrun(project, *overrides, strategy=strategy, env={**gate.env, **(env or {})})
    gate.wait(process)
    workers = ranks(process).values()
    stop(workers)
    process.send_signal(signal.SIGTERM)
    for pid in workers:
        while not signal_pending(pid, signal.SIGTERM):
            assert process.poll() is None, process.communicate()
            time.sleep(0.01)
    for pid in workers:
        os.kill(pid, signal.SIGCONT)
    gate.release()
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    name = next(override.split("=", 1)[1] for override in overrides if override.startswith("name="))
    saved = newest_valid(project / "checkpoints" / name)[1]
    assert f"stopped at step {saved['step']} by SIGTERM" in stdout + stderr
    return saved


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_sigterm_to_torchrun_mid_epoch_then_resume_last_continues_bit_for_bit(project, strategy, save_gate):
    """22 global batches an epoch: the stop lands mid-epoch (at step 7 or 14), and the resume must see
    the rest of it and cross into the next."""
    steps = ["trainer.max_steps=30", "checkpoint.every_n_steps=7"]
    finished(torchrun(project, "name=unbroken", *steps, strategy=strategy))
    saved = stopped_by_sigterm(project, save_gate(), "name=broken", *steps, strategy=strategy)
    assert saved["step"] < 22
    assert saved["position"]["sample"] % 64 == 0 and len(saved["rng"]["ranks"]) == 2
    resumed = finished(torchrun(project, "name=broken", *steps, "resume=last", strategy=strategy))
    assert f"resumed at step {saved['step']} on cpu" in resumed and "(ok)" in resumed

    client = store(project)
    broken, unbroken = only_run(client, "broken"), only_run(client, "unbroken")
    assert broken.info.status == "FINISHED" and broken.data.tags["resumes"] == "1"
    assert losses(client, broken.info.run_id) == losses(client, unbroken.info.run_id)  # each step once, equal


NUMBERED = """
import os, pathlib, torch
from torch.utils.data import Dataset, IterableDataset
from {{cookiecutter.package}}.engine.data import Data
from {{cookiecutter.package}}.engine.ready.tasks import Supervised


def sample(number):
    \"\"\"An 8x8 image of the number, and a label.\"\"\"
    return torch.full((1, 8, 8), float(number)), number % 10


class Numbered(Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return sample(index)


class Lanes(IterableDataset):
    \"\"\"The same 200 samples as a stream: sample n lies in lane n % lanes.\"\"\"

    def lane(self, index, lanes, start):
        yield from (sample(number) for number in range(index + start * lanes, 200, lanes))

    def __iter__(self):
        return iter(sample(number) for number in range(200))


def numbered(**_):
    return Data(Numbered(200), Numbered(32), input_shape=(1, 8, 8), num_classes=10)


def streamed(**_):
    return Data(Lanes(), Numbered(32), input_shape=(1, 8, 8), num_classes=10)


class Recording(Supervised):
    \"\"\"Writes the samples of each batch it trains on, one line a batch, to $IDS.<rank>.\"\"\"

    def split(self, batch):
        inputs, targets = super().split(batch)
        if torch.is_grad_enabled():  # training; validation and the continuity probe take no gradients
            with open(f"{os.environ['IDS']}.{os.environ.get('RANK', '0')}", "a") as ids:
                ids.write(" ".join(str(int(number)) for number in inputs[:, 0, 0, 0].tolist()) + "\\n")
        return inputs, targets
"""


def trained_samples(prefix: Path, ranks: int, batches: int, steps: int) -> list[list[int]]:
    """The samples of each of the first `steps` steps, as `Recording` wrote them: a step is `batches`
    lines of each rank's file."""
    lines = [Path(f"{prefix}.{rank}").read_text().splitlines() for rank in range(ranks)]
    taken = [[line for own in lines for line in own[step * batches : (step + 1) * batches]] for step in range(steps)]
    return [sorted(int(number) for line in step for number in line.split()) for step in taken]


@pytest.mark.parametrize(
    "dataset",
    [["data._target_=numbered.numbered"], ["data._target_=numbered.streamed", "+data.lanes=8"]],
    ids=["map-style", "a stream in lanes"],
)
def test_stopped_with_two_processes_and_resumed_with_one_and_two_workers_each_step_trains_on_the_same_samples(
    project, save_gate, dataset
):
    """200 samples, 16 a step: 12 steps an epoch, and the run goes into its third. The stopped job
    trains 8 a process; the one process that continues it reads 8 a batch twice a step, from two
    workers. Step after step, the same samples as a job of two processes that never stopped."""
    (project / "numbered.py").write_text(NUMBERED)
    data = [*dataset, "task._target_=numbered.Recording", "data.batch_size=8"]
    steps = ["trainer.max_steps=30", "checkpoint.every_n_steps=5", *data]
    finished(torchrun(project, "name=unbroken", *steps, env={**os.environ, "IDS": str(project / "unbroken")}))
    unbroken = trained_samples(project / "unbroken", ranks=2, batches=1, steps=30)
    assert sorted(sum(unbroken[:12], [])) == sorted(set(sum(unbroken[:12], [])))  # an epoch: no sample twice

    saved = stopped_by_sigterm(project, save_gate(), "name=broken", *steps, env={"IDS": str(project / "first")})
    stopped = saved["step"]
    assert stopped < 30
    one = ["trainer.grad_accum_steps=2", "data.num_workers=2", "resume=last"]
    continued = finished(start(project, "name=broken", *steps, *one, env={**os.environ, "IDS": str(project / "then")}))
    assert f"resumed at step {stopped} on cpu" in continued
    first = trained_samples(project / "first", ranks=2, batches=1, steps=stopped)
    then = trained_samples(project / "then", ranks=1, batches=2, steps=30 - stopped)
    assert first + then == unbroken


def test_sigterm_to_one_rank_stops_both_at_the_same_step_with_one_checkpoint(project):
    home = project / "checkpoints" / configured().name
    process = torchrun(project, "trainer.max_steps=100000", "checkpoint.every_n_steps=25")
    wait_for_a_save(home, process)
    os.kill(ranks(process)[1], signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    saved = newest_valid(home)[1]
    assert f"stopped at step {saved['step']} by SIGTERM" in stdout + stderr  # rank 0's line: it stopped too
    assert "exitcode  : 143" in stdout + stderr  # torchrun's report of the ranks' exit
    assert only_run(store(project), configured().name).info.status == "KILLED"


def test_a_ddp_checkpoint_resumes_in_one_process_and_a_single_process_one_under_ddp(project):
    finished(torchrun(project, "trainer.max_steps=20"))
    single = run_cli(
        project, "device.cpu_threads=1", "trainer.log_every_n_steps=1", "trainer.max_steps=40", "resume=last"
    )
    assert single.returncode == 0, single.stderr
    assert "resumed at step 20 on cpu" in single.stdout + single.stderr and "(ok)" in single.stdout + single.stderr
    again = finished(torchrun(project, "trainer.max_steps=60", "resume=last"))
    assert "resumed at step 40 on cpu" in again and "(ok)" in again
    assert "the checkpoint holds the random state of 1 process(es), this run has 2" in again
    run = only_run(store(project), configured().name)
    assert run.data.tags["resumes"] == "2" and run.data.tags["world_size"] == "2"
    assert sorted(losses(store(project), run.info.run_id)) == list(range(1, 61))


@pytest.mark.parametrize(("strategy", "victim"), [("ddp", 0), ("fsdp", 1)])
def test_kill_9_of_a_rank_mid_save_leaves_the_previous_checkpoint_resumable(project, strategy, victim):
    """A model large enough that each save takes a while: a rank dies while one is being written
    (under fsdp every rank writes its shards, so rank 1 dies mid-save as well as rank 0 could)."""
    home = project / "checkpoints" / configured().name
    big = ["model.hidden_sizes=[2048,2048]", "trainer.max_steps=100000", "checkpoint.every_n_steps=5"]
    process = torchrun(project, *big, strategy=strategy)
    wait_for_a_save(home, process)
    workers, deadline = ranks(process), time.monotonic() + 300
    while True:  # a save caught in progress, and checked to be so with both ranks stopped
        assert process.poll() is None, "no save was caught in progress"
        assert time.monotonic() < deadline, "no save was caught in progress within 300 s"
        in_progress = [path for path in home.iterdir() if path.name.startswith("step_") and path.suffix == ".tmp"]
        if not in_progress:
            continue
        stop(workers.values())
        if saving(in_progress[0]):
            break
        for pid in workers.values():
            os.kill(pid, signal.SIGCONT)
    os.kill(workers[victim], signal.SIGKILL)
    for rank, pid in workers.items():
        if rank != victim:
            os.kill(pid, signal.SIGCONT)
    process.communicate(timeout=120)
    assert process.returncode != 0
    newest = newest_valid(home)[1]
    # The save cut short never became a checkpoint. (Its temporary stays, or the surviving rank 0
    # removed it when the collective write failed; the next run removes any that stays.)
    assert newest["step"] < int(in_progress[0].name.split(".")[0].removeprefix("step_"))

    steps = f"trainer.max_steps={newest['step'] + 5}"
    resumed = finished(torchrun(project, *big[:1], steps, "resume=last", strategy=strategy))
    assert f"resumed at step {newest['step']} on cpu" in resumed and "(ok)" in resumed
    assert not any(path.suffix == ".tmp" for path in home.iterdir())


def test_a_rank_killed_eight_times_under_max_restarts_resumes_each_time_and_finishes(project, save_gate):
    """Each attempt torchrun restarts joins a process group of its own: the workers of every attempt
    share torchrun's store, and an attempt that read the keys of the one before hung in
    init_process_group or failed to connect (pytorch/pytorch#135712). Rank 0 is killed at the first
    save of each attempt, so exactly `kills` restarts must suffice."""
    kills, every = 8, 2
    gate = save_gate(each=True)
    settings = [f"checkpoint.every_n_steps={every}", f"trainer.max_steps={every * (kills + 1)}", "resume=auto"]
    with open(project / "torchrun.log", "w+") as log:
        process = torchrun(project, *settings, "strategy.timeout_s=60", restarts=kills, env=gate.env, output=log)
        for _ in range(kills):
            os.kill(gate.wait(process), signal.SIGKILL)
            gate.release()
        gate.wait(process)  # the attempt that is let go
        gate.release()
        process.wait(timeout=600)
        log.seek(0)
        output = log.read()
    assert process.returncode == 0, output
    resumed = re.findall(r"resumed at step (\d+) on cpu: .* \((\w+)\)", output)
    assert resumed == [(str(every * attempt), "ok") for attempt in range(1, kills + 1)], output
    run = only_run(store(project), configured().name)
    assert run.info.status == "FINISHED" and run.data.tags["resumes"] == str(kills)
    assert goodput_of(run)["legs"] == kills + 1  # every attempt counted, the killed ones by the next


def test_a_rank_killed_in_a_job_of_two_nodes_restarts_both_and_resumes(project, save_gate):
    """The form for many nodes of docs/scaling-out.md, with one torchrun per node (two here, on one machine). Each
    torchrun counts its own restarts, so the nodes' counts part after a restart: an attempt is
    known by the store its rank 0 opened, never by that count."""
    kills, every = 3, 2
    gate = save_gate(each=True)
    with socket.socket() as probe:  # a free port for the rendezvous, as a cluster's would be
        probe.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{probe.getsockname()[1]}"
    rendezvous = ("--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes")
    settings = [f"checkpoint.every_n_steps={every}", f"trainer.max_steps={every * (kills + 1)}", "resume=auto"]
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(open(project / f"node{node}.log", "w+")) for node in range(2)]
        nodes = [
            torchrun(project, *settings, processes=1, restarts=kills, env=gate.env, output=log, rendezvous=rendezvous)
            for log in logs
        ]
        for _ in range(kills):
            os.kill(gate.wait(nodes[0]), signal.SIGKILL)
            gate.release()
        gate.wait(nodes[0])
        gate.release()
        said = ""
        for node, log in zip(nodes, logs, strict=True):
            node.wait(timeout=600)
            log.seek(0)
            said += log.read()
            assert node.returncode == 0, said
    # Which node's process is rank 0 may change from one attempt to the next.
    resumed = sorted(re.findall(r"resumed at step (\d+) on cpu: .* \((\w+)\)", said), key=lambda line: int(line[0]))
    assert resumed == [(str(every * attempt), "ok") for attempt in range(1, kills + 1)], said


def stop(pids) -> None:
    """SIGSTOP to each of `pids`, returning once each has stopped (the signal takes effect a moment
    after it is sent: until then the process runs on, and takes any other signal at once)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
            time.sleep(0.001)


def saving(temporary: Path) -> bool:
    """Whether the save writing `temporary` is still under way: not renamed yet and, for the folder
    of a sharded save, with no DCP metadata yet (rank 0 writes it only once every rank has written
    its shards, and the save completes after one more step that needs every rank)."""
    try:
        return temporary.exists() and (temporary.is_file() or not (temporary / ".metadata").exists())
    except OSError:  # removed meanwhile
        return False


def test_a_rank_that_dies_leaves_the_other_one_line_naming_what_happened_and_no_traceback(project):
    home = project / "checkpoints" / configured().name
    settings = ["trainer.max_steps=100000", "checkpoint.every_n_steps=20", "mlflow.enabled=false"]
    process = torchrun(project, *settings, "strategy.timeout_s=60")  # a rank 0 that waits for good fails in a minute
    # Past two saves, every collective a step and a save take has run once: one run for the first
    # time may still meet its peer through torchrun's store, which is held below (a CI run saw rank 0
    # wait there for strategy.timeout_s instead of finding its peer gone).
    wait_for_a_save(home, process)
    wait_for_a_save(home, process)
    survivor, victim = ranks(process)[0], ranks(process)[1]
    # torchrun stops the other workers as soon as one dies: held, it lets rank 0 find out by itself.
    os.kill(process.pid, signal.SIGSTOP)
    try:
        os.kill(victim, signal.SIGKILL)
        wait_for_exit(survivor)  # rank 0 stops by itself after rank 1 died
    finally:
        os.kill(process.pid, signal.SIGCONT)
    _, stderr = process.communicate(timeout=120)
    # torchrun ends with a traceback of its own; none may come from the project's code.
    assert not re.search(rf'File "({re.escape(str(project))}|.*/{{cookiecutter.package}}/)', stderr), stderr
    said = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith("error: another process of this job is gone ("), stderr
    assert said[0].endswith(
        "), so this one stops too; the reason is in the first lines of the process that stopped; then continue "
        f"the job from its newest checkpoint with name={home.name} resume=last"
    )
    assert newest_valid(home) is not None


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        (
            RuntimeError(
                "[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:28034: Connection reset by peer. This is"
            ),
            "another process of this job is gone (Read error [127.0.0.1]:28034: Connection reset by peer)",
        ),
        (
            RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation"),
            "another process of this job did not answer within strategy.timeout_s=1800 s",
        ),
        (RuntimeError("[enforce fail at ../gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes"), None),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), None),
    ],
)
def test_only_a_collective_step_whose_peer_went_away_is_said_as_such(raised, said):
    """Anything else, a gloo failure of this process's own included, keeps its traceback."""
    assert distributed.peer_lost(raised, 1800) == said


def test_the_cli_refuses_a_launch_that_does_not_match_the_strategy_in_one_line(project):
    alone = run_cli(project, "strategy=ddp", "device=cpu")
    assert alone.returncode == 2 and "Traceback" not in alone.stderr
    assert alone.stderr.strip() == (
        "error: strategy=ddp runs one process per device, started by torchrun: "
        "torchrun --nproc-per-node=<devices> run.py strategy=ddp device=cpu"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "run.py"]
    single = started(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = single.communicate(timeout=120)
    assert single.returncode != 0
    # torchrun stops the other process as soon as one fails: one or both of them get to say it.
    said = [line for line in stderr.splitlines() if "error: " in line]
    refusal = r"(\[rank 1\] )?error: this process is one of 2 \(started by torchrun or SLURM\), but strategy=single .+"
    assert said and all(re.fullmatch(refusal, line) for line in said), stderr
    assert not (project / "checkpoints").exists()


def test_a_process_other_than_rank_0_marks_its_error_with_its_rank(make_cfg, monkeypatch, capsys):
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit:
        train.main(make_cfg())
    assert exit.value.code == 2
    assert capsys.readouterr().err.startswith("[rank 1] error: this process is one of 2 (started by torchrun")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda")
def test_ddp_with_nccl_on_every_gpu_trains_in_bf16_with_fused_adamw_and_resumes(project):
    gpus, settings = torch.cuda.device_count(), ["device=cuda", "amp=bf16", "optimizer.fused=true"]
    first = finished(torchrun(project, "trainer.max_steps=20", processes=gpus, device=settings))
    assert f"{gpus} processes (nccl), this is rank 0" in first and "device: cuda:0" in first
    resumed = finished(torchrun(project, "trainer.max_steps=40", "resume=last", processes=gpus, device=settings))
    assert "resumed at step 20 on cuda:0" in resumed and "(ok)" in resumed
    saved = newest_valid(project / "checkpoints" / configured().name)[1]
    assert len(saved["rng"]["ranks"]) == gpus and saved["rng"]["ranks"][-1]["accelerator"]["type"] == "cuda"


def test_a_sweep_job_of_two_submitit_tasks_trains_as_one_ddp_run(project):
    """submitit's local executor starts the tasks as SLURM would: the rendezvous comes from its
    job environment, with no torchrun."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install -e '.[sweeps]'")
    tasks = ["hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2"]
    sweep = run_cli(project, "-m", *tasks, "strategy=ddp", *CPU, "trainer.max_steps=20", timeout=300)
    assert sweep.returncode == 0, sweep.stderr
    (job,) = (project / "multirun").glob("*/*/0")
    assert '"status": "FINISHED"' in (job / "job_result.json").read_text()
    client = store(project)
    runs = runs_named(client, configured().name, "tags.world_size = '2'")
    (run,) = runs
    every = configured().trainer.log_every_n_steps
    assert run.info.status == "FINISHED" and sorted(losses(client, run.info.run_id)) == list(range(every, 21, every))


# --- checkpoint.remote under torchrun: a job continued on a new machine from a mounted folder ---

SAYING = """
import os


class Said:
    \"\"\"Prints, on every rank, the step and the batch size this process continues with.\"\"\"

    def on_fit_start(self, run):
        print(f"rank {os.environ['RANK']} starts at step {run.step}, data.batch_size={run.cfg.data.batch_size}", flush=True)
"""


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_job_stopped_on_one_machine_continues_on_another_from_the_remote_on_every_rank_bit_for_bit(
    project, tmp_path, save_gate, strategy
):
    """The new machine's home is empty: rank 0 fetches the newest remote checkpoint while the other
    rank waits for it, so both continue with the checkpoint's settings (data.batch_size, not typed
    again), from the same step, as a job that never stopped."""
    (project / "saying.py").write_text(SAYING)
    remote, home = tmp_path / "mounted", project / "checkpoints" / "broken"
    steps = ["trainer.max_steps=40", "checkpoint.every_n_steps=7"]
    batch = configured().data.batch_size // 2  # a size the configs do not give: the checkpoint's
    finished(torchrun(project, "name=unbroken", *steps, f"data.batch_size={batch}", strategy=strategy))
    gate = save_gate(match=str(home))
    saved = stopped_by_sigterm(
        project,
        gate,
        "name=broken",
        *steps,
        f"data.batch_size={batch}",
        f"checkpoint.remote={remote}",
        strategy=strategy,
    )
    assert saved["step"] < 40
    shutil.rmtree(home)  # the machine is gone; the remote folder outlives it

    # Rank 0 is held before its fetch lands until rank 1 has gone as far as it goes without it: to
    # torchrun's store, where it waits for rank 0 (to fetch, or to meet in the process group).
    fetching = save_gate(when="before", match=str(home))
    then = ["resume=auto", f"checkpoint.remote={remote}", "+callbacks.said._target_=saying.Said"]
    process = torchrun(project, "name=broken", *steps, *then, strategy=strategy, env=fetching.env)
    fetching.wait(process)
    other = ranks(process)[1]
    while not connected(other, int(environ(other)["MASTER_PORT"])):
        assert process.poll() is None, process.communicate()
        time.sleep(0.01)
    fetching.release()
    continued = finished(process)
    assert f"resumed at step {saved['step']} on cpu" in continued and "(ok)" in continued
    assert sorted(re.findall(r"rank (\d) starts at step (\d+), data.batch_size=(\d+)", continued)) == [
        (str(rank), str(saved["step"]), str(batch)) for rank in range(2)
    ], continued
    client = store(project)
    broken, unbroken = only_run(client, "broken"), only_run(client, "unbroken")
    assert broken.info.status == "FINISHED" and broken.data.tags["resumes"] == "1"
    assert losses(client, broken.info.run_id) == losses(client, unbroken.info.run_id)


def test_a_job_whose_claim_another_machine_took_stops_on_every_rank_at_the_same_step_saying_so(project, request):
    """Only rank 0 holds the claim and hears that it is lost; every rank stops at the same logging
    step with its line, none waits for the others until strategy.timeout_s."""
    remote, s3 = request.getfixturevalue("bucket")  # conftest.py's, on moto's S3 server
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    settings = ["trainer.max_steps=100000", "checkpoint.every_n_steps=10", "checkpoint.remote_lease_s=0.3"]
    process = torchrun(project, *settings, f"checkpoint.remote={remote}", "strategy.timeout_s=600")
    name = configured().name
    committed = f"{prefix}/{name}/committed/step_00000010.json"
    while "Contents" not in s3.list_objects_v2(Bucket=bucket_name, Prefix=committed):
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    other = {"holder": "PID 1 on host-b", "home": "/b", "leg": "b", "started": "", "lease_s": 60, "released": False}
    s3.put_object(Bucket=bucket_name, Key=f"{prefix}/{name}/claim.json", Body=json.dumps(other).encode())
    stdout, stderr = process.communicate(timeout=300)
    said = stdout + stderr
    stops = re.findall(
        rf"^(\[rank 1\] )?error: lost the claim on {re.escape(remote)}/{name} to PID 1 on host-b \(home /b\); this "
        rf"machine stops at step (\d+) and uploads nothing more$",
        said,
        re.MULTILINE,
    )
    assert sorted(rank for rank, _ in stops) == ["", "[rank 1] "] and len({step for _, step in stops}) == 1, said
    assert process.returncode != 0


def connected(pid: int, port: int) -> bool:
    """Whether process `pid` holds a TCP connection to `port` on this machine."""
    sockets = set()
    for descriptor in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            if (target := os.readlink(descriptor)).startswith("socket:["):
                sockets.add(target[len("socket:[") : -1])
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()  # local address, remote address (hex ip:port), state, ..., inode
            if int(fields[2].rsplit(":", 1)[1], 16) == port and fields[3] == "01" and fields[9] in sockets:
                return True
    return False


GATE_METRIC = """
import os, pathlib, signal, time
import torch
from {{cookiecutter.package}}.engine.lifecycle.preemption import Preemption


class Gate:
    '''A metric that counts the validation batches it sees into `<counts>/rank<R>`, and, where the
    environment names STOP_AT_BATCH, on rank 0, at that batch of a validation (counted over the
    run), sends torchrun SIGTERM once, and returns when this process has taken the signal torchrun
    passes on: the validation is under way when the stop comes.'''

    def __init__(self, counts):
        self.path = pathlib.Path(counts) / f"rank{os.environ['RANK']}"
        self.path.parent.mkdir(exist_ok=True)
        self.seen = 0

    def to(self, device):
        return self

    def update(self, outputs, targets):
        self.seen += 1
        self.path.write_text(str(self.seen))
        at = os.environ.get("STOP_AT_BATCH")
        if at and os.environ["RANK"] == "0" and self.seen == int(at):
            os.kill(os.getppid(), signal.SIGTERM)
            deadline = time.monotonic() + 60
            while Preemption.installed.received is None:  # torchrun's SIGTERM, passed on
                assert time.monotonic() < deadline, "torchrun passed no SIGTERM on within 60 s"
                time.sleep(0.01)

    def compute(self):
        return torch.tensor(0.0)

    def reset(self):
        pass

    def __call__(self, outputs, targets):
        return torch.tensor(0.0)
"""


def test_sigterm_to_torchrun_during_validation_stops_both_ranks_within_a_batch_and_resumes_bit_for_bit(project):
    """97 validation samples (limit_val_batches=0.271): rank 0's share is 4 batches of 16, rank 1's 3,
    so every validation asks the stop of a rank that has no batch left. The stop comes in rank 0's
    second batch of the validation at step 10: both leave it after that batch, stop at step 10, and
    the resume trains on as the unbroken run."""
    (project / "gate.py").write_text(GATE_METRIC)
    steps = [
        "trainer.max_steps=30", "trainer.val_every_n_steps=10", "checkpoint.every_n_steps=10",
        "data.batch_size=16", "data.val_fraction=0.2", "trainer.limit_val_batches=0.271",
        "+metrics.gate._target_=gate.Gate",
    ]  # fmt: skip
    finished(torchrun(project, "name=unbroken", *steps, f"+metrics.gate.counts={project / 'unbroken'}"))
    assert (project / "unbroken" / "rank0").read_text() == str(3 * 4)  # at steps 10, 20 and 30
    assert (project / "unbroken" / "rank1").read_text() == str(3 * 3)

    gated = [*steps, f"+metrics.gate.counts={project / 'broken'}"]
    # Cold: the gate signals its parent, torchrun, which a forked worker's is not.
    process = torchrun(project, "name=broken", *gated, env={**os.environ, "STOP_AT_BATCH": "2"}, cold=True)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode != 0, stdout + stderr
    assert [(project / "broken" / f"rank{rank}").read_text() for rank in (0, 1)] == ["2", "2"]
    saved = newest_valid(project / "checkpoints" / "broken")[1]
    assert saved["step"] == 10 and saved["monitor"]["owed"][0] == 10
    assert re.search(r"stopped at step 10 by SIGTERM during validation, left at a batch boundary", stdout + stderr)

    finished(torchrun(project, "name=broken", *gated, "resume=last"))
    client = store(project)
    broken, unbroken = only_run(client, "broken"), only_run(client, "unbroken")
    assert broken.info.status == "FINISHED"
    assert losses(client, broken.info.run_id) == losses(client, unbroken.info.run_id)
    assert losses(client, broken.info.run_id, "val/loss") == losses(client, unbroken.info.run_id, "val/loss")
