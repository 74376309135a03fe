"""Any task by config alone: the task says what a batch holds for the model and turns its outputs
into a loss averaged over what it counts. The language-model example (experiment=char_lm) resumes
bit for bit, logs tokens a second, and trains sharded over blocks in bf16."""

import math
import signal
from collections import namedtuple

import pytest
import torch
from conftest import losses
from omegaconf import open_dict
from test_distributed import finished, only_run, store, torchrun
from test_sharded import train_alone

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.devices import to_device
from {{cookiecutter.package}}.engine.errors import RunError

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# 624 sequences of 64 characters: 562 to train on, 17 batches of 32 an epoch; step 20 is mid-epoch.
LM = [
    "experiment=char_lm",
    "data.max_chars=40000",
    "trainer.max_steps=30",
    "checkpoint.every_n_steps=10",
    "trainer.val_every_n_steps=15",
]


def test_the_language_model_resumed_after_sigterm_mid_epoch_matches_the_unbroken_run_bit_for_bit(
    make_cfg, client, checkpoint_dir, tmp_path, monkeypatch, sigterm_at
):
    reference = recipe.train(make_cfg(*LM, f"checkpoint.dir={tmp_path / 'reference'}"))
    expected = losses(client, reference["run_id"])
    assert sorted(expected) == list(range(1, 31))

    sigterm_at(20)
    with pytest.raises(SystemExit) as stopped:
        recipe.train(make_cfg(*LM))
    assert stopped.value.code == 128 + signal.SIGTERM
    saved = newest_valid(checkpoint_dir)[1]
    assert (saved["step"], saved["position"]) == (20, {"epoch": 1, "sample": 3 * 32, "order": "feistel"})
    monkeypatch.undo()

    resumed = recipe.train(make_cfg(*LM, "resume=last"))
    assert resumed["continuity"] == "ok"
    assert losses(client, resumed["run_id"]) == expected
    assert (resumed["val/loss"], resumed["val/perplexity"]) == (reference["val/loss"], reference["val/perplexity"])
    # Both are per token: perplexity is exp of the loss validation reports.
    assert resumed["val/perplexity"] == pytest.approx(math.exp(resumed["val/loss"]), rel=1e-5)
    rates = losses(client, resumed["run_id"], "train/tokens_per_s")
    assert sorted(rates) == list(range(1, 31)) and all(rate > 0 for (rate, *_) in rates.values())
    assert client.get_metric_history(resumed["run_id"], "train/samples_per_s") == []


# Sequences whose targets are padded (-100, cross-entropy's ignore_index) after 0 to 16 tokens.
PADDED = """
import torch
from torch.utils.data import TensorDataset

from {{cookiecutter.package}}.engine.data import Data


def padded(count: int = 24, length: int = 16, vocab_size: int = 11) -> Data:
    tokens = torch.randint(0, vocab_size, (count, length + 1), generator=torch.Generator().manual_seed(0))
    targets = tokens[:, 1:].clone()
    for row in range(count):
        targets[row, row % (length + 1) :] = -100
    pairs = TensorDataset(tokens[:, :-1], targets)
    return Data(train=pairs, val=pairs, vocab_size=vocab_size, block_size=length)
"""


@pytest.mark.parametrize("batch_size", [1, 5, 24])
def test_the_validation_loss_of_sequences_is_the_mean_per_token_whatever_the_batches_hold(
    make_cfg, tmp_path, monkeypatch, batch_size
):
    """Weighted per sequence, batches of 1 would give each sequence's mean the same weight however
    few tokens it holds (and a sequence of padding alone a NaN); per token, every batch size gives
    the one mean, which perplexity agrees with."""
    (tmp_path / "sequences.py").write_text(PADDED)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(
        *LM, "trainer.max_steps=0", f"data.batch_size={batch_size}", f"checkpoint.dir={tmp_path / 'checkpoints'}"
    )
    with open_dict(cfg):
        cfg.data = {"_target_": "sequences.padded", "batch_size": batch_size}
    result = recipe.train(cfg)
    # The untrained model's loss over all the target tokens of the 24 sequences, computed in one go.
    import sequences

    model = recipe.components.build("model", cfg.model, vocab_size=11, block_size=16)
    model.load_state_dict(newest_valid(tmp_path / "checkpoints")[1]["model"])
    inputs, targets = sequences.padded().val.tensors
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model.eval()(inputs).flatten(0, 1), targets.flatten()).item()
    assert result["val/loss"] == pytest.approx(expected, rel=1e-6)
    assert result["val/perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)


Pair = namedtuple("Pair", "image label")


def test_a_batch_of_any_structure_of_tensors_is_moved_whole_and_kept_in_its_shape():
    """As torch's default collation batches the samples: tuples, namedtuples, lists, dicts, nested."""
    batch = {
        "pair": Pair(torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long)),
        "more": (torch.zeros(2), [torch.zeros(1), "text"]),
        "count": 3,
    }
    moved = to_device(batch, torch.device("meta"), non_blocking=False, channels_last=True)
    assert isinstance(moved["pair"], Pair) and isinstance(moved["more"], tuple) and isinstance(moved["more"][1], list)
    assert [tensor.device.type for tensor in (*moved["pair"], moved["more"][0], moved["more"][1][0])] == ["meta"] * 4
    assert moved["more"][1][1] == "text" and moved["count"] == 3
    assert moved["pair"].image.is_contiguous(memory_format=torch.channels_last)  # images laid out as the model is


def test_the_language_model_sharded_over_its_blocks_in_bf16_on_two_processes_resumes_on_one(project):
    steps = ["trainer.max_steps=4", "checkpoint.every_n_steps=2", "trainer.val_every_n_steps=2"]
    lm = [*LM[:2], "strategy.blocks=[Block]", "amp=bf16", "trainer.log_every_n_steps=1"]
    finished(torchrun(project, *lm, *steps, strategy="fsdp"))
    alone = train_alone(project, *lm, "trainer.max_steps=6", "resume=last")
    assert "resumed at step 4 on cpu" in alone and "(ok)" in alone

    client = store(project)
    run = only_run(client, "char-lm")
    assert run.data.tags["strategy"] == "fsdp" and run.data.tags["continuity"] == "ok"
    assert sorted(losses(client, run.info.run_id)) == list(range(1, 7))  # each step once
    assert sorted(losses(client, run.info.run_id, "train/tokens_per_s")) == list(range(1, 7))


# Samples that are dicts, for a task left at its default keys (0 and 1).
DICTS = """
import torch
from torch.utils.data import Dataset

from {{cookiecutter.package}}.engine.data import Data


class Points(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"x": torch.full((4,), float(index)), "y": index % 3}


def points() -> Data:
    return Data(train=Points(), val=Points(), input_shape=(4,), num_classes=3)
"""


def test_a_task_whose_keys_are_not_the_batchs_stops_before_the_first_step_naming_the_keys_to_set(
    make_cfg, tmp_path, monkeypatch, checkpoint_dir
):
    (tmp_path / "dicts.py").write_text(DICTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg()
    with open_dict(cfg):
        cfg.data = {"_target_": "dicts.points", "batch_size": 8}
    with pytest.raises(RunError) as raised:
        recipe.train(cfg)
    assert str(raised.value) == (
        "task ({{cookiecutter.package}}.tasks.Supervised) cannot split the data's batch {'x': (8, 4) float32, 'y': (8,) int64}: 0; "
        "its keys: x, y, so set task.inputs=<key> task.targets=<key>"
    )
    assert not checkpoint_dir.exists(), "a run refused at start leaves no folder"
