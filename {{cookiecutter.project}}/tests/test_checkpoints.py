"""Checkpoint files: atomic saves, retention, the `latest` pointer, damage, unsafe pickles, and
what `resume=` finds."""

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import hold

from {{cookiecutter.package}}.engine.checkpoint import dcp_files, onefile, sharded
from {{cookiecutter.package}}.engine.checkpoint import home as checkpoint_home
from {{cookiecutter.package}}.engine.checkpoint.claim import claim
from {{cookiecutter.package}}.engine.checkpoint.home import set_aside_newer
from {{cookiecutter.package}}.engine.checkpoint.onefile import save
from {{cookiecutter.package}}.engine.checkpoint.resume import find, load
from {{cookiecutter.package}}.engine.checkpoint.schema import FORMAT_VERSION, SHARDED_PARTS, STATE
from {{cookiecutter.package}}.engine.errors import CheckpointError, RunError, SaveError
from {{cookiecutter.package}}.engine.files import write_text


def state(step: int) -> dict:
    """A complete checkpoint, as state.save writes one, with weights that tell steps apart."""
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "model": {"weights": torch.full((64, 64), float(step))},
        "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": step},
        "scaler": {},
        "position": {"epoch": 0, "sample": 64 * step},
        "probe": {"indices": torch.arange(4), "loss": 0.5},
        "tracker": {"run_id": None},
        "rng": {"ranks": [{"python": (3, (), None), "numpy": {}, "torch": torch.get_rng_state()}]},
        "config": {"optimizer": {}, "scheduler": {}, "trainer": {}},
        "device": {"type": "cpu", "name": "cpu"},
        "amp": {"enabled": False, "dtype": "bfloat16"},
        "versions": {},
    }


def save_steps(home: Path, *steps: int, keep_last: int = 10) -> None:
    for step in steps:
        save(state(step), home, keep_last)


def corrupt(path: Path) -> None:
    """Flips bytes in the middle of the file: torch.load alone would still read it."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(255 - byte for byte in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def test_save_writes_the_file_and_the_latest_pointer(tmp_path):
    path = save(state(7), tmp_path, keep_last=3)
    assert path == tmp_path / "step_00000007.pt"
    assert (tmp_path / "latest").read_text() == "step_00000007.pt"
    assert torch.equal(load(path).state["model"]["weights"], torch.full((64, 64), 7.0))
    assert not list(tmp_path.glob("*.tmp"))


def test_only_the_newest_keep_last_checkpoints_remain(tmp_path):
    save_steps(tmp_path, 10, 20, 30, 40, 50, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000040.pt", "step_00000050.pt"]


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    save_steps(tmp_path, 10)

    def dies_halfway(obj, file):
        file.write(b"PK\x03\x04" + bytes(96))  # part of the bytes reached the disk, then the process died
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        save(state(20), tmp_path, keep_last=3)
    path, loaded = find("last", tmp_path)
    assert path.name == "step_00000010.pt" and loaded["step"] == 10
    assert (tmp_path / "latest").read_text() == "step_00000010.pt"


def test_a_crash_between_the_checkpoint_and_the_pointer_still_resumes_from_the_new_one(tmp_path, monkeypatch):
    save_steps(tmp_path, 10)
    real_replace = os.replace

    def dies_before_the_pointer(source, target):
        if str(target).endswith("latest"):
            raise KeyboardInterrupt
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", dies_before_the_pointer)
    with pytest.raises(KeyboardInterrupt):
        save(state(20), tmp_path, keep_last=3)
    monkeypatch.setattr(os, "replace", real_replace)
    # The rename made the file whole: step 20 is complete, though the pointer still names 10.
    assert find("last", tmp_path)[1]["step"] == 20
    assert not list(tmp_path.glob("*.tmp")), "an interrupted save removes its own temporary file"


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path, caplog):
    save_steps(tmp_path, 10, 20)
    corrupt(tmp_path / "step_00000020.pt")
    with caplog.at_level(logging.WARNING):
        path, loaded = find("last", tmp_path)
    assert loaded["step"] == 10
    assert "step_00000020.pt is damaged" in caplog.text and "falling back" in caplog.text


def test_a_truncated_newest_checkpoint_falls_back_too(tmp_path, caplog):
    save_steps(tmp_path, 10, 20)
    newest = tmp_path / "step_00000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        assert find("last", tmp_path)[1]["step"] == 10
    assert "step_00000020.pt is unreadable" in caplog.text


def test_without_verify_a_damaged_checkpoint_loads_as_it_is(tmp_path):
    """What checkpoint.verify=false risks: the checksums are what tell a flipped byte."""
    save_steps(tmp_path, 10, 20)
    corrupt(tmp_path / "step_00000020.pt")
    assert find("last", tmp_path, verify=False)[1]["step"] == 20
    assert find("last", tmp_path)[1]["step"] == 10


def test_naming_a_corrupted_checkpoint_explicitly_fails_clearly(tmp_path):
    save_steps(tmp_path, 10, 20)
    corrupt(tmp_path / "step_00000020.pt")
    with pytest.raises(
        CheckpointError, match="step_00000020.pt is damaged: its content no longer matches the checksum written at save"
    ):
        find(str(tmp_path / "step_00000020.pt"), tmp_path)


def test_a_checkpoint_is_sealed_with_the_checksum_of_its_bytes_and_still_loads_anywhere(tmp_path):
    path = save(state(7), tmp_path, keep_last=3)
    comment = zipfile.ZipFile(path).comment
    assert re.fullmatch(rb"crc32c:[0-9a-f]{8}", comment)
    assert torch.equal(torch.load(path, weights_only=True)["model"]["weights"], torch.full((64, 64), 7.0))
    assert zipfile.ZipFile(path).testzip() is None  # any zip reader reads it


def test_a_file_that_does_not_end_as_a_zip_archive_is_left_unsealed(tmp_path, monkeypatch):
    """The seal overwrites the archive's last two bytes: only where they are its comment length."""
    monkeypatch.setattr(torch, "save", lambda state, file: file.write(b"PK\x05\x06 but not at the end"))
    with open(tmp_path / "file", "wb") as file:
        onefile._save_sealed({}, file)
    assert (tmp_path / "file").read_bytes() == b"PK\x05\x06 but not at the end"


def test_a_checkpoint_written_before_seals_is_checked_record_by_record(tmp_path):
    """As the project wrote them before: torch.save's own zip, its records' CRC-32 only."""
    torch.save(state(20), tmp_path / "step_00000020.pt")
    assert find("last", tmp_path)[1]["step"] == 20
    corrupt(tmp_path / "step_00000020.pt")
    with pytest.raises(CheckpointError, match="step_00000020.pt is damaged: its record .* no longer matches"):
        load(tmp_path / "step_00000020.pt")


class WritesAFile:
    """What a malicious checkpoint carries: unpickling it would run code."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return exec, (f"open({str(self.target)!r}, 'w').write('pwned')",)


def test_a_malicious_pickle_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "pwned.txt"
    path = tmp_path / "step_00000001.pt"
    torch.save({"format_version": FORMAT_VERSION, "payload": WritesAFile(marker)}, path)
    with pytest.raises(CheckpointError) as refused:
        load(path)
    assert str(refused.value) == (
        f"{path} was refused: it asks for exec, which only unrestricted unpickling could rebuild, "
        f"and that can run arbitrary code; load only checkpoints this project wrote"
    )  # and not torch's own advice that weights_only=False "will likely succeed"
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: this file really does run code when trusted
    assert marker.read_text() == "pwned"


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="has format None; this project reads format 3"):
        load(path)


def test_a_checkpoint_from_before_components_by_target_is_refused_naming_its_format(tmp_path, caplog):
    """Format 1 laid the parts out otherwise (data_position, optimizer_name, mlflow_run_id)."""
    old = {key: value for key, value in state(10).items() if key not in ("position", "tracker")}
    torch.save({**old, "format_version": 1, "data_position": {"epoch": 0, "batch": 10}}, tmp_path / "step_00000010.pt")
    with pytest.raises(CheckpointError, match=r"has format 1; this project reads format 3: resume it with the version"):
        load(tmp_path / "step_00000010.pt")
    with caplog.at_level(logging.WARNING), pytest.raises(RunError, match="holds checkpoints, but none loads"):
        find("last", tmp_path)
    assert "has format 1" in caplog.text


def test_resume_last_without_checkpoints_names_where_it_looked(tmp_path):
    with pytest.raises(RunError) as raised:
        find("last", tmp_path / "nothing")
    assert f"resume=last found no valid checkpoint in {tmp_path / 'nothing'}" in str(raised.value)
    assert "resume=auto" in str(raised.value)


def test_resume_auto_with_only_damaged_checkpoints_stops_instead_of_starting_over(tmp_path):
    save_steps(tmp_path, 10)
    corrupt(tmp_path / "step_00000010.pt")
    for resume in ("auto", "last"):
        with pytest.raises(RunError, match=f"resume={resume}: .* holds checkpoints, but none loads"):
            find(resume, tmp_path)


def test_checkpoints_past_a_step_are_set_aside_not_deleted(tmp_path):
    save_steps(tmp_path, 10, 20, 30)
    folder = set_aside_newer(tmp_path, 10)
    assert sorted(path.name for path in folder.iterdir()) == ["step_00000020.pt", "step_00000030.pt"]
    assert find("last", tmp_path)[1]["step"] == 10
    assert set_aside_newer(tmp_path, 10) is None


def test_resume_auto_without_checkpoints_starts_fresh_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert find("auto", tmp_path) is None
    assert "starting fresh" in caplog.text


def test_resume_none_means_fresh_even_with_checkpoints_present(tmp_path):
    save_steps(tmp_path, 10)
    assert find(None, tmp_path) is None


def test_resume_path_takes_a_file_or_the_newest_in_a_folder(tmp_path):
    save_steps(tmp_path / "elsewhere", 10, 20)
    home = tmp_path / "home"
    assert find(str(tmp_path / "elsewhere" / "step_00000010.pt"), home)[1]["step"] == 10
    assert find(str(tmp_path / "elsewhere"), home)[1]["step"] == 20


def test_resume_path_that_does_not_exist_is_one_clear_line(tmp_path):
    with pytest.raises(RunError, match="resume=/no/such.pt: no such file or folder"):
        find("/no/such.pt", tmp_path)


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda s: {"format_version": 3, "step": 5}, "config is missing; device is missing"),
        (lambda s: {key: value for key, value in s.items() if key != "rng"}, "rng is missing"),
        (lambda s: {**s, "tracker": "abc"}, "tracker is a str"),
        (lambda s: {**s, "step": "5"}, "step is a str"),
        (lambda s: {**s, "step": -1}, "step=-1 is not a count"),
        (lambda s: {**s, "probe": {"indices": s["probe"]["indices"]}}, "probe.loss is missing"),
        (lambda s: {**s, "position": {}}, "position.epoch is missing; position.sample is missing"),
        (lambda s: {**s, "device": {}}, "device.type is missing"),
        (lambda s: {**s, "optimizer": {}}, "optimizer.state is missing; optimizer.param_groups is missing"),
        (lambda s: {**s, "scheduler": {}}, "scheduler.last_epoch is missing"),
        (lambda s: {**s, "model": {**s["model"], "head.bias": 1}}, "model holds non-tensors at head.bias"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_an_incomplete_checkpoint_is_named_in_one_line_and_resume_last_falls_back_past_it(
    tmp_path, caplog, change, problem
):
    save_steps(tmp_path, 10)
    torch.save(change(state(20)), tmp_path / "step_00000020.pt")
    with pytest.raises(CheckpointError) as raised:
        load(tmp_path / "step_00000020.pt")
    message = str(raised.value)
    assert message.startswith(f"{tmp_path / 'step_00000020.pt'} is not a complete checkpoint: ") and "\n" not in message
    assert problem in message
    with caplog.at_level(logging.WARNING):
        assert find("last", tmp_path)[1]["step"] == 10
    assert "is not a complete checkpoint" in caplog.text


def test_a_claim_held_by_another_process_is_refused_naming_it_and_kill_9_frees_it(tmp_path):
    holder = hold(tmp_path)
    with pytest.raises(RunError) as raised, claim(tmp_path):
        pass
    assert str(raised.value).startswith(f"{tmp_path} is in use by PID {holder.pid} on {socket.gethostname()}, started ")
    assert str(raised.value).endswith("or train separately with name=<another name>")
    holder.kill()
    holder.wait()
    with claim(tmp_path):
        pass


def test_a_child_forked_by_the_holder_does_not_keep_the_lock_after_the_holder_is_killed(tmp_path):
    """Data-loader workers are forked children, which off Linux outlive a killed run for seconds."""
    holder = hold(tmp_path, fork=True)
    holder.kill()
    holder.wait()
    with claim(tmp_path):  # at once, while the child still runs
        pass


def test_a_claim_removes_only_the_temporary_files_this_module_writes(tmp_path):
    save_steps(tmp_path, 10)
    ours = ["step_00000020.pt.4242-0a1b2c3d.tmp", "latest.4242-0a1b2c3d.tmp", "write-test.4242-0a1b2c3d.tmp"]
    foreign = ["thesis.tmp", "step_00000020.pt.tmp", "notes.pt", "latest.backup"]
    for name in ours + foreign:
        (tmp_path / name).write_text("left over")
    with claim(tmp_path):
        pass
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [*foreign, "latest", "run.lock", "step_00000010.pt"]
    )


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_file_that_links_elsewhere_is_refused_in_one_line_and_what_it_names_is_untouched(tmp_path, link):
    thesis, home = tmp_path / "thesis.txt", tmp_path / "checkpoints" / "x"
    thesis.write_text("my thesis")
    home.mkdir(parents=True)
    (home / "run.lock").symlink_to(thesis) if link == "symbolic" else (home / "run.lock").hardlink_to(thesis)
    with pytest.raises(RunError) as raised, claim(home):
        pass
    lock = home / "run.lock"
    assert str(raised.value) == (
        f"{lock} is a {link} link, which this run would write through; it writes only files of its own there: "
        f"remove it (rm {lock}) and run again"
    )
    assert thesis.read_text() == "my thesis"


def test_the_files_a_claim_and_a_save_write_replace_links_instead_of_writing_through_them(tmp_path):
    """`latest`, a checkpoint's own name, and the sweep's result files: written under a new name
    and renamed over whatever stood there, so a link is replaced, never followed."""
    outside = tmp_path / "outside.txt"
    outside.write_text("mine")
    home = tmp_path / "home"
    home.mkdir()
    for name in ("latest", "step_00000010.pt", "result.json"):
        (home / name).symlink_to(outside)
    save_steps(home, 10)
    write_text(home / "result.json", "{}")
    assert outside.read_text() == "mine"
    assert not any((home / name).is_symlink() for name in ("latest", "step_00000010.pt", "result.json"))
    assert load(home / "step_00000010.pt").state["step"] == 10


def test_checkpoints_are_set_aside_into_a_new_folder_even_when_its_name_is_taken(tmp_path, monkeypatch):
    save_steps(tmp_path, 10, 20)
    monkeypatch.setattr(checkpoint_home.time, "strftime", lambda pattern: "20260101-000000")
    taken = tmp_path / "set-aside-20260101-000000-after-step-10"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    taken.symlink_to(elsewhere)
    folder = set_aside_newer(tmp_path, 10)
    assert folder == tmp_path / "set-aside-20260101-000000-after-step-10-1"
    assert [path.name for path in folder.iterdir()] == ["step_00000020.pt"] and not list(elsewhere.iterdir())


@pytest.mark.parametrize("where", ["name", "folder"])
def test_a_name_longer_than_the_file_system_allows_is_refused_in_one_line(tmp_path, where):
    home = tmp_path / "checkpoints" / ("n" * 300) if where == "name" else tmp_path / ("d" * 300) / "demo"
    with pytest.raises(RunError) as raised, claim(home):
        pass
    assert str(raised.value) == (
        f"cannot write checkpoints to {home}: its part {home.parts[-1 if where == 'name' else -2][:40]!r}... is 300 "
        f"bytes, more than the file system allows in a name; choose a shorter name=<name> or checkpoint.dir=<path>"
    )


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_anything_is_written(tmp_path):
    target = tmp_path / "not-a-folder"
    target.write_text("mine")
    with pytest.raises(RunError) as raised, claim(target):
        pass
    assert str(raised.value) == (
        f"cannot write checkpoints to {target} (it is a file, not a folder); free space or fix its permissions, "
        f"or choose another folder with checkpoint.dir=<path>"
    )
    assert target.read_text() == "mine"


@contextlib.contextmanager
def unwritable(folder: Path):
    """A folder this process cannot write to: read-only for a normal user; immutable for root,
    whom permissions do not stop."""
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield "Permission denied"
        folder.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
        pytest.skip("running as root, and this file system cannot make a folder immutable")
    try:
        yield "Operation not permitted"
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_folder_that_cannot_be_written_is_refused_with_the_os_reason(tmp_path):
    with unwritable(tmp_path / "locked") as reason:
        with pytest.raises(RunError) as raised, claim(tmp_path / "locked" / "demo"):
            pass
        assert str(raised.value).startswith(f"cannot write checkpoints to {tmp_path / 'locked' / 'demo'} ({reason});")


def test_a_save_onto_a_full_disk_says_so_and_leaves_the_previous_checkpoint_and_no_partial_file(tmp_path, monkeypatch):
    if not Path("/dev/full").exists():
        pytest.skip("needs /dev/full, which fails every write with ENOSPC")
    save_steps(tmp_path, 10)

    def onto_a_full_disk(path, mode="r", *args, **kwargs):
        if str(path).endswith(".tmp"):  # the file really is created, then every write to it fails
            open(path, mode).close()
            return open("/dev/full", "wb")
        return open(path, mode, *args, **kwargs)

    monkeypatch.setattr("{{cookiecutter.package}}.engine.files.open", onto_a_full_disk, raising=False)
    with pytest.raises(SaveError) as raised:
        save(state(20), tmp_path, keep_last=1)
    assert str(raised.value) == f"could not write {tmp_path / 'step_00000020.pt'} (No space left on device)"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_00000010.pt"]
    assert (tmp_path / "latest").read_text() == "step_00000010.pt"


def test_retention_removes_only_checkpoints_named_as_this_module_names_them(tmp_path):
    (tmp_path / "step_7.pt").write_text("my own weights")
    save_steps(tmp_path, 10, 20, 30, keep_last=1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["latest", "step_00000030.pt", "step_7.pt"]


def test_a_checkpoint_retention_may_not_delete_stays_with_a_warning_and_saving_goes_on(tmp_path, caplog):
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr to make one file undeletable")
    save_steps(tmp_path, 10)
    protected = tmp_path / "step_00000010.pt"
    if subprocess.run(["chattr", "+i", str(protected)]).returncode != 0:
        pytest.skip("this file system cannot make a file immutable")
    try:
        with caplog.at_level(logging.WARNING):
            save_steps(tmp_path, 20, keep_last=1)
    finally:
        subprocess.run(["chattr", "-i", str(protected)], check=True)
    assert f"could not remove {protected} (Operation not permitted); it stays" in caplog.text
    assert find("last", tmp_path)[1]["step"] == 20


def save_folder(home: Path, step: int, keep_last: int = 3) -> Path:
    """A sharded checkpoint as the processes leave it for rank 0 to complete (written here by one
    process, without a process group): shards in a temporary folder, then `complete`."""
    temporary = sharded.temporary_folder(home, step)
    writer = dcp_files.ChecksummingWriter(temporary)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it saves without a process group
        dcp.save({"model": state(step)["model"]}, storage_writer=writer)
    rest = {key: value for key, value in state(step).items() if key not in SHARDED_PARTS}
    return sharded.complete({**rest, "shards": writer.files}, temporary, home, keep_last)


def test_sharded_checkpoints_are_folders_kept_set_aside_and_cleaned_up_as_files_are(tmp_path):
    (tmp_path / "step_7").mkdir()  # a user's folder, not named as this module names checkpoints
    (tmp_path / "step_00000099").write_text("a file where a folder checkpoint would be")
    for step in (10, 20, 30, 40):
        path = save_folder(tmp_path, step)
    assert path == tmp_path / "step_00000040" and (tmp_path / "latest").read_text() == "step_00000040"
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "latest", "step_00000020", "step_00000030", "step_00000040", "step_00000099", "step_7"
    ]  # fmt: skip
    assert find("last", tmp_path)[1]["step"] == 40

    folder = set_aside_newer(tmp_path, 20)
    assert sorted(path.name for path in folder.iterdir()) == ["step_00000030", "step_00000040"]
    assert (folder / "step_00000040" / STATE).is_file()
    assert find("last", tmp_path)[1]["step"] == 20

    leftover = sharded.temporary_folder(tmp_path, 50)  # a save cut short by kill -9
    leftover.mkdir()
    (leftover / "__1_0.distcp").write_bytes(b"half")
    assert find("last", tmp_path)[1]["step"] == 20  # never taken for a checkpoint
    with claim(tmp_path):
        pass
    assert not leftover.exists() and (tmp_path / "step_7").is_dir()


def test_a_sharded_checkpoint_whose_shard_is_missing_or_cut_short_is_named_and_skipped(tmp_path, caplog):
    save_folder(tmp_path, 10)
    newest = save_folder(tmp_path, 20)
    state_file = newest / STATE
    saved = torch.load(state_file, weights_only=True)
    size, checksum = saved["shards"]["__0_0.distcp"]
    torch.save({**saved, "shards": {**saved["shards"], "__0_0.distcp": [size, checksum ^ 1]}}, state_file)
    with pytest.raises(CheckpointError, match="step_00000020 was refused: its shard file __0_0.distcp no longer"):
        load(newest)
    (newest / "__0_0.distcp").write_bytes(b"cut")
    with pytest.raises(CheckpointError, match="its shard file __0_0.distcp is truncated or extended"):
        load(newest)
    (newest / "__0_0.distcp").unlink()
    with caplog.at_level(logging.WARNING):
        assert find("last", tmp_path)[1]["step"] == 10
    assert "its shard file __0_0.distcp is missing" in caplog.text
