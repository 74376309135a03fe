"""Checkpoint files: atomic saves, retention, the `latest` pointer, damage, unsafe pickles, and
what `resume=` finds."""

import logging
import os
from pathlib import Path

import pytest
import torch

from {{cookiecutter.package}} import checkpoints
from {{cookiecutter.package}}.checkpoints import CheckpointError
from {{cookiecutter.package}}.errors import RunError


def state(step: int) -> dict:
    return {"format_version": checkpoints.FORMAT_VERSION, "step": step, "weights": torch.full((64, 64), float(step))}


def save_steps(home: Path, *steps: int, keep_last: int = 10) -> None:
    for step in steps:
        checkpoints.save(state(step), home, step, keep_last)


def corrupt(path: Path) -> None:
    """Flips bytes in the middle of the file: torch.load alone would still read it."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(255 - byte for byte in data[middle : middle + 8])
    path.write_bytes(bytes(data))


def test_save_writes_the_file_and_the_latest_pointer(tmp_path):
    path = checkpoints.save(state(7), tmp_path, 7, keep_last=3)
    assert path == tmp_path / "step_00000007.pt"
    assert (tmp_path / "latest").read_text() == "step_00000007.pt"
    assert torch.equal(checkpoints.load(path)["weights"], torch.full((64, 64), 7.0))
    assert not list(tmp_path.glob("*.tmp"))


def test_only_the_newest_keep_last_checkpoints_remain(tmp_path):
    save_steps(tmp_path, 10, 20, 30, 40, 50, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000040.pt", "step_00000050.pt"]


def test_a_crash_while_writing_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    save_steps(tmp_path, 10)
    real_save = torch.save

    def dies_halfway(obj, file):
        real_save(obj, file)
        file.truncate(100)  # part of the bytes reached the disk, then the process died
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(state(20), tmp_path, 20, keep_last=3)
    path, loaded = checkpoints.find("last", tmp_path)
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
        checkpoints.save(state(20), tmp_path, 20, keep_last=3)
    monkeypatch.setattr(os, "replace", real_replace)
    # The rename made the file whole: step 20 is complete, though the pointer still names 10.
    assert checkpoints.find("last", tmp_path)[1]["step"] == 20
    save_steps(tmp_path, 30)
    assert not list(tmp_path.glob("*.tmp")), "the next save clears what the crash left"


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one_and_says_so(tmp_path, caplog):
    save_steps(tmp_path, 10, 20)
    corrupt(tmp_path / "step_00000020.pt")
    with caplog.at_level(logging.WARNING):
        path, loaded = checkpoints.find("last", tmp_path)
    assert loaded["step"] == 10
    assert "step_00000020.pt is damaged" in caplog.text and "falling back" in caplog.text


def test_a_truncated_newest_checkpoint_falls_back_too(tmp_path, caplog):
    save_steps(tmp_path, 10, 20)
    newest = tmp_path / "step_00000020.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING):
        assert checkpoints.find("last", tmp_path)[1]["step"] == 10
    assert "step_00000020.pt is unreadable" in caplog.text


def test_naming_a_corrupted_checkpoint_explicitly_fails_clearly(tmp_path):
    save_steps(tmp_path, 10, 20)
    corrupt(tmp_path / "step_00000020.pt")
    with pytest.raises(
        CheckpointError, match="step_00000020.pt is damaged: its record .* no longer matches the checksum"
    ):
        checkpoints.find(str(tmp_path / "step_00000020.pt"), tmp_path)


class WritesAFile:
    """What a malicious checkpoint carries: unpickling it would run code."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        return exec, (f"open({str(self.target)!r}, 'w').write('pwned')",)


def test_a_malicious_pickle_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "pwned.txt"
    path = tmp_path / "step_00000001.pt"
    torch.save({"format_version": checkpoints.FORMAT_VERSION, "payload": WritesAFile(marker)}, path)
    with pytest.raises(CheckpointError, match="was refused: it holds objects that only unrestricted unpickling"):
        checkpoints.load(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the control: this file really does run code when trusted
    assert marker.read_text() == "pwned"


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="has format None; this project reads format 1"):
        checkpoints.load(path)


def test_resume_last_without_checkpoints_names_where_it_looked(tmp_path):
    with pytest.raises(RunError) as raised:
        checkpoints.find("last", tmp_path / "nothing")
    assert f"resume=last found no valid checkpoint in {tmp_path / 'nothing'}" in str(raised.value)
    assert "resume=auto" in str(raised.value)


def test_resume_auto_with_only_damaged_checkpoints_stops_instead_of_starting_over(tmp_path):
    save_steps(tmp_path, 10)
    corrupt(tmp_path / "step_00000010.pt")
    for resume in ("auto", "last"):
        with pytest.raises(RunError, match=f"resume={resume}: .* holds checkpoints, but none loads"):
            checkpoints.find(resume, tmp_path)


def test_checkpoints_past_a_step_are_set_aside_not_deleted(tmp_path):
    save_steps(tmp_path, 10, 20, 30)
    folder = checkpoints.set_aside_newer(tmp_path, 10)
    assert sorted(path.name for path in folder.iterdir()) == ["step_00000020.pt", "step_00000030.pt"]
    assert checkpoints.find("last", tmp_path)[1]["step"] == 10
    assert checkpoints.set_aside_newer(tmp_path, 10) is None


def test_resume_auto_without_checkpoints_starts_fresh_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert checkpoints.find("auto", tmp_path) is None
    assert "starting fresh" in caplog.text


def test_resume_none_means_fresh_even_with_checkpoints_present(tmp_path):
    save_steps(tmp_path, 10)
    assert checkpoints.find(None, tmp_path) is None


def test_resume_path_takes_a_file_or_the_newest_in_a_folder(tmp_path):
    save_steps(tmp_path / "elsewhere", 10, 20)
    home = tmp_path / "home"
    assert checkpoints.find(str(tmp_path / "elsewhere" / "step_00000010.pt"), home)[1]["step"] == 10
    assert checkpoints.find(str(tmp_path / "elsewhere"), home)[1]["step"] == 20


def test_resume_path_that_does_not_exist_is_one_clear_line(tmp_path):
    with pytest.raises(RunError, match="resume=/no/such.pt: no such file or folder"):
        checkpoints.find("/no/such.pt", tmp_path)
