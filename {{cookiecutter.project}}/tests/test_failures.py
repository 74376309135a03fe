"""What can go wrong, and what happens: a loss that stops being a number, a disk that fills up,
a second run with the same name, a folder that cannot take checkpoints, a schedule stretched
by a resume, a run killed while its data workers run. In each case nothing already saved is lost,
and the run says so in one line."""

import errno
import logging
import math
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import hold, losses, signal_pending, wait_for_exit
from torch.utils.data import Dataset, TensorDataset

from {{cookiecutter.package}}.engine import components
from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import claim as claiming
from {{cookiecutter.package}}.engine.checkpoint.claim import claim
from {{cookiecutter.package}}.engine.checkpoint.home import NAME
from {{cookiecutter.package}}.engine.checkpoint.onefile import save
from {{cookiecutter.package}}.engine.checkpoint.resume import load, newest_valid
from {{cookiecutter.package}}.engine.data import Data, DataError
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.files import Checksummed

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

QUIET = "mlflow.enabled=false"
EVERY_5 = ["trainer.max_steps=15", "checkpoint.every_n_steps=5", "checkpoint.keep_last=3"]


def saved_files(home: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(home.glob("step_*.pt"))}


@pytest.fixture
def poison(monkeypatch):
    """Makes the inputs of the given training steps NaN, as a bad batch or an overflow would."""

    def arm(*steps: int) -> None:
        real_step, count = recipe.train_step, [0]

        def step_with_poison(run, micro_batches):
            count[0] += 1
            if count[0] in steps:
                micro_batches = [[torch.full_like(inputs, math.nan), targets] for inputs, targets in micro_batches]
            return real_step(run, micro_batches)

        monkeypatch.setattr(recipe, "train_step", step_with_poison)

    return arm


def test_a_diverging_run_stops_before_saving_and_keeps_every_good_checkpoint(make_cfg, client, checkpoint_dir):
    first = recipe.train(make_cfg(*EVERY_5))
    good = saved_files(checkpoint_dir)
    assert list(good) == ["step_00000005.pt", "step_00000010.pt", "step_00000015.pt"]
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(*EVERY_5, "trainer.max_steps=40", "optimizer.lr=1e6", "resume=last"))
    message = str(raised.value)
    diverged = re.match(r"the loss is nan at step (\d+): ", message)  # the first after 15, however fast it comes
    assert diverged and int(diverged[1]) > 15 and "\n" not in message
    assert (
        f"the newest checkpoint on disk is {checkpoint_dir / 'step_00000015.pt'}; continue from it with "
        f"name={make_cfg().name} resume=last and a lower optimizer.lr" in message
    )
    assert saved_files(checkpoint_dir) == good, "no NaN checkpoint written, none of the good ones pruned"
    assert client.get_run(first["run_id"]).info.status == "FAILED"


def test_skip_step_drops_the_update_of_a_non_finite_step_and_the_run_goes_on(make_cfg, checkpoint_dir, poison, caplog):
    poison(7)
    with caplog.at_level(logging.WARNING):
        summary = recipe.train(make_cfg(QUIET, *EVERY_5, "trainer.on_nonfinite=skip_step", "scheduler=constant"))
    assert "the loss is nan at step 7; trainer.on_nonfinite=skip_step dropped its update, and training goes on" in (
        caplog.text
    )
    assert summary["step"] == 15 and math.isfinite(summary["train/loss"])
    weights = newest_valid(checkpoint_dir)[1]["model"]
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())


def test_skip_step_leaves_the_weights_of_a_skipped_step_untouched(make_cfg, checkpoint_dir, poison):
    poison(6)  # the step after the save at 5
    settings = [QUIET, "trainer.max_steps=6", "checkpoint.every_n_steps=5", "trainer.on_nonfinite=skip_step"]
    recipe.train(make_cfg(*settings))
    at_5 = load(checkpoint_dir / "step_00000005.pt").state["model"]
    at_6 = load(checkpoint_dir / "step_00000006.pt").state["model"]
    assert all(torch.equal(at_5[key], at_6[key]) for key in at_5)


def test_non_finite_steps_in_a_row_beyond_the_patience_stop_a_skipping_run(make_cfg, checkpoint_dir, poison):
    poison(7, 8, 9)
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(QUIET, *EVERY_5, "trainer.on_nonfinite=skip_step", "trainer.nonfinite_patience=2"))
    assert str(raised.value).startswith(
        "the loss was not finite for 3 steps in a row (steps 7 to 9), more than trainer.nonfinite_patience=2"
    )
    assert f"newest checkpoint on disk is {checkpoint_dir / 'step_00000005.pt'}" in str(raised.value)


@pytest.mark.parametrize("dropped_by", ["amp=fp16", "trainer.on_nonfinite=skip_step"])
def test_a_diverging_run_whose_steps_are_dropped_still_never_saves_a_broken_model(make_cfg, checkpoint_dir, dropped_by):
    """The updates before the loss turns NaN already broke the weights; dropping the NaN steps
    that follow cannot mend them, so the probe loss at the next save stops the run."""
    recipe.train(make_cfg(QUIET, *EVERY_5, dropped_by))
    good = saved_files(checkpoint_dir)
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(QUIET, *EVERY_5, dropped_by, "trainer.max_steps=80", "optimizer.lr=1e6", "resume=last"))
    assert str(raised.value).startswith("the model is no longer finite at step ")
    assert f"the newest checkpoint on disk is {checkpoint_dir / 'step_00000015.pt'}" in str(raised.value)
    assert saved_files(checkpoint_dir) == good


def test_under_fp16_the_grad_scaler_absorbs_a_non_finite_step_and_the_default_policy_goes_on(
    make_cfg, checkpoint_dir, poison
):
    poison(7)
    summary = recipe.train(make_cfg(QUIET, *EVERY_5, "amp=fp16"))
    assert summary["step"] == 15
    assert newest_valid(checkpoint_dir)[1]["scaler"]["scale"] < 2.0**16, "the scaler backed off"


def test_without_a_scaler_the_default_policy_stops_at_the_first_non_finite_loss(make_cfg, checkpoint_dir, poison):
    poison(7)
    with pytest.raises(RunError, match="^the loss is nan at step 7: the run stops unsaved"):
        recipe.train(make_cfg(QUIET, *EVERY_5))
    assert list(saved_files(checkpoint_dir)) == ["step_00000005.pt"]


def test_a_run_that_diverges_before_its_first_save_names_no_resume(make_cfg, checkpoint_dir, poison):
    """With nothing on disk, resume=last cannot work: the message says to start again."""
    poison(3)
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(QUIET, *EVERY_5))
    assert str(raised.value) == (
        "the loss is nan at step 3: the run stops unsaved; no checkpoint is on disk; run it again with a lower "
        "optimizer.lr, or choose trainer.on_nonfinite=skip_step"
    )
    assert not checkpoint_dir.exists(), "a run that saved nothing leaves no folder"


def test_warn_goes_on_but_never_saves_weights_that_are_no_longer_finite(make_cfg, checkpoint_dir, poison, caplog):
    poison(7)  # without a scaler or skip_step, the NaN reaches the weights
    with caplog.at_level(logging.WARNING), pytest.raises(RunError) as raised:
        recipe.train(make_cfg(QUIET, *EVERY_5, "trainer.on_nonfinite=warn"))
    assert "the loss is nan at step 7; trainer.on_nonfinite=warn, and training goes on" in caplog.text
    assert str(raised.value).startswith("the model is no longer finite at step 10 (body.1.weight, ")
    assert f"nothing is saved; the newest checkpoint on disk is {checkpoint_dir / 'step_00000005.pt'}" in str(
        raised.value
    )
    assert list(saved_files(checkpoint_dir)) == ["step_00000005.pt"]


def test_a_non_finite_probe_loss_is_not_reported_as_a_continuity_mismatch(make_cfg, client, checkpoint_dir, caplog):
    recipe.train(make_cfg("trainer.max_steps=10"))
    _, saved = newest_valid(checkpoint_dir)
    saved["probe"]["loss"] = math.nan
    save(saved, checkpoint_dir, keep_last=3)
    with caplog.at_level(logging.WARNING):
        resumed = recipe.train(
            make_cfg("trainer.max_steps=20", "resume=last", "checkpoint.continuity.on_mismatch=error")
        )
    assert resumed["continuity"] == "nonfinite"
    assert client.get_run(resumed["run_id"]).data.tags["continuity"] == "nonfinite"
    assert "(nonfinite): a loss that is not a number cannot show whether the restore is faithful" in caplog.text


def onto_a_full_disk(monkeypatch, failing_steps: set[int]) -> None:
    """Saves of these steps hit a full disk: their temporary file is created, then every write
    to it fails with the kernel's own ENOSPC (from /dev/full)."""
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full")

    def open_checkpoint(path, mode="r", *args, **kwargs):
        step = NAME.match(Path(path).name)
        if step and int(step[1]) in failing_steps and str(path).endswith(".tmp"):
            open(path, mode).close()
            return open("/dev/full", "wb")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr("{{cookiecutter.package}}.engine.files.open", open_checkpoint, raising=False)


def test_a_disk_that_fills_up_mid_run_costs_a_warning_and_saving_resumes_when_it_has_room(
    make_cfg, checkpoint_dir, monkeypatch, caplog
):
    onto_a_full_disk(monkeypatch, {10, 15})
    with caplog.at_level(logging.WARNING):
        summary = recipe.train(make_cfg(QUIET, *EVERY_5, "trainer.max_steps=20"))
    assert summary["step"] == 20
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == [
        f"could not write {checkpoint_dir / 'step_00000010.pt'} (No space left on device); training goes on and "
        f"tries again at the next save; the newest checkpoint on disk is {checkpoint_dir / 'step_00000005.pt'}",
        "saving works again: step 20 is saved",
    ], "one warning for the outage, however many saves it costs"
    assert list(saved_files(checkpoint_dir)) == ["step_00000005.pt", "step_00000020.pt"]
    assert not list(checkpoint_dir.glob("*.tmp"))


def test_a_final_save_onto_a_full_disk_fails_the_run_naming_the_newest_checkpoint_on_disk(
    make_cfg, client, checkpoint_dir, monkeypatch
):
    onto_a_full_disk(monkeypatch, {10, 15})
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(*EVERY_5))
    assert str(raised.value) == (
        f"could not write {checkpoint_dir / 'step_00000015.pt'} (No space left on device), so step 15 is not "
        f"saved; the newest checkpoint on disk is {checkpoint_dir / 'step_00000005.pt'}; free space or fix the "
        f"folder, then continue from it with name={make_cfg().name} resume=last"
    )
    run_id = newest_valid(checkpoint_dir)[1]["tracker"]["run_id"]
    assert client.get_run(run_id).info.status == "FAILED"


def test_a_final_save_that_fails_with_nothing_on_disk_names_no_resume(make_cfg, checkpoint_dir, monkeypatch):
    """With no checkpoint saved, resume=last could not work: the run is to be run again, and its
    folder, left as it was found, does not refuse it as one that holds checkpoints."""
    onto_a_full_disk(monkeypatch, {5, 10, 15})
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(QUIET, *EVERY_5))
    assert str(raised.value) == (
        f"could not write {checkpoint_dir / 'step_00000015.pt'} (No space left on device), so step 15 is not "
        f"saved; no checkpoint is on disk; free space or fix the folder, then run it again"
    )
    assert not checkpoint_dir.exists()


def test_a_disk_with_less_room_than_one_checkpoint_stops_the_run_before_its_first_step(
    make_cfg, checkpoint_dir, monkeypatch
):
    """AdamW's two moments do not exist before the first step: they are counted from the
    parameters, each the size of its parameter."""
    cfg = make_cfg(QUIET)
    model = components.build("model", cfg.model, input_shape=(1, 8, 8), num_classes=10)
    weights = sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())
    moments = 2 * sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    free = weights + moments - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - free, free))
    monkeypatch.setattr(recipe, "train_step", lambda *args: pytest.fail("a step was trained"))
    with pytest.raises(RunError) as raised:
        recipe.train(cfg)
    kib = [f"{size / 1024:.4g} KiB" for size in (free, weights + moments, weights, moments)]
    assert str(raised.value) == (
        f"{checkpoint_dir} cannot hold one checkpoint of this run ({kib[2]} of model, {kib[3]} of optimizer state): "
        f"it takes {kib[1]}, and the disk there has {kib[0]} free; free space there, or choose a folder with room "
        f"with checkpoint.dir=<path>, then run again"
    )
    assert not checkpoint_dir.exists()


def test_a_run_refused_at_start_leaves_the_folders_as_it_found_them(make_cfg, tmp_path):
    new, mine = tmp_path / "runs" / "demo", tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for home in (new, mine):
        with pytest.raises(RunError, match="^model.num_classes is given by the data"):
            recipe.train(make_cfg(QUIET, "+model.num_classes=3", f"checkpoint.dir={home}"))
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mine"], "runs/ and runs/demo/ are gone"
    assert [path.name for path in mine.iterdir()] == ["notes.txt"]


def test_a_lock_file_removed_by_a_run_refused_at_start_is_not_taken_for_the_homes(tmp_path, monkeypatch):
    """A run that opened the lock file just before its maker, refused, removed it, locks a file
    no other run can find: it opens the home's anew."""
    (tmp_path / "run.lock").touch()
    with open(tmp_path / "run.lock", "r+b") as removed:
        (tmp_path / "run.lock").unlink()
        opened, real = iter([removed]), claiming._open_lock
        monkeypatch.setattr(claiming, "_open_lock", lambda folder: next(opened, None) or real(folder))
        with claim(tmp_path):
            assert (tmp_path / "run.lock").read_text().startswith(f"PID {os.getpid()} on ")


def test_a_fresh_run_over_another_runs_checkpoints_names_that_run_and_leaves_its_lock_as_it_was(
    make_cfg, checkpoint_dir
):
    recipe.train(make_cfg(QUIET, "name=other", "trainer.max_steps=5", "checkpoint.every_n_steps=5"))
    (checkpoint_dir / "run.lock").write_text("PID 4242 on elsewhere, started 2026-01-01 00:00:00\n")
    found = {path.name: path.read_bytes() for path in checkpoint_dir.iterdir()}
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(QUIET, "trainer.max_steps=5"))
    assert str(raised.value) == (
        f"{checkpoint_dir} holds the checkpoints of another run, 'other'; continue that run with name=other "
        f"checkpoint.dir={checkpoint_dir} resume=last, or give {make_cfg().name!r} a folder of its own with checkpoint.dir=<path>"
    )
    assert {path.name: path.read_bytes() for path in checkpoint_dir.iterdir()} == found


def test_a_run_on_a_home_that_another_run_holds_stops_before_building_anything(make_cfg, checkpoint_dir, monkeypatch):
    built = []
    monkeypatch.setattr(components, "build", lambda *args, **runtime: built.append(args))
    holder = hold(checkpoint_dir)
    try:
        with pytest.raises(RunError, match=f"^{checkpoint_dir} is in use by PID {holder.pid} on "):
            recipe.train(make_cfg(QUIET))
    finally:
        holder.kill()
        holder.wait()
    assert built == [] and not list(checkpoint_dir.glob("step_*"))


def test_a_run_leaves_files_it_did_not_write_in_its_checkpoint_folder(make_cfg, checkpoint_dir):
    checkpoint_dir.mkdir(parents=True)
    (checkpoint_dir / "thesis.tmp").write_text("three years of work")
    recipe.train(make_cfg(QUIET, *EVERY_5, "checkpoint.keep_last=1", "resume=auto"))
    assert (checkpoint_dir / "thesis.tmp").read_text() == "three years of work"


def test_extending_a_run_reports_the_lr_jump_and_keeping_the_horizon_avoids_it(
    make_cfg, client, checkpoint_dir, caplog
):
    # The schedule this test computes with, whatever the project's configs choose.
    schedule = ["scheduler=cosine", "scheduler.warmup_steps=20", "scheduler.min_lr_ratio=0.05", "optimizer.lr=3e-3"]
    first = recipe.train(make_cfg(*schedule, "trainer.max_steps=30", "checkpoint.every_n_steps=30"))
    at_30 = losses(client, first["run_id"], "train/lr")[30][0]
    assert newest_valid(checkpoint_dir)[1]["config"]["scheduler"]["total_steps"] == 30
    with caplog.at_level(logging.INFO):
        recipe.train(make_cfg(*schedule, "trainer.max_steps=40", "checkpoint.every_n_steps=30", "resume=last"))
    assert losses(client, first["run_id"], "train/lr")[31][0] > 5 * at_30, "the stretched cosine jumps back up"
    line = next(
        record.getMessage() for record in caplog.records if "the learning rate at step 30" in record.getMessage()
    )
    stretched = 3e-3 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (30 - 20) / (40 - 20))))
    assert line == (
        f"the learning rate at step 30 moves from {at_30:.4g} to {stretched:.4g} on resume (scheduler.total_steps "
        f"30 -> 40; to keep the schedule the run was trained on, resume with scheduler.total_steps=30)"
    )

    at_its_horizon = f"resume={checkpoint_dir / 'step_00000030.pt'}"
    kept = recipe.train(make_cfg(QUIET, *schedule, "trainer.max_steps=35", "scheduler.total_steps=30", at_its_horizon))
    assert kept["step"] == 35
    optimizer = newest_valid(checkpoint_dir)[1]["optimizer"]
    assert optimizer["param_groups"][0]["lr"] == pytest.approx(at_30), "past its horizon the lr stays at the floor"


def test_device_auto_that_resolves_to_the_same_device_is_no_changed_setting(make_cfg, caplog):
    recipe.train(make_cfg(QUIET, "trainer.max_steps=10"))
    with caplog.at_level(logging.INFO):
        recipe.train(make_cfg(QUIET, "trainer.max_steps=20", "device=auto", "resume=last"))
    changed = next(record.getMessage() for record in caplog.records if "changed settings" in record.getMessage())
    assert "device" not in changed and "trainer.max_steps 10 -> 20" in changed


def test_a_resume_with_a_smaller_validation_set_names_the_probe_that_no_longer_fits(make_cfg):
    recipe.train(make_cfg(QUIET, "trainer.max_steps=10"))
    with pytest.raises(
        RunError, match="the checkpoint's continuity probe uses validation sample 255, but this data has 179"
    ):
        recipe.train(make_cfg(QUIET, "trainer.max_steps=20", "data.val_fraction=0.1", "resume=last"))


def test_a_full_disk_during_a_sharded_save_costs_a_warning_and_leaves_no_partial_folder(
    make_cfg, checkpoint_dir, monkeypatch, caplog
):
    """strategy=fsdp in this process (a group of one): every process writes shards, so a write
    can fail on any of them; the save fails on all alike and removes its temporary folder."""
    real_write = Checksummed.write

    def write(stream, data):
        if "step_00000010." in stream.stream.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(stream, data)

    monkeypatch.setattr(Checksummed, "write", write)
    with caplog.at_level(logging.WARNING):
        summary = recipe.train(make_cfg(QUIET, "strategy=fsdp", *EVERY_5, "trainer.max_steps=20"))
    assert summary["step"] == 20
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings[0].startswith(f"could not write the shards of step 10 to {checkpoint_dir}/step_00000010.")
    assert "No space left on device" in warnings[0]
    assert warnings[0].endswith(f"the newest checkpoint on disk is {checkpoint_dir / 'step_00000005'}")
    assert warnings[1:] == ["saving works again: step 15 is saved"]
    names = sorted(path.name for path in checkpoint_dir.iterdir())
    assert names == [
        "best", "goodput.json", "latest", "run.lock", "scores.json", "step_00000005", "step_00000015", "step_00000020"
    ]  # fmt: skip


KILLED_WHILE_ITS_WORKER_WAITS = """
import os, threading, torch
import torch.utils.data._utils.worker as torch_worker
torch_worker.MP_STATUS_CHECK_INTERVAL = 10**6  # torch's own check for a dead run never comes here
from {{cookiecutter.package}}.engine.config import DeviceConfig
from {{cookiecutter.package}}.engine.data.loaders import evaluation_loader

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.tensor(os.getpid())

batches = iter(evaluation_loader(Pids(), 8, 1, DeviceConfig()))
print(next(batches)[0].item(), flush=True)
threading.Event().wait()  # until the test kills this run
"""


def ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def ending(pid: int) -> bool:
    """Whether `pid` is on its way out (PF_EXITING in the kernel's flags; ended counts too)."""
    try:
        flags = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
    except FileNotFoundError:
        return True
    return bool(flags & 0x4)


@pytest.mark.skipif(sys.platform != "linux", reason="the kernel ends a worker with its parent on Linux only")
def test_a_data_worker_ends_as_soon_as_its_run_is_killed():
    """Torch's own check would find the run gone only after its 5 s wait for the next batch (here
    never: the script turns it off, so only the kernel can end the worker). The kernel sends the
    worker its parent-death signal as the run exits, before the run can be reaped: once `wait`
    returns, the worker has ended, or is ending, or has SIGKILL pending, and so runs no more code."""
    run = subprocess.Popen([sys.executable, "-c", KILLED_WHILE_ITS_WORKER_WAITS], stdout=subprocess.PIPE, text=True)
    worker = int(run.stdout.readline())
    run.kill()
    run.wait()
    assert signal_pending(worker, signal.SIGKILL) or ending(worker) or ended(worker)  # in the order it goes
    wait_for_exit(worker)
    assert ended(worker)


RUN_GONE_BEFORE_ITS_WORKER_STARTS = """
import os, time
from {{cookiecutter.package}}.engine.data.workers import end_with_the_run

run = os.getpid()
if os.fork() == 0:
    while os.getppid() == run:
        time.sleep(0.01)
    print("worker starts", flush=True)
    end_with_the_run(run, worker_id=0)
    print("the worker outlived its run", flush=True)
os._exit(0)
"""


def test_a_data_worker_whose_run_ended_while_it_started_ends_too():
    """Torch's check takes the parent a worker finds at start-up for its run: had the run just
    died, that parent is whichever process adopted the worker, and the worker would wait forever,
    holding the output of whoever started the run."""
    result = subprocess.run(
        [sys.executable, "-c", RUN_GONE_BEFORE_ITS_WORKER_STARTS], capture_output=True, text=True, timeout=60
    )
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "worker starts\n")


UNDER_A_FORK_SERVER = """
import multiprocessing, torch
from torch.utils.data import TensorDataset
from {{cookiecutter.package}}.engine.config import DeviceConfig
from {{cookiecutter.package}}.engine.data.loaders import evaluation_loader

multiprocessing.set_start_method("forkserver")  # the default from Python 3.14 on
print(sum(len(targets) for (targets,) in evaluation_loader(TensorDataset(torch.arange(64)), 8, 2, DeviceConfig())))
"""


@pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(), reason="no fork server here")
def test_data_workers_that_a_fork_server_starts_are_not_taken_for_orphans():
    """Their parent is the fork server, not the run."""
    result = subprocess.run([sys.executable, "-c", UNDER_A_FORK_SERVER], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr, result.stdout) == (0, "", "64\n")


class Withdrawn(Dataset):
    """Digit-shaped samples, refused in the data's own words once `flag` exists: a source that the
    data component finds withdrawn under the run."""

    def __init__(self, flag: Path) -> None:
        self.flag = Path(flag)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.flag.exists():
            raise DataError(f"{self.flag} says the source was withdrawn; put it back")
        return torch.full((1, 8, 8), index / 64), index % 10


def withdrawn_data(flag: str, **_) -> Data:
    val = TensorDataset(torch.zeros(16, 1, 8, 8), torch.arange(16) % 10)
    return Data(Withdrawn(flag), val, input_shape=(1, 8, 8), num_classes=10)


class Withdrawing:
    """Withdraws the source after the first validation: the run reads on."""

    def __init__(self, flag: str) -> None:
        self.flag = Path(flag)

    def on_validation_end(self, run, metrics) -> None:
        self.flag.touch()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_refusal_a_data_worker_raises_ends_the_run_in_the_line_it_said_as_without_workers(
    make_cfg, tmp_path, checkpoint_dir, workers
):
    """Torch raises a worker's error again from a message that holds the worker's traceback: the
    run's line was that traceback, its line breaks dropped."""
    flag = tmp_path / "withdrawn"
    data = [f"data._target_={__name__}.withdrawn_data", f"+data.flag={flag}", f"data.num_workers={workers}"]
    withdraw = [f"+callbacks.withdraw._target_={__name__}.Withdrawing", f"+callbacks.withdraw.flag={flag}"]
    every_2 = ["trainer.val_every_n_steps=2", "checkpoint.every_n_steps=2"]
    cfg = make_cfg(*data, *withdraw, *every_2, "data.batch_size=8", "trainer.max_steps=40", QUIET)
    with pytest.raises(DataError) as refused:
        recipe.train(cfg)
    newest = sorted(checkpoint_dir.glob("step_*"))[-1]
    assert str(refused.value) == (
        f"{flag} says the source was withdrawn; put it back; the newest checkpoint on disk is {newest}; "
        f"continue from it with name={cfg.name} resume=last"
    )


LEFT_OPEN_AT_EXIT = """
import torch
from torch.utils.data import TensorDataset
from {{cookiecutter.package}}.engine.data.workers import Loader

reading = iter(Loader(TensorDataset(torch.arange(64)), batch_size=8, num_workers=2))
print(next(reading)[0].tolist(), flush=True)
"""


def test_a_reading_still_open_at_exit_ends_its_workers_and_the_process_exits():
    """A reading that an error's traceback (or anything else) holds to the end: at exit torch leaves
    its workers be, and multiprocessing sends them SIGTERM, which they ignore, then waited for them
    for good. A bounded wait on the process's end."""
    result = subprocess.run([sys.executable, "-c", LEFT_OPEN_AT_EXIT], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout, result.stderr) == (0, "[0, 1, 2, 3, 4, 5, 6, 7]\n", "")
