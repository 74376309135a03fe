"""Checkpoints written in the background (checkpoint.async_save, on by default): training goes on
while a file is written, the file holds the state of its own step, and no run ends with a file
of its half written. The resume tests (test_resume.py, test_cli.py) run with it on."""

import threading
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import sharded
from {{cookiecutter.package}}.engine.checkpoint.background import Snapshot, Writer
from {{cookiecutter.package}}.engine.checkpoint.home import path_of
from {{cookiecutter.package}}.engine.checkpoint.manager import Checkpointer
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.errors import SaveError

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

QUIET = "mlflow.enabled=false"
EVERY_5 = ["trainer.max_steps=15", "checkpoint.every_n_steps=5", "checkpoint.keep_last=3"]  # the three saves kept


def test_a_snapshot_is_a_copy_that_training_cannot_change_in_buffers_reused_at_every_save():
    weight, moment = torch.ones(3, 2), torch.zeros(3, 2)
    live = {"model": {"w": weight}, "optimizer": {"state": {0: {"exp_avg": moment}}, "param_groups": [{"lr": 0.1}]}}
    snapshot = Snapshot()
    first = snapshot.take(live)
    weight.add_(1)  # an optimizer step after the save
    moment.add_(2)
    assert torch.equal(first["model"]["w"], torch.ones(3, 2))
    assert torch.equal(first["optimizer"]["state"][0]["exp_avg"], torch.zeros(3, 2))
    assert first["optimizer"]["param_groups"] == [{"lr": 0.1}]
    second = snapshot.take(live)
    assert torch.equal(second["model"]["w"], weight) and second["model"]["w"] is not weight
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr(), "no allocation after the first save"


def test_every_background_save_of_a_run_copies_into_the_same_buffers_and_resumes_exactly(
    make_cfg, checkpoint_dir, tmp_path, monkeypatch
):
    real_take, taken = Snapshot.take, []

    def take(snapshot: Snapshot, state: dict) -> dict:
        copied = real_take(snapshot, state)
        taken.append(copied)  # held: a buffer freed and allocated again could come back at the same address
        return copied

    monkeypatch.setattr(Snapshot, "take", take)
    recipe.train(make_cfg(QUIET, *EVERY_5))
    storages = [{name: tensor.untyped_storage().data_ptr() for name, tensor in tensors(copied)} for copied in taken]
    assert len(storages) == 3 and storages[0], "saves at steps 5, 10 and 15"
    assert storages[1] == storages[0] and storages[2] == storages[0]
    monkeypatch.undo()
    recipe.train(make_cfg(QUIET, *EVERY_5, f"resume={path_of(checkpoint_dir, 10)}"))
    in_step = tmp_path / "in-step"
    recipe.train(make_cfg(QUIET, *EVERY_5, "checkpoint.async_save=false", f"checkpoint.dir={in_step}"))
    resumed, unbroken = (load(path_of(home, 15)).state for home in (checkpoint_dir, in_step))
    for part in ("model", "optimizer", "rng", "position", "probe", "step"):
        assert_same(resumed[part], unbroken[part])


def tensors(value, name: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a nested state, by their path in it."""
    if isinstance(value, torch.Tensor):
        return [(name, value)]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else []
    return [found for key, item in items for found in tensors(item, f"{name}/{key}")]


def test_a_writer_runs_one_write_at_a_time_and_hands_back_its_file_or_its_error(tmp_path):
    writer = Writer()
    try:
        assert writer.wait() is None, "nothing in flight"
        writer.start(lambda: tmp_path / "step_00000005.pt")
        with pytest.raises(RuntimeError, match="already in flight"):
            writer.start(lambda: tmp_path / "step_00000010.pt")
        assert writer.wait() == tmp_path / "step_00000005.pt"

        def full_disk() -> Path:
            raise SaveError("could not write step_00000010.pt (No space left on device)")

        writer.start(full_disk)
        with pytest.raises(SaveError, match="No space left on device"):
            writer.wait()
    finally:
        writer.close()


def training_ahead_of_writes(monkeypatch, steps_ahead: int, max_steps: int):
    """A wait for a background write to call before it writes: until training has gone
    `steps_ahead` steps past the step it saves (or reached `max_steps`); and the list of each
    write's step and the step training had reached when it began. Writes in step with training
    would wait for a step that never comes: the wait then gives up, and the assertions on that
    list fail."""
    real_step = recipe.train_step
    stepped, reached, began = threading.Condition(), [0], []

    def train_step(run, micro_batches):
        loss = real_step(run, micro_batches)
        with stepped:
            reached[0] = run.step + 1  # the step this one completes
            stepped.notify_all()
        return loss

    def wait(step: int) -> None:
        with stepped:
            stepped.wait_for(lambda: reached[0] >= min(step + steps_ahead, max_steps), timeout=60)
            began.append((step, reached[0]))

    monkeypatch.setattr(recipe, "train_step", train_step)
    return wait, began


def test_training_goes_on_while_a_checkpoint_is_written_and_the_file_holds_its_own_step(
    make_cfg, checkpoint_dir, tmp_path, monkeypatch
):
    wait, began = training_ahead_of_writes(monkeypatch, steps_ahead=3, max_steps=15)
    real_write = Checkpointer._write

    def write(checkpointer, saved: dict) -> Path:
        wait(saved["step"])
        return real_write(checkpointer, saved)

    monkeypatch.setattr(Checkpointer, "_write", write)
    recipe.train(make_cfg(QUIET, *EVERY_5))
    assert [step for step, _ in began] == [5, 10, 15]
    assert all(reached >= step + 3 for step, reached in began[:2]), f"training went on during the writes: {began}"
    monkeypatch.undo()
    in_step = tmp_path / "in-step"
    recipe.train(make_cfg(QUIET, *EVERY_5, "checkpoint.async_save=false", f"checkpoint.dir={in_step}"))
    for step in (5, 10, 15):
        written, reference = (load(path_of(home, step)).state for home in (checkpoint_dir, in_step))
        for part in ("model", "optimizer", "rng", "position", "probe", "step"):
            assert_same(written[part], reference[part])


def test_training_goes_on_while_every_process_writes_its_shards_and_they_hold_their_own_step(
    make_cfg, checkpoint_dir, tmp_path, monkeypatch
):
    """strategy=fsdp in this process (a group of one): its writer thread writes the shards over a
    process group of its own while training goes on."""
    wait, began = training_ahead_of_writes(monkeypatch, steps_ahead=3, max_steps=15)
    real_write = sharded._write

    def write(shards: dict, folder: Path, step: int, group=None) -> dict:
        wait(step)
        return real_write(shards, folder, step, group)

    monkeypatch.setattr(sharded, "_write", write)
    recipe.train(make_cfg(QUIET, "strategy=fsdp", *EVERY_5))
    assert [step for step, _ in began] == [5, 10, 15]
    assert all(reached >= step + 3 for step, reached in began[:2]), f"training went on during the writes: {began}"
    monkeypatch.undo()
    in_step = tmp_path / "in-step"
    recipe.train(make_cfg(QUIET, "strategy=fsdp", *EVERY_5, "checkpoint.async_save=false", f"checkpoint.dir={in_step}"))
    for step in (5, 10, 15):
        folders = [path_of(home, step, folder=True) for home in (checkpoint_dir, in_step)]
        written, reference = (load(folder).state for folder in folders)
        for part in ("rng", "position", "probe", "step"):
            assert_same(written[part], reference[part])
        for number, folder in enumerate(folders):
            dcp_to_torch_save(folder, tmp_path / f"whole-{number}.pt")
        written, reference = (torch.load(tmp_path / f"whole-{n}.pt", weights_only=False) for n in (0, 1))
        assert_same(written["model"], reference["model"])
        assert_same(written["optimizer"], reference["optimizer"])


def assert_same(found, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(found, expected)
    elif isinstance(expected, dict):
        assert found.keys() == expected.keys()
        for key in expected:
            assert_same(found[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(found) == len(expected)
        for one, other in zip(found, expected, strict=True):
            assert_same(one, other)
    else:
        assert found == expected


@pytest.mark.parametrize("storage_fails", [False, True])
def test_a_run_that_fails_while_a_checkpoint_is_written_ends_once_the_write_has_and_with_its_own_error(
    make_cfg, checkpoint_dir, monkeypatch, caplog, storage_fails
):
    real_write, real_step = Checkpointer._write, recipe.train_step
    step_failed, overlapped = threading.Event(), []

    def slow_write(checkpointer, saved: dict) -> Path:
        # The write is still in flight when the next step fails. A write in step with training
        # would wait for a step that never comes: the wait gives up, and the test fails below.
        overlapped.append(step_failed.wait(timeout=60))
        if storage_fails:
            raise OSError("the storage went away")
        return real_write(checkpointer, saved)

    def failing_step(run, micro_batches):
        if run.step == 6:
            step_failed.set()
            raise RuntimeError("a bug in a training step")
        return real_step(run, micro_batches)

    monkeypatch.setattr(Checkpointer, "_write", slow_write)
    monkeypatch.setattr(recipe, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="a bug in a training step"):
        recipe.train(make_cfg(QUIET, *EVERY_5))
    assert overlapped == [True], "training went on while the checkpoint was written"
    if storage_fails:
        assert "the checkpoint write in flight failed: the storage went away" in caplog.text
    else:
        assert load(checkpoint_dir / "step_00000005.pt").state["step"] == 5
        assert (checkpoint_dir / "latest").read_text() == "step_00000005.pt"
