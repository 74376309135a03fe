"""Checkpoints written in the background (checkpoint.async_save, on by default): training goes on
while a file is written, the file holds the state of its own step, and no run ends with a file
of its half written. The resume tests (test_resume.py, test_cli.py) run with it on."""

import time
from pathlib import Path

import pytest
import torch

from {{cookiecutter.package}} import checkpoints, state
from {{cookiecutter.package}} import train as recipe
from {{cookiecutter.package}}.async_save import Snapshot, Writer
from {{cookiecutter.package}}.checkpoints import SaveError

QUIET = "mlflow.enabled=false"
EVERY_5 = ["trainer.max_steps=15", "checkpoint.every_n_steps=5"]


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


def write_once_training_is_ahead(monkeypatch, steps_ahead: int) -> list[tuple[int, int]]:
    """Makes each background write wait until training has gone `steps_ahead` steps past the
    step it saves (or reached its end); returns, for each write, its step and the step training
    had reached when it began."""
    real_write, began = state.write, []

    def write(run, saved: dict) -> Path:
        deadline = time.monotonic() + 10  # in step (no background write), training waits: fail then
        while run.step < min(saved["step"] + steps_ahead, run.trainer.max_steps) and time.monotonic() < deadline:
            time.sleep(0.005)
        began.append((saved["step"], run.step))
        return real_write(run, saved)

    monkeypatch.setattr(state, "write", write)
    return began


def test_training_goes_on_while_a_checkpoint_is_written_and_the_file_holds_its_own_step(
    make_cfg, checkpoint_dir, tmp_path, monkeypatch
):
    began = write_once_training_is_ahead(monkeypatch, steps_ahead=3)
    recipe.train(make_cfg(QUIET, *EVERY_5))
    assert [step for step, _ in began] == [5, 10, 15]
    assert all(reached >= step + 3 for step, reached in began[:2]), f"training went on during the writes: {began}"
    monkeypatch.undo()
    in_step = tmp_path / "in-step"
    recipe.train(make_cfg(QUIET, *EVERY_5, "checkpoint.async_save=false", f"checkpoint.dir={in_step}"))
    for step in (5, 10, 15):
        written, reference = (checkpoints.load(checkpoints.path_of(home, step)) for home in (checkpoint_dir, in_step))
        for part in ("model", "optimizer", "rng", "position", "probe", "step"):
            assert_same(written[part], reference[part])


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
    real_write, real_step = state.write, recipe.train_step

    def slow_write(run, saved: dict) -> Path:
        time.sleep(1)  # the next step fails meanwhile
        if storage_fails:
            raise OSError("the storage went away")
        return real_write(run, saved)

    def failing_step(run, micro_batches):
        if run.step == 6:
            raise RuntimeError("a bug in a training step")
        return real_step(run, micro_batches)

    monkeypatch.setattr(state, "write", slow_write)
    monkeypatch.setattr(recipe, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="a bug in a training step"):
        recipe.train(make_cfg(QUIET, *EVERY_5))
    if storage_fails:
        assert "the checkpoint write in flight failed: the storage went away" in caplog.text
    else:
        assert checkpoints.load(checkpoint_dir / "step_00000005.pt")["step"] == 5
        assert (checkpoint_dir / "latest").read_text() == "step_00000005.pt"
