"""Gradient accumulation and clipping, seeded data workers, AMP support checks, channels-last and
torch.compile: each does what it says, and none breaks an exact resume."""

import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import losses
from torch.utils.data import Dataset, TensorDataset

from {{cookiecutter.package}}.engine import components, progress
from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.data.loaders import EpochSampler, batches, build_loader, evaluation_loader
from {{cookiecutter.package}}.engine.data.position import Position
from {{cookiecutter.package}}.engine.devices import to_device
from {{cookiecutter.package}}.engine.distributed import World
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.precision import build_scaler
from {{cookiecutter.package}}.engine.seeding import seed_everything
from {{cookiecutter.package}}.engine.validation import evaluate

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

QUIET = "mlflow.enabled=false"


def digits_model(cfg) -> torch.nn.Module:
    return components.build("model", cfg.model, input_shape=(1, 8, 8), num_classes=10)


def weights_after(make_cfg, checkpoint_dir, *overrides: str) -> dict[str, torch.Tensor]:
    recipe.train(make_cfg(QUIET, *overrides))
    return newest_valid(checkpoint_dir)[1]["model"]


def test_two_accumulated_half_batches_make_the_same_step_as_one_full_batch(make_cfg, checkpoint_dir, tmp_path):
    same = ["model.dropout=0", "scheduler=constant", "trainer.max_steps=5"]
    full = weights_after(
        make_cfg, tmp_path / "full", *same, "data.batch_size=64", f"checkpoint.dir={tmp_path / 'full'}"
    )
    halves = weights_after(make_cfg, checkpoint_dir, *same, "data.batch_size=32", "trainer.grad_accum_steps=2")
    for key in full:
        torch.testing.assert_close(halves[key], full[key], rtol=1e-5, atol=1e-6)
    position = newest_valid(checkpoint_dir)[1]["position"]
    assert position == {"epoch": 0, "sample": 320, "order": "feistel"}, "five steps of two batches of 32 each"


def test_accumulated_batches_make_the_large_batchs_steps_across_an_epoch_boundary(make_cfg, client, tmp_path):
    """An epoch of the digits is 22 steps of 64 and 30 samples over: dropped per batch of 16, one
    batch of them would be kept, and from step 23 on the steps would be cut 16 samples apart."""
    same = ["model.dropout=0", "trainer.max_steps=40"]
    large = recipe.train(make_cfg(*same, "data.batch_size=64", f"checkpoint.dir={tmp_path / 'large'}"))
    accumulated = recipe.train(make_cfg(*same, "data.batch_size=16", "trainer.grad_accum_steps=4", "name=accumulated"))
    expected, found = losses(client, large["run_id"]), losses(client, accumulated["run_id"])
    assert sorted(found) == sorted(expected) == list(range(1, 41))
    for step in expected:
        assert found[step] == pytest.approx(expected[step], rel=1e-5), f"step {step}"


def test_each_process_accumulates_its_share_of_the_large_batch_and_an_epoch_ends_with_a_whole_step():
    for rank in (0, 1):
        large = list(EpochSampler(100, seed=0, batch_size=12, rank=rank, world_size=2, whole_batches=True))
        small = EpochSampler(100, seed=0, batch_size=4, rank=rank, world_size=2, whole_batches=True, accumulated=3)
        drawn = list(small)
        assert len(drawn) == len(small) == 3 * len(large) == 12  # 100 // 24 steps of 3 batches
        assert [torch.cat(drawn[i : i + 3]).tolist() for i in range(0, 12, 3)] == [step.tolist() for step in large]


def test_too_few_samples_for_one_accumulated_step_is_one_line_not_an_endless_wait_for_a_step(make_cfg):
    cfg = make_cfg("data.batch_size=8")
    dataset, cpu = TensorDataset(torch.zeros(20, 2), torch.zeros(20)), World(torch.device("cpu"))
    said = "data.batch_size=8 x 3 accumulated is larger than the 20 training samples, so no full step exists"
    with pytest.raises(RunError, match=rf"^{re.escape(said)}; use data\.batch_size=6 or less$"):
        build_loader(dataset, cfg.data, cfg.device, seed=0, world=cpu, accumulated=3)


@pytest.mark.parametrize("amp", ["off", "fp16"])
def test_gradient_clipping_bounds_the_update_to_the_true_gradient_norm(make_cfg, checkpoint_dir, amp):
    """With plain SGD one step moves the weights by lr * clipped gradient. Under fp16 the
    gradients must be unscaled before clipping, or the step would be ~65,536 times too small."""
    cfg = make_cfg(
        QUIET, f"amp={amp}", "optimizer=sgd", "optimizer.momentum=0", "optimizer.nesterov=false", "optimizer.lr=0.5",
        "optimizer.weight_decay=0", "scheduler=constant", "scheduler.warmup_steps=0",
        "trainer.max_steps=1", "trainer.grad_clip=0.01",
    )  # fmt: skip
    recipe.train(cfg)
    after = newest_valid(checkpoint_dir)[1]["model"]
    seed_everything(cfg.seed)  # the recipe's first draws build the model: rebuild its start
    before = digits_model(cfg).state_dict()
    step = torch.cat([(after[key] - before[key]).flatten() for key in before])
    assert 0.9 * 0.01 <= step.norm().item() / 0.5 <= 1.001 * 0.01


@pytest.mark.parametrize("amp", ["off", "fp16"])
def test_the_logged_gradient_norm_is_the_true_one_before_clipping_with_or_without_it(
    make_cfg, checkpoint_dir, client, amp
):
    """With plain SGD and no clipping one step moves the weights by lr * gradient, whose norm
    `train/grad_norm` must be (unscaled under fp16); a clipped step logs the same norm, as it was
    before the clipping."""
    one_step = [
        f"amp={amp}", "optimizer=sgd", "optimizer.momentum=0", "optimizer.nesterov=false", "optimizer.lr=0.5",
        "optimizer.weight_decay=0", "scheduler=constant", "scheduler.warmup_steps=0", "trainer.max_steps=1", "trainer.log_every_n_steps=1",
    ]  # fmt: skip
    cfg = make_cfg(*one_step)
    free = recipe.train(cfg)
    after = newest_valid(checkpoint_dir)[1]["model"]
    seed_everything(cfg.seed)  # the recipe's first draws build the model: rebuild its start
    before = digits_model(cfg).state_dict()
    step = torch.cat([(after[key] - before[key]).flatten() for key in before])
    (logged,) = client.get_metric_history(free["run_id"], "train/grad_norm")
    assert logged.step == 1 and logged.value == pytest.approx(step.norm().item() / 0.5, rel=1e-4)

    elsewhere = f"checkpoint.dir={checkpoint_dir.parent / 'clipped'}"
    clipped = recipe.train(make_cfg(*one_step, "trainer.grad_clip=0.01", "name=clipped", elsewhere))
    (logged_clipped,) = client.get_metric_history(clipped["run_id"], "train/grad_norm")
    assert logged_clipped.value == pytest.approx(logged.value, rel=1e-6) and logged.value > 0.1


class Noise(Dataset):
    """A dataset whose samples come from NumPy's global generator, like a random augmentation."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        return torch.tensor(np.random.rand()), torch.tensor(0)


def test_data_workers_draw_apart_and_an_epoch_draws_the_same_after_a_resume(make_cfg):
    cfg = make_cfg("data.num_workers=2", "data.batch_size=8")

    def stream(epoch: int):
        return batches(
            build_loader(Noise(), cfg.data, cfg.device, seed=0, world=World(torch.device("cpu"))), Position(epoch=epoch)
        )

    def one_epoch(source) -> list[float]:
        return [value for _ in range(8) for value in next(source)[0].tolist()]

    unbroken = stream(epoch=0)
    first, second = one_epoch(unbroken), one_epoch(unbroken)
    assert len(set(first)) == len(first), "each worker draws its own numbers"
    assert one_epoch(stream(epoch=1)) == second, "a run resumed at epoch 1 draws what the unbroken run drew"


class CountedTensors(TensorDataset):
    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.lookups = 0

    def __getitem__(self, index):
        self.lookups += 1
        return super().__getitem__(index)


def test_a_tensor_dataset_gives_each_batch_in_one_lookup_in_the_samplers_order(make_cfg):
    cfg = make_cfg("data.batch_size=8")
    dataset = CountedTensors(torch.arange(40.0).view(20, 2), torch.arange(20))
    stream = batches(build_loader(dataset, cfg.data, cfg.device, seed=0, world=World(torch.device("cpu"))), Position())
    drawn = [next(stream) for _ in range(4)]  # two epochs of two whole batches
    assert dataset.lookups == 4, "one lookup a batch, not one a sample"
    sampler = EpochSampler(20, seed=0, batch_size=8)
    expected = []
    for epoch in (0, 1):
        sampler.set_position(Position(epoch, 0))
        order = list(sampler)
        expected += [order[:8], order[8:]]
    for (inputs, targets), indices in zip(drawn, expected, strict=True):
        assert torch.equal(inputs, dataset.tensors[0][indices]) and torch.equal(targets, dataset.tensors[1][indices])


def test_a_tensor_datasets_evaluation_share_comes_in_order_one_lookup_a_batch(make_cfg):
    cfg = make_cfg()
    dataset = CountedTensors(torch.arange(40.0).view(20, 2), torch.arange(20))
    world = SimpleNamespace(rank=1, size=2)  # the second of two processes: samples 1, 3, 5, ...
    found = list(evaluation_loader(dataset, 4, 0, cfg.device, world))
    assert dataset.lookups == len(found) == 3
    assert [targets.tolist() for _, targets in found] == [[1, 3, 5, 7], [9, 11, 13, 15], [17, 19]]
    assert all(torch.equal(inputs, dataset.tensors[0][targets]) for inputs, targets in found)


class Listed(torch.utils.data.Dataset):
    """A dataset of its indices, fetched one sample at a time (not a TensorDataset)."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.daily
@pytest.mark.parametrize(
    "limit, validated", [(3, 48), (10, 100), (0.25, 25), (0.57, 57), (0.001, 1), (1.0, 100)], ids=str
)
@pytest.mark.parametrize("dataset", [Listed(), TensorDataset(torch.arange(100))], ids=["listed", "tensors"])
def test_limit_val_batches_validates_the_first_batches_or_fraction_of_the_split_whatever_the_processes(
    make_cfg, dataset, limit, validated
):
    """An integer: that many batches of data.batch_size (16 here); a fraction: that share of the
    samples, as written (0.57 of 100 is 57, not the float product's 56). The same samples each time,
    and whatever the number of processes that share them."""
    device = make_cfg().device

    def samples(world: SimpleNamespace) -> list[int]:
        found = evaluation_loader(dataset, 16, 0, device, world, limit)
        return [int(index) for batch in found for index in (batch[0] if isinstance(batch, list) else batch)]

    alone = samples(SimpleNamespace(rank=0, size=1))
    assert alone == list(range(validated)) == samples(SimpleNamespace(rank=0, size=1))
    assert sorted(samples(SimpleNamespace(rank=0, size=3)) + samples(SimpleNamespace(rank=1, size=3))
                  + samples(SimpleNamespace(rank=2, size=3))) == alone  # fmt: skip


@pytest.mark.parametrize("limit", ["2", "0.5"])
def test_a_limited_validation_logs_the_same_val_loss_across_a_resume(make_cfg, client, tmp_path, sigterm_at, limit):
    common = ["trainer.max_steps=40", "trainer.val_every_n_steps=10", f"trainer.limit_val_batches={limit}"]
    reference = recipe.train(make_cfg(*common, f"checkpoint.dir={tmp_path / 'reference'}"))
    whole = recipe.train(make_cfg("trainer.max_steps=10", f"checkpoint.dir={tmp_path / 'whole'}"))
    expected = losses(client, reference["run_id"], "val/loss")
    assert sorted(expected) == [10, 20, 30, 40] and expected[10] != losses(client, whole["run_id"], "val/loss")[10]
    sigterm_at(25)
    with pytest.raises(SystemExit):
        recipe.train(make_cfg(*common))
    sigterm_at(10**9)  # the signal disarmed
    resumed = recipe.train(make_cfg(*common, "resume=last"))
    assert losses(client, resumed["run_id"], "val/loss") == expected


def test_a_run_with_data_workers_trains_and_resumes(make_cfg):
    recipe.train(make_cfg(QUIET, "data.num_workers=2", "trainer.max_steps=15"))
    assert recipe.train(make_cfg(QUIET, "data.num_workers=2", "trainer.max_steps=30", "resume=last"))["step"] == 30


def test_an_amp_dtype_this_torch_cannot_autocast_is_one_clear_line(make_cfg, monkeypatch):
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: False)
    with pytest.raises(
        RunError, match=r"amp.dtype=float16 autocast is not supported on cpu by this torch .*; use amp=bf16 or amp=off"
    ):
        build_scaler(make_cfg("amp=fp16").amp, torch.device("cpu"))


def test_fp16_on_an_xpu_without_float64_warns_and_suggests_bf16(make_cfg, monkeypatch, caplog):
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type=None: True)
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda device: SimpleNamespace(has_fp64=False))
    with caplog.at_level(logging.WARNING):
        scaler = build_scaler(make_cfg("amp=fp16").amp, torch.device("xpu", 0))
    assert scaler.is_enabled()
    assert "xpu:0 has no float64, which the fp16 GradScaler needs; amp=bf16 needs no scaler" in caplog.text


@pytest.mark.parametrize("amp, scaled", [("off", False), ("bf16", False), ("fp16", True)])
def test_only_fp16_turns_the_grad_scaler_on(make_cfg, amp, scaled):
    assert build_scaler(make_cfg(f"amp={amp}").amp, torch.device("cpu")).is_enabled() is scaled


def test_channels_last_puts_image_batches_in_nhwc_and_leaves_other_tensors_alone():
    images = to_device(torch.randn(2, 3, 8, 8), torch.device("cpu"), non_blocking=False, channels_last=True)
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    assert to_device(torch.randn(2, 64), torch.device("cpu"), non_blocking=False, channels_last=True).is_contiguous()


def test_evaluation_places_its_batches_as_training_does(make_cfg, checkpoint_dir):
    """The CNN sees NHWC batches in validation too, under trainer.channels_last=true."""
    cfg = make_cfg(QUIET, "model=cnn", "trainer.channels_last=true")
    run, _, _ = recipe.setup(cfg, World(torch.device("cpu")), checkpoint_dir)
    layouts = []
    run.model.register_forward_pre_hook(
        lambda module, inputs: layouts.append(inputs[0].is_contiguous(memory_format=torch.channels_last))
    )
    results = evaluate(run, run.val_loader)
    assert layouts and all(layouts) and set(results) == {"val/loss", "val/accuracy"}


@pytest.mark.parametrize("accumulated", [1, 2])
def test_the_loss_a_step_reports_is_float32_whatever_dtype_the_loss_comes_in(make_cfg, checkpoint_dir, accumulated):
    run, _, _ = recipe.setup(make_cfg(QUIET, "amp=bf16"), World(torch.device("cpu")), checkpoint_dir)
    criterion = run.criterion
    run.criterion = lambda outputs, targets: criterion(outputs, targets).bfloat16()  # a loss computed in bf16
    batch = next(iter(run.val_loader))
    assert recipe.train_step(run, [batch] * accumulated)[0].dtype == torch.float32


def test_a_compiled_model_saves_plain_keys_and_resumes_without_compiling(make_cfg, checkpoint_dir):
    recipe.train(make_cfg(QUIET, "trainer.compile=true", "trainer.max_steps=10"))
    keys = set(newest_valid(checkpoint_dir)[1]["model"])
    assert keys == set(digits_model(make_cfg()).state_dict())
    assert recipe.train(make_cfg(QUIET, "trainer.max_steps=20", "resume=last"))["step"] == 20


def test_off_a_terminal_a_progress_line_comes_at_a_logging_step_once_progress_every_s_has_passed(
    make_cfg, monkeypatch, caplog
):
    """Under SLURM, nohup or CI the bar shows nothing; these lines are what the log file shows."""
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    trainer = make_cfg("trainer.max_steps=100").trainer  # progress_every_s: 30
    with caplog.at_level(logging.INFO), progress.Progress(trainer, step=0, main=True) as shown:
        assert shown.lines  # pytest's stdout is no terminal
        for step, seconds in ((10, 5), (20, 30), (30, 10), (40, 25)):
            clock[0] += seconds
            shown.report(step, 0.5, 1234.0, "samples")
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("step ")]
    assert lines == [
        "step 20/100: loss 0.5000, 1234 samples/s, ETA 0:02:20",  # 35 s for 20 steps, 80 to go
        "step 40/100: loss 0.5000, 1234 samples/s, ETA 0:01:45",  # 35 s after the last line
    ]
    with progress.Progress(trainer, step=0, main=False) as other_rank:
        assert not other_rank.lines
