"""The ready metrics give torchmetrics' values to the last bit, alone and summed over processes, and
a run whose metrics are the ready ones never imports torchmetrics, whose `__init__` loads
scipy.signal and matplotlib: about a second of each start."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import PROJECT
from torch import multiprocessing
from torchmetrics.aggregation import SumMetric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity as TorchmetricsPerplexity

from {{cookiecutter.package}}.engine.ready.metrics import Accuracy, Perplexity, Sum


def batches(seed: int, shapes: list[tuple[int, ...]], classes: int, padded: bool = False) -> list[tuple]:
    """Random logits shaped (batch, classes, ...) or (batch, sequence, classes), and their targets,
    a third of them -100 where `padded`."""
    generator = torch.Generator().manual_seed(seed)
    found = []
    for shape in shapes:
        logits = torch.randn(shape, generator=generator) * 3
        rows = shape[:-1] if padded else shape[:1] + shape[2:]
        targets = torch.randint(classes, rows, generator=generator)
        if padded:
            targets[torch.rand(rows, generator=generator) < 1 / 3] = -100
        found.append((logits, targets))
    return found


def fed(ours, theirs, pairs: list[tuple]) -> None:
    """Each batch to both: the first by a call (a batch's value, as the wiring check asks), equal."""
    (first, *rest) = pairs
    assert torch.equal(ours(*first), theirs(*first))
    for pair in rest:
        ours.update(*pair)
        theirs.update(*pair)


@pytest.mark.parametrize(
    "shapes",
    [[(64, 10), (64, 10), (7, 10)], [(8, 5, 12), (3, 5, 12)]],
    ids=["(batch, classes)", "(batch, classes, rows)"],
)
def test_accuracy_is_torchmetrics_micro_accuracy_of_the_logits(shapes):
    classes = shapes[0][1]
    ours, theirs = Accuracy(num_classes=classes), MulticlassAccuracy(num_classes=classes, average="micro")
    fed(ours, theirs, batches(0, shapes, classes))
    value = ours.compute()
    assert value.dtype == torch.float32 and torch.equal(value, theirs.compute()) and 0 < value < 1
    ours.reset()
    assert ours.compute() == 0.0  # before any sample, as torchmetrics' 0/0


def test_perplexity_is_torchmetrics_perplexity_and_padding_counts_for_nothing():
    pairs = batches(1, [(4, 16, 11), (4, 16, 11), (1, 16, 11)], 11, padded=True)
    ours, theirs = Perplexity(ignore_index=-100), TorchmetricsPerplexity(ignore_index=-100)
    fed(ours, theirs, pairs)
    value = ours.compute()
    # Its steps are torchmetrics' (softmax, then log): equal to the last bit today, and close
    # whatever torchmetrics' own rounding becomes.
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, theirs.compute(), rtol=1e-6, atol=0)
    # exp of the mean cross-entropy over the tokens that count, as validation's loss is.
    logits, targets = (torch.cat(parts) for parts in zip(*pairs, strict=True))
    mean = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    assert value.item() == pytest.approx(mean.exp().item(), rel=1e-6)


def test_a_sum_is_torchmetrics_sum_and_keeps_a_nan():
    values = [0.1, 3, torch.tensor(17), torch.rand(5, dtype=torch.float64), torch.tensor([2.5, 1e-8])]
    ours, theirs = Sum(), SumMetric(nan_strategy="disable")
    for value in values:
        ours.update(value)
        theirs.update(value)
    assert ours.compute().dtype == torch.float32 and torch.equal(ours.compute(), theirs.compute())
    ours.update(torch.tensor(float("nan")))
    assert ours.compute().isnan()


def test_a_batch_that_does_not_fit_is_refused_naming_the_shapes_each_metric_takes():
    with pytest.raises(ValueError, match=r"^Accuracy takes logits shaped \(batch, 10, \.\.\.\) and class indices"):
        Accuracy(num_classes=10).update(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^Perplexity takes logits shaped \(batch, sequence, vocabulary\)"):
        Perplexity().update(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^average='macro': this Accuracy counts samples \(micro\)"):
        Accuracy(num_classes=10, average="macro")


CLASSIFIED = batches(2, [(16, 10)] * 5, 10)
TOKENS = batches(3, [(2, 8, 11)] * 5, 11, padded=True)


def metrics() -> dict[str, tuple]:
    return {
        "accuracy": (Accuracy(num_classes=10), MulticlassAccuracy(num_classes=10, average="micro")),
        "perplexity": (Perplexity(), TorchmetricsPerplexity(ignore_index=-100)),
    }


def share(rank: int, world: int, address: str, results) -> None:
    """One process of `world`: its share of the batches (every world-th), its values summed over all."""
    torch.set_num_threads(1)  # a forked child meets OpenMP's pool of the parent's threads, which it lacks
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    try:
        built = metrics()
        for name, pairs in (("accuracy", CLASSIFIED), ("perplexity", TOKENS)):
            for pair in pairs[rank::world]:
                for metric in built[name]:
                    metric.update(*pair)
        alone = Sum(sync_on_compute=False)  # no collective step: the other process never joins one
        alone.update(rank + 1)
        values = {name: tuple(metric.compute().item() for metric in both) for name, both in built.items()}
        results.put((values, alone.compute().item()))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="forks the processes")
def test_two_processes_give_the_values_of_all_their_shares_as_torchmetrics_does(tmp_path):
    context = multiprocessing.get_context("fork")  # forked: the batches and the imports are here already
    results = context.SimpleQueue()
    multiprocessing.start_processes(
        share, args=(2, f"file://{tmp_path / 'store'}", results), nprocs=2, start_method="fork"
    )
    found = [results.get() for _ in range(2)]
    whole = {name: ours for name, (ours, _) in metrics().items()}
    for name, pairs in (("accuracy", CLASSIFIED), ("perplexity", TOKENS)):
        for pair in pairs:
            whole[name].update(*pair)
    for values, _ in found:
        for name, (ours, theirs) in values.items():
            assert ours == theirs, name
            assert ours == pytest.approx(whole[name].compute().item(), rel=1e-6), name
    assert sorted(alone for _, alone in found) == [1.0, 2.0]


GUARD = """
import sys

import torch
from hydra import compose, initialize_config_dir

import {{cookiecutter.package}}.engine.train
from {{cookiecutter.package}}.engine import components
from {{cookiecutter.package}}.engine.validation import build_metrics

with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    for group in ("classification", "language_model"):
        cfg = compose("config", overrides=[f"metrics={group}"])
        assert components.problems(cfg) == [], components.problems(cfg)
        for metric in build_metrics(cfg.metrics, {"num_classes": 10, "vocab_size": 11}, torch.device("cpu")).values():
            assert type(metric).__module__ == "{{cookiecutter.package}}.engine.ready.metrics", type(metric)
print(sorted(name for name in ("torchmetrics", "scipy", "matplotlib") if name in sys.modules))
"""


def test_the_recipe_and_the_default_metrics_import_neither_torchmetrics_nor_scipy_nor_matplotlib():
    found = subprocess.run(
        [sys.executable, "-c", GUARD, str(PROJECT / "configs")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.splitlines()[-1] == "[]"
