"""Arrow shards (engine/data/formats/arrow.py, save_to_disk.py): a folder as Hugging Face datasets' save_to_disk
writes it, read a sample at a time with pyarrow alone into the samples its source holds, described
once by a manifest that each start checks with a stat per shard, recorded by the run's checkpoint so
that a resume on changed shards is refused, and named when a shard is damaged under the run."""

import json
import os
import shutil
import subprocess
import sys
import threading

import numpy
import pyarrow as pa
import pytest
import torch
from conftest import losses, made_a_fifo, start, unlinked

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.data.contract import DataError
from {{cookiecutter.package}}.engine.data.formats import arrow
from {{cookiecutter.package}}.engine.data.formats.arrow import arrow_folder
from {{cookiecutter.package}}.engine.data.formats.manifest import ShardDamaged, fingerprint
from {{cookiecutter.package}}.engine.data.formats.save_to_disk import MANIFEST, WRITE_BATCH, ArrowShard, described, write_digits
from {{cookiecutter.package}}.engine.data.workers import Loader
from {{cookiecutter.package}}.engine.ready.datasets import digits

DESCRIBE = [sys.executable, "-m", "{{cookiecutter.package}}.engine.data.formats.arrow", "describe"]
# The demo's MLP, small, on the digits read from Arrow shards.
MLP = ["experiment=arrow_digits", "data.batch_size=16", "model.hidden_sizes=[16]", "trainer.max_steps=4"]


@pytest.fixture
def folder(tmp_path):
    """The digits as a DatasetDict: train in two shards of 719 rows, validation in one of 359."""
    write_digits(tmp_path / "digits", shards=2)
    return tmp_path / "digits"


def saved(folder, columns, shards=2, features=None):
    """A Dataset folder as save_to_disk lays it out, written with pyarrow: the rows of `columns` in
    `shards` files of record batches of 7 rows, described."""
    table = pa.table(columns)
    folder.mkdir(parents=True)
    files = [f"data-{number:05d}-of-{shards:05d}.arrow" for number in range(shards)]
    for file, rows in zip(files, numpy.array_split(numpy.arange(len(table)), shards), strict=True):
        with pa.OSFile(str(folder / file), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as stream:
            stream.write_table(table.slice(rows[0], len(rows)), max_chunksize=7)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": file} for file in files]}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": features or {}}))
    described(folder)
    return folder


def test_the_written_digits_read_as_the_digits_samples_with_the_facts_a_model_needs(folder):
    data, source = arrow_folder(folder, inputs="pixels", target="label"), digits(val_fraction=0.2)
    for ours, theirs in ((data.train, source.train), (data.val, source.val)):
        assert len(ours) == len(theirs)
        assert all(all(torch.equal(a, b) for a, b in zip(ours[i], theirs[i], strict=True)) for i in range(len(ours)))
    inputs, label = data.train[0]
    assert (inputs.dtype, label.dtype, label.shape) == (torch.float32, torch.int64, ())
    assert data.facts["input_shape"] == (1, 8, 8) and data.facts["num_classes"] == 10
    assert data.facts["labels"] == [str(digit) for digit in range(10)]
    manifest = json.loads((folder / "train" / MANIFEST).read_text())
    assert data.facts["fingerprint"] == manifest["fingerprint"]
    assert [shard["samples"] for shard in manifest["shards"]] == [719, 719]


def test_lists_nested_fixed_and_variable_read_as_tensors_of_their_shape_float32_or_int64(tmp_path):
    grid = numpy.arange(40 * 6, dtype=numpy.float16).reshape(40, 2, 3)
    columns = {
        "grid": pa.array(grid.tolist(), pa.list_(pa.list_(pa.float16()))),  # variable lists, every one of 2 x 3
        "codes": pa.array([[row, -row] for row in range(40)], pa.large_list(pa.int8())),
        "fixed": pa.array([[row / 2] * 4 for row in range(40)], pa.list_(pa.float64(), 4)),
        "label": pa.array([row % 3 for row in range(40)], pa.uint8()),
    }
    data = arrow_folder(saved(tmp_path / "set", columns, shards=3), ["grid", "codes", "fixed"], "label", val_every=4)
    assert (len(data.train), len(data.val)) == (30, 10)
    rows = sorted([data.train.row(i) for i in range(30)] + [data.val.row(i) for i in range(10)])
    assert rows == list(range(40)) and data.val.row(0) == 3  # every 4th row validates, each row in one split
    for index in range(30):
        sample, row = data.train[index], data.train.row(index)
        assert sample["grid"].dtype == torch.float32 and sample["grid"].tolist() == grid[row].tolist()
        assert sample["codes"].dtype == torch.int64 and sample["codes"].tolist() == [row, -row]
        assert sample["fixed"].tolist() == [row / 2] * 4 and sample["label"].item() == row % 3
    assert data.facts["input_shapes"] == {"grid": (2, 3), "codes": (2,), "fixed": (4,)}
    assert data.facts["num_classes"] == 3 and "labels" not in data.facts  # no ClassLabel: the largest value + 1


@pytest.mark.slow  # imports datasets, pandas and what they bring
def test_a_folder_that_datasets_saved_reads_as_datasets_reads_it_and_ours_loads_in_datasets(folder, tmp_path):
    datasets = pytest.importorskip("datasets")
    features = datasets.Features(
        {
            "image": datasets.Array2D((4, 6), "float32"),
            "tokens": datasets.Sequence(datasets.Value("int32")),
            "label": datasets.ClassLabel(names=["cat", "dog", "eel"]),
        }
    )
    generator = numpy.random.default_rng(0)
    rows = {
        "image": generator.random((90, 4, 6), dtype=numpy.float32),
        "tokens": [[row, row + 1, row + 2] for row in range(90)],
        "label": generator.integers(0, 3, 90),
    }
    dataset = datasets.Dataset.from_dict(rows, features=features)
    dataset.train_test_split(test_size=0.2, seed=0).save_to_disk(tmp_path / "hf", num_shards={"train": 3, "test": 1})
    result = subprocess.run([*DESCRIBE, str(tmp_path / "hf")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    data = arrow_folder(tmp_path / "hf", ["image", "tokens"], "label", val_split="test")
    theirs = datasets.load_from_disk(tmp_path / "hf").with_format("numpy")
    for ours, split in ((data.train, "train"), (data.val, "test")):
        assert len(ours) == len(theirs[split])
        for index in range(len(ours)):
            row = theirs[split][index]
            assert ours[index]["image"].numpy().tolist() == row["image"].tolist()
            assert ours[index]["tokens"].tolist() == row["tokens"].tolist() and ours[index]["label"] == row["label"]
    assert (data.facts["num_classes"], data.facts["labels"]) == (3, ["cat", "dog", "eel"])
    # The digits written here are a folder datasets reads too, its manifest beside its files no matter.
    loaded = datasets.load_from_disk(folder).with_format("numpy")
    ours = arrow_folder(folder, inputs="pixels", target="label")
    assert loaded["train"].features["label"].names == ours.facts["labels"]
    for index in (0, 718, 719, len(ours.train) - 1):
        assert loaded["train"][index]["pixels"].tolist() == ours.train[index][0].tolist()
        assert loaded["train"][index]["label"] == ours.train[index][1]


@pytest.mark.slow  # two short trainings
def test_the_mlp_trains_on_arrow_shards_the_same_steps_with_two_workers_as_without(make_cfg, client, folder, tmp_path):
    alone = recipe.train(make_cfg(*MLP, f"data.dir={folder}", f"checkpoint.dir={tmp_path / 'alone'}"))
    workers = recipe.train(make_cfg(*MLP, f"data.dir={folder}", "data.num_workers=2"))
    assert sorted(losses(client, alone["run_id"])) == [1, 2, 3, 4]
    assert losses(client, workers["run_id"]) == losses(client, alone["run_id"])
    assert workers["val/loss"] == alone["val/loss"]


@pytest.mark.slow  # a short training
def test_a_gpt_trains_on_arrow_token_rows_with_its_vocab_and_block_size_from_the_data(make_cfg, client, tmp_path):
    rows = numpy.random.default_rng(0).integers(0, 50, (60, 17))
    targets = rows[:, 1:].copy()
    targets[::2, -1] = -100  # padding, which cross-entropy ignores: no token
    columns = {"input_ids": pa.array(rows[:, :-1].tolist(), pa.list_(pa.int32())), "labels": targets.tolist()}
    folder = saved(tmp_path / "tokens", columns)
    data = arrow_folder(folder, inputs="input_ids", target="labels")
    assert (data.facts["vocab_size"], data.facts["block_size"]) == (rows.max() + 1, 16)
    assert "num_classes" not in data.facts  # next tokens, no classes: the model stays a language model
    gpt = ["data=arrow_folder", "task=next_token", "model=gpt", "metrics=language_model"]
    columns = ["data.inputs=input_ids", "data.target=labels", "data.batch_size=8", "trainer.max_steps=3"]
    result = recipe.train(make_cfg(*gpt, *columns, f"data.dir={folder}"))
    assert sorted(losses(client, result["run_id"])) == [1, 2, 3] and result["val/perplexity"] > 1


def rows_of(path):
    return pa.ipc.open_stream(pa.OSFile(str(path))).read_all()  # in memory, not mapped: the file is written over


def rewritten(path, table):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table, max_chunksize=WRITE_BATCH)


def other_rows(train):
    """The first shard written again with other rows (the second's, reversed): the same size."""
    table = rows_of(train / "data-00001-of-00002.arrow")
    rewritten(train / "data-00000-of-00002.arrow", table.take(list(reversed(range(len(table))))))


def replaced(train):
    other_rows(train)
    return "data-00000-of-00002.arrow replaced"


def shrunk(train):
    rewritten(train / "data-00001-of-00002.arrow", rows_of(train / "data-00001-of-00002.arrow").slice(0, 500))
    return "data-00001-of-00002.arrow replaced"


def added(train):
    shutil.copy(train.parent / "validation" / "data-00000-of-00001.arrow", train / "data-00002-of-00002.arrow")
    state = json.loads((train / "state.json").read_text())
    state["_data_files"].append({"filename": "data-00002-of-00002.arrow"})
    (train / "state.json").write_text(json.dumps(state))
    return "data-00002-of-00002.arrow added"


def removed(train):
    state = json.loads((train / "state.json").read_text())
    (train / "state.json").write_text(json.dumps({**state, "_data_files": state["_data_files"][:1]}))
    (train / "data-00001-of-00002.arrow").unlink()
    return "data-00001-of-00002.arrow removed"


@pytest.mark.parametrize("change", [replaced, shrunk, added, removed])
def test_a_checkpoint_of_other_shards_described_again_is_refused_naming_the_shard_unless_accepted(folder, change):
    recorded = arrow_folder(folder, inputs="pixels", target="label").state_dict()
    said = change(folder / "train")
    described(folder)
    with pytest.raises(DataError, match=f"{said}; put the checkpoint's shards back") as refused:
        arrow_folder(folder, inputs="pixels", target="label").load_state_dict(recorded)
    assert "\n" not in str(refused.value)
    arrow_folder(folder, inputs="pixels", target="label", accept_changed_shards=True).load_state_dict(recorded)


@pytest.mark.slow  # three short trainings
def test_a_resume_on_a_shard_saved_again_is_refused_before_a_step_unless_accepted(make_cfg, folder, checkpoint_dir):
    recipe.train(make_cfg(*MLP, f"data.dir={folder}", "checkpoint.every_n_steps=2", "trainer.max_steps=2"))
    other_rows(folder / "train")
    described(folder)
    resumed = [*MLP, f"data.dir={folder}", "resume=last"]
    with pytest.raises(DataError, match="data-00000-of-00002.arrow replaced; put the checkpoint's shards back"):
        recipe.train(make_cfg(*resumed))
    assert sorted(path.name for path in checkpoint_dir.glob("step_*")) == ["step_00000002.pt"]  # nothing saved
    assert recipe.train(make_cfg(*resumed, "data.accept_changed_shards=true"))["step"] == 4


def without_manifest(train):
    (train / MANIFEST).unlink()
    return f"{train} has no {MANIFEST}: describe it once: "


def cut_short(train):
    os.truncate(train / "data-00001-of-00002.arrow", 1000)
    return "data-00001-of-00002.arrow is 1000 bytes, its manifest says [0-9]+: it changed since it was written"


def written_over_at_the_same_size(train):
    other_rows(train)
    return "data-00000-of-00002.arrow is not the file its manifest hashed; describe it again"


def saved_with_another_shard(train):
    added(train)
    return f"data-00002-of-00002.arrow is not in {MANIFEST}: describe it again"


def saved_with_a_shard_less(train):
    state = json.loads((train / "state.json").read_text())
    (train / "state.json").write_text(json.dumps({**state, "_data_files": state["_data_files"][:1]}))
    return f"data-00001-of-00002.arrow, listed in {MANIFEST}, is not in state.json"


def without_a_shard(train):
    (train / "data-00001-of-00002.arrow").unlink()
    return f"data-00001-of-00002.arrow, listed in {MANIFEST}, is missing; describe it again"


@pytest.mark.parametrize(
    "change",
    [without_manifest, cut_short, written_over_at_the_same_size, saved_with_another_shard, saved_with_a_shard_less,
     without_a_shard],
)  # fmt: skip
def test_a_folder_that_does_not_match_its_manifest_is_refused_in_one_line_naming_the_file_and_the_command(
    folder, change
):
    said = change(folder / "train")
    with pytest.raises(DataError, match=said) as refused:
        arrow_folder(folder, inputs="pixels", target="label", accept_changed_shards=True)
    message = str(refused.value)
    assert "\n" not in message and f"python -m {{cookiecutter.package}}.engine.data.formats.arrow describe {folder}" in message


@pytest.mark.parametrize(
    "column, inputs, said",
    [
        (pa.array([[1.0] * (row % 3 + 1) for row in range(20)]), "x", "holds samples of different shapes in"),
        (pa.array([str(row) for row in range(20)]), "x", "holds string, not numbers or lists of numbers"),
        (pa.array([None, *range(19)], pa.float32()), "x", "has 1 missing values"),
        (pa.array(range(20)), "y", "data.inputs=y is no column of"),
    ],
    ids=["ragged", "text", "nulls", "unknown"],
)
def test_a_column_that_gives_no_tensor_of_one_shape_is_refused_in_one_line(tmp_path, column, inputs, said):
    folder = saved(tmp_path / "set", {"x": column, "label": pa.array([row % 2 for row in range(20)])})
    with pytest.raises(DataError, match=said) as refused:
        arrow_folder(folder, inputs=inputs, target="label")
    assert "\n" not in str(refused.value)


def test_a_split_the_dataset_dict_lacks_is_refused_with_the_setting_that_holds_out_training_rows(folder):
    with pytest.raises(DataError, match="holds the splits train, validation, not test; use data.val_split=<split>, or"):
        arrow_folder(folder, inputs="pixels", target="label", val_split="test")
    data = arrow_folder(folder, inputs="pixels", target="label", val_split=None)
    assert (len(data.train), len(data.val)) == (1438 - 143, 143)


def test_a_shard_written_over_under_the_run_is_named_with_the_sample_in_one_line_in_process_and_from_a_worker(
    folder,
):
    data = arrow_folder(folder, inputs="pixels", target="label")
    first = folder / "train" / "data-00000-of-00002.arrow"
    size = first.stat().st_size
    data.train[0]  # this process has the shard open: it is written over in place, at its size, with other rows
    other_rows(folder / "train")
    with pytest.raises(ShardDamaged) as damaged:
        data.train[1]
    said = f"cannot read sample 1 from {first} (it is {size} bytes now, written since the run started; its manifest"
    assert str(damaged.value).startswith(said)
    last, second = len(data.train) - 1, folder / "train" / "data-00001-of-00002.arrow"
    os.truncate(second, 100)
    loader = Loader(data.train, batch_size=None, sampler=[last - 1, last], num_workers=1)
    with pytest.raises(ShardDamaged) as damaged:
        list(loader)
    message = str(damaged.value)
    assert message.startswith(f"cannot read sample {last - 1} from {second} (it is 100 bytes now, written since the")
    assert "\n" not in message and "Traceback" not in message and "put back the file of sha256" in message


@pytest.mark.parametrize("change", [made_a_fifo, unlinked])
def test_a_shard_gone_or_made_a_fifo_under_the_run_is_named_with_the_sample_in_one_line_never_opened(folder, change):
    """A shard no reader had opened yet: a FIFO there was opened (which wakes a writer waiting on it)
    and refused as another file; a shard removed ended the run in FileNotFoundError's traceback."""
    data = arrow_folder(folder, inputs="pixels", target="label")
    last, shard = len(data.train) - 1, folder / "train" / "data-00001-of-00002.arrow"
    said = change(shard)
    with pytest.raises(ShardDamaged) as damaged:
        data.train[last]
    message = str(damaged.value)
    assert message.startswith(f"cannot read sample {last} from {shard} ({said}; its manifest says")
    assert "\n" not in message


@pytest.mark.parametrize("shard", ["train/data-00001-of-00002.arrow", "validation/data-00000-of-00001.arrow"])
def test_a_shard_cut_short_under_a_run_with_workers_ends_it_with_its_line_its_checkpoint_and_exit_2(
    project, folder, save_gate, shard
):
    """A worker's refusal ends the run as one process's does: its workers ended with the reading that
    failed, not left to the exit, where they held the run for good once it had said its line. A
    validation worker's too: the training reading, left open by the error, ends with fit, or its
    workers held the MLflow sender's pipe (its end waited 60 s for them), then the exit, for good."""
    gate = save_gate()  # held at its first save, its two workers reading
    settings = [*MLP[:-1], f"data.dir={folder}", "data.num_workers=2", "trainer.max_steps=100000"]
    process = start(project, *settings, "checkpoint.every_n_steps=2", "trainer.val_every_n_steps=4", env=gate.env)
    gate.wait(process)
    os.truncate(folder / shard, 1000)
    gate.release()
    stdout, stderr = process.communicate(timeout=120)  # seconds once the shard is read again; it never ended
    said = stderr.strip().splitlines()[-1]
    assert process.returncode == 2 and "Traceback" not in stderr, stderr
    assert "MLflow is slow" not in stdout + stderr
    newest = (project / "checkpoints" / "arrow-digits" / "latest").read_text().strip()
    assert said.startswith("error: cannot read sample ") and f"{folder / shard} (it is 1000 bytes now" in said
    assert said.endswith(
        f"the newest checkpoint on disk is {project / 'checkpoints' / 'arrow-digits' / newest}; "
        f"continue from it with name=arrow-digits resume=last"
    )


@pytest.mark.parametrize(
    "label, features, said",
    [
        (2**40, {}, "holds 1099511627776 in {train}, which would make 1099511627777 classes, a model output each"),
        (2, {"label": {"names": ["a", "b"], "_type": "ClassLabel"}}, "holds 2 in {train}, past the 2 names of its"),
    ],
    ids=["an id", "past its names"],
)
def test_a_label_that_is_no_class_number_is_refused_in_one_line_naming_the_column_and_the_folder(
    tmp_path, label, features, said
):
    """A label of 2**40 made a model of as many outputs, and torch's allocator said so, naming nothing;
    a label past its ClassLabel's names failed the loss at the step that drew it (a GPU's device assert)."""
    labels = pa.array([row % 2 for row in range(19)] + [label])
    train = saved(
        tmp_path / "set", {"x": pa.array([float(row) for row in range(20)]), "label": labels}, features=features
    )
    with pytest.raises(DataError) as refused:
        arrow_folder(train, inputs="x", target="label", val_every=4)
    message = str(refused.value)
    assert message.startswith("data.target=label " + said.format(train=train)) and "\n" not in message


def bounded(call) -> object:
    """What `call()`, in a thread of this process, returned or raised (SystemExit too), once it has
    ended. A bound on the wait: a reading that opens a FIFO waits for a writer for good, and the test
    fails after 120 s instead."""
    ended = []

    def target() -> None:
        try:
            ended.append(call())
        except BaseException as raised:  # SystemExit too: what the test looks at
            ended.append(raised)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(120)
    assert ended, "still waiting after 120 s"
    return ended[0]


def fifo_for_a_shard(folder):
    shard = folder / "train" / "data-00001-of-00002.arrow"
    shard.unlink()
    os.mkfifo(shard)
    return shard


def test_a_fifo_where_a_shard_should_be_is_refused_in_one_line_by_describe_never_waited_on(folder, monkeypatch, capsys):
    """Opened to be hashed, a FIFO waited for a writer for good: describe never ended. `python -m ...
    describe <folder>`, asked in this process within a bounded wait."""
    shard = fifo_for_a_shard(folder)
    monkeypatch.setattr(sys, "argv", ["-m", "describe", str(folder)])
    exited = bounded(arrow.main)
    assert isinstance(exited, SystemExit) and (exited.code, capsys.readouterr().err) == (
        2, f"error: {shard} is a FIFO, not a file; put its .arrow file there, or save the dataset again with save_to_disk\n"
    )  # fmt: skip


def test_a_fifo_whose_manifest_was_sealed_again_to_say_0_bytes_is_refused_at_the_start_never_waited_on(folder):
    """Its size matched the manifest's, its mtime did not, so the start hashed it, and waited for a
    writer for good, the run's home locked. A bounded wait."""
    shard = fifo_for_a_shard(folder)
    manifest = json.loads((folder / "train" / MANIFEST).read_text())
    manifest["shards"][1]["bytes"] = 0
    manifest["fingerprint"] = fingerprint([ArrowShard(**entry) for entry in manifest["shards"]])
    (folder / "train" / MANIFEST).write_text(json.dumps(manifest))
    refused = bounded(lambda: arrow_folder(folder, inputs="pixels", target="label"))
    assert isinstance(refused, DataError), refused
    assert str(refused).startswith(f"{shard} is a FIFO, not a file; describe it") and "\n" not in str(refused)
