"""Token shards (engine/data/formats/shards.py): written from text files with their manifest, read a window
at a time, checked against the manifest before anything trains, recorded by the run's checkpoint so
that a resume on changed shards is refused, and named when one is damaged under the run."""

import json
import os
import subprocess
import sys

import numpy
import pytest
from conftest import losses, made_a_fifo, unlinked

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.data.contract import DataError
from {{cookiecutter.package}}.engine.data.formats.manifest import ShardDamaged, fingerprint
from {{cookiecutter.package}}.engine.data.formats.shards import MANIFEST, Shard, described, token_shards, write
from {{cookiecutter.package}}.engine.data.workers import Loader

# 4 shards of about 2,400 byte tokens: 3 to train on, about 38 windows of 64 each.
GPT = ["experiment=token_gpt", "data.batch_size=8", "model.width=32", "model.depth=1", "trainer.max_steps=4"]


@pytest.fixture
def texts(tmp_path):
    folder = tmp_path / "texts"
    (folder / "more").mkdir(parents=True)
    lines = [f"line {number}: {'é' * (number % 3)} the quick brown fox\n" for number in range(300)]
    (folder / "a.txt").write_text("".join(lines[:200]), encoding="utf-8")
    (folder / "more" / "b.txt").write_text("".join(lines[200:]), encoding="utf-8")
    return folder


@pytest.fixture
def shards(texts, tmp_path):
    write(texts, tmp_path / "shards", shard_tokens=3000)
    return tmp_path / "shards"


def test_shards_hold_the_bytes_of_the_texts_in_windows_of_block_size_plus_one_within_each_shard(texts, shards):
    raw = (texts / "a.txt").read_bytes() + (texts / "more" / "b.txt").read_bytes()
    manifest = json.loads((shards / MANIFEST).read_text())
    assert [entry["file"] for entry in manifest["shards"]] == [f"shard_{n:05d}.bin" for n in range(4)]
    assert sum(entry["tokens"] for entry in manifest["shards"]) == len(raw)
    assert all(entry["bytes"] == 2 * entry["tokens"] and entry["dtype"] == "uint16" for entry in manifest["shards"])
    data = token_shards(shards, block_size=64, val_shards=1)
    assert (data.facts["vocab_size"], data.facts["block_size"]) == (256, 64)
    assert data.facts["fingerprint"] == manifest["fingerprint"]
    first = manifest["shards"][0]["tokens"]
    windows = (first - 1) // 64
    inputs, targets = data.train[windows - 1]  # the last window of the first shard
    assert inputs.tolist() == list(raw[(windows - 1) * 64 : windows * 64])
    assert targets.tolist() == list(raw[(windows - 1) * 64 + 1 : windows * 64 + 1])
    assert data.train[windows][0].tolist() == list(raw[first : first + 64])  # the next shard's first, not across
    val_start = sum(entry["tokens"] for entry in manifest["shards"][:3])
    assert data.val[0][0].tolist() == list(raw[val_start : val_start + 64])


@pytest.mark.slow  # the command, in a process of its own
def test_nanogpts_uint32_train_and_val_files_read_once_described_by_the_manifest_command(tmp_path):
    tokens = numpy.arange(70_000, 70_000 + 2 * 129, dtype=numpy.uint32)
    tokens[:129].tofile(tmp_path / "train.bin")
    tokens[129:].tofile(tmp_path / "val.bin")
    command = [sys.executable, "-m", "{{cookiecutter.package}}.engine.data.formats.shards", "manifest", str(tmp_path)]
    result = subprocess.run([*command, "--dtype", "uint32", "--vocab-size", "100000"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    data = token_shards(tmp_path, block_size=64)
    assert (len(data.train), len(data.val), data.facts["vocab_size"]) == (2, 2, 100000)
    assert data.train[1][1].tolist() == tokens[65:129].tolist() and data.val[0][0].tolist() == tokens[129:193].tolist()


def test_shards_holding_a_token_past_the_vocabulary_are_refused_naming_the_shard_and_the_size_that_fits(tmp_path):
    numpy.array([5, 70_257, 9], dtype=numpy.uint32).tofile(tmp_path / "train.bin")
    with pytest.raises(DataError) as refused:
        described(tmp_path, "uint32", vocab_size=50_304)
    assert str(refused.value) == (
        f"{tmp_path / 'train.bin'} holds token 70257, which --vocab-size=50304 leaves out of the model's embedding; "
        "give the tokenizer's vocabulary size (at least 70258)"
    )
    assert not (tmp_path / MANIFEST).exists()
    assert described(tmp_path, "uint32", vocab_size=70_258)["vocab_size"] == 70_258


@pytest.mark.slow  # the command, in a process of its own
def test_the_write_command_refuses_a_folder_that_holds_files_and_leaves_it_as_it_was(texts, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep")
    command = [sys.executable, "-m", "{{cookiecutter.package}}.engine.data.formats.shards", "write", str(texts), str(taken)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "exists and is not an empty folder" in result.stderr
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []
    assert os.listdir(taken) == ["mine.txt"]


@pytest.mark.slow  # two short trainings
def test_the_gpt_trains_on_shards_the_same_steps_with_two_workers_as_without(make_cfg, client, shards, tmp_path):
    alone = recipe.train(make_cfg(*GPT, f"data.dir={shards}", f"checkpoint.dir={tmp_path / 'alone'}"))
    workers = recipe.train(make_cfg(*GPT, f"data.dir={shards}", "data.num_workers=2"))
    assert sorted(losses(client, alone["run_id"])) == [1, 2, 3, 4]
    assert losses(client, workers["run_id"]) == losses(client, alone["run_id"])
    assert workers["val/loss"] == alone["val/loss"]


def reversed_tokens(path):
    """Another shard of the same size and the same tokens."""
    numpy.fromfile(path, dtype=numpy.uint16)[::-1].tofile(path)


def grown(shards):
    with open(shards / "shard_00001.bin", "ab") as file:
        file.write(b"\0\0")
    return "shard_00001.bin is [0-9]+ bytes, its manifest says"


def without_manifest(shards):
    (shards / MANIFEST).unlink()
    return f"has no {MANIFEST}"


def with_another_shard(shards):
    (shards / "zzz.bin").write_bytes(b"\0" * 400)
    return f"zzz.bin is not in {MANIFEST}"


def without_a_shard(shards):
    (shards / "shard_00002.bin").unlink()
    return "shard_00002.bin, listed in"


def replaced_at_the_same_size(shards):
    reversed_tokens(shards / "shard_00000.bin")
    return "shard_00000.bin is not the file its manifest hashed"


@pytest.mark.parametrize(
    "change", [grown, without_manifest, with_another_shard, without_a_shard, replaced_at_the_same_size]
)
def test_a_shard_folder_that_does_not_match_its_manifest_is_refused_in_one_line_naming_the_file(shards, change):
    said = change(shards)
    with pytest.raises(DataError, match=said) as refused:
        token_shards(shards, block_size=64)
    assert "\n" not in str(refused.value)


def sealed_again(shards, change):
    """The manifest edited by `change`, its fingerprint computed anew: only its values can tell."""
    manifest = json.loads((shards / MANIFEST).read_text())
    change(manifest)
    manifest["fingerprint"] = fingerprint([Shard(**entry) for entry in manifest["shards"]])
    (shards / MANIFEST).write_text(json.dumps(manifest))


def tokens_as_text(manifest):
    manifest["shards"][0]["tokens"] = str(manifest["shards"][0]["tokens"])
    return f'the tokens of its entry "shard_00000.bin" is "{manifest["shards"][0]["tokens"]}", not a count'


def vocabulary_true(manifest):
    manifest["vocab_size"] = True
    return "its vocab_size is true, not a count of tokens"


def more_tokens_than_bytes(manifest):
    manifest["shards"][1]["tokens"] += 1
    return f"the tokens of shard_00001.bin, {manifest['shards'][1]['tokens']} of uint16, are not its"


@pytest.mark.parametrize("change", [tokens_as_text, vocabulary_true, more_tokens_than_bytes])
def test_a_manifest_sealed_again_with_a_value_of_another_kind_is_refused_in_one_line_naming_the_key(shards, change):
    """Its fingerprint matched its entries, and text where a count belongs reached Hydra's "Error in
    call to target" as a TypeError, `true` a model of one token, naming neither file nor key."""
    said = []
    sealed_again(shards, lambda manifest: said.append(change(manifest)))
    with pytest.raises(DataError) as refused:
        token_shards(shards, block_size=64)
    message = str(refused.value)
    assert message.startswith(f"{shards / MANIFEST} cannot be read (ValueError: {said[0]}") and "\n" not in message
    assert message.endswith("write the shards again (python -m {{cookiecutter.package}}.engine.data.formats.shards write <text folder> "
                            "<shard folder>) or put their manifest back")  # fmt: skip


def test_a_window_longer_than_a_shard_is_refused_with_the_block_size_that_fits(shards):
    shortest = min(entry["tokens"] for entry in json.loads((shards / MANIFEST).read_text())["shards"])
    with pytest.raises(DataError, match=f"use data.block_size={shortest - 1} or less"):
        token_shards(shards, block_size=shortest)


@pytest.mark.slow  # three short trainings
def test_a_resume_on_a_changed_shard_is_refused_naming_it_unless_accepted(make_cfg, shards, checkpoint_dir):
    recipe.train(make_cfg(*GPT, f"data.dir={shards}", "checkpoint.every_n_steps=2", "trainer.max_steps=2"))
    reversed_tokens(shards / "shard_00001.bin")  # replaced, and described again: a valid folder
    described(shards, "uint16", vocab_size=256)
    resumed = [*GPT, f"data.dir={shards}", "resume=last"]
    with pytest.raises(DataError, match="shard_00001.bin replaced; put the checkpoint's shards back"):
        recipe.train(make_cfg(*resumed))
    assert sorted(path.name for path in checkpoint_dir.glob("step_*")) == ["step_00000002.pt"]  # nothing saved

    result = recipe.train(make_cfg(*resumed, "data.accept_changed_shards=true"))
    assert result["step"] == 4


def test_a_shard_truncated_under_the_run_is_named_with_the_sample_in_one_line_from_a_worker(shards):
    data = token_shards(shards, block_size=64)
    last = len(data.train) - 1
    os.truncate(shards / "shard_00002.bin", 100)
    loader = Loader(data.train, batch_size=None, sampler=[0, last], num_workers=1)
    with pytest.raises(ShardDamaged) as damaged:
        list(loader)
    message = str(damaged.value)
    assert message.startswith(f"cannot read sample {last} from {shards / 'shard_00002.bin'} (it is 100 bytes now;")
    assert "\n" not in message and "Traceback" not in message


@pytest.mark.parametrize("change", [made_a_fifo, unlinked])
def test_a_shard_gone_or_made_a_fifo_under_the_run_is_named_with_the_sample_in_one_line_never_opened(shards, change):
    """A shard no reader had opened yet: a FIFO there failed its first read ("Illegal seek"), opened
    first (which wakes a writer waiting on it); a shard removed ended the run in FileNotFoundError's
    traceback."""
    data = token_shards(shards, block_size=64)
    last, shard = len(data.train) - 1, shards / "shard_00002.bin"
    said = change(shard)
    with pytest.raises(ShardDamaged) as damaged:
        data.train[last]
    message = str(damaged.value)
    assert message.startswith(f"cannot read sample {last} from {shard} ({said}; its manifest says")
    assert "\n" not in message


class Truncating:
    """Cuts a training shard short after the first validation: the run reads it on."""

    def __init__(self, shard: str) -> None:
        self.shard = shard

    def on_validation_end(self, run, metrics) -> None:
        os.truncate(self.shard, 100)


@pytest.mark.slow  # a short training
def test_a_shard_damaged_mid_run_ends_it_in_one_line_with_the_command_that_continues_it(
    make_cfg, shards, checkpoint_dir
):
    settings = ["checkpoint.every_n_steps=2", "trainer.val_every_n_steps=2", "trainer.max_steps=12"]
    cut = ["+callbacks.cut._target_=test_shards.Truncating", f"+callbacks.cut.shard={shards / 'shard_00002.bin'}"]
    with pytest.raises(DataError) as damaged:
        recipe.train(make_cfg(*GPT, f"data.dir={shards}", *settings, *cut))
    message = str(damaged.value)
    assert message.startswith("cannot read sample ") and "\n" not in message
    newest = sorted(checkpoint_dir.glob("step_*"))[-1]
    assert message.endswith(
        f"; the newest checkpoint on disk is {newest}; continue from it with name=token-gpt resume=last"
    ), message
