"""Runs on a real GPU: a short training, a save, and a resume onto the GPU from a CPU
checkpoint; steps that never wait on the GPU; background saves through pinned memory; a logged
model that loads on the machine that logged it. Skipped where the device is absent; on a GPU
machine: `pytest -m cuda` or `-m xpu`."""

import pytest
import torch
from test_export import val_loss
from test_logged_models import loaded, models_of

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.background import Snapshot
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.train import train

GPUS = [
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda")]),
    pytest.param("xpu", marks=[pytest.mark.xpu, pytest.mark.skipif(not torch.xpu.is_available(), reason="no xpu")]),
]


@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
@pytest.mark.parametrize("gpu", GPUS)
def test_a_cpu_checkpoint_resumes_on_the_gpu_with_its_state_placed_there(make_cfg, client, checkpoint_dir, gpu, amp):
    train(make_cfg("device=cpu", f"amp={amp}", "trainer.max_steps=20"))
    resumed = train(make_cfg(f"device={gpu}", f"amp={amp}", "trainer.max_steps=40", "resume=last"))
    run = client.get_run(resumed["run_id"])
    assert run.data.tags["device.type"] == gpu and run.data.tags["continuity"] == "ok"
    saved = newest_valid(checkpoint_dir)[1]
    assert saved["device"]["type"] == gpu and saved["step"] == 40
    assert saved["rng"]["ranks"][0]["accelerator"]["type"] == gpu


@pytest.mark.parametrize("gpu", GPUS)
def test_fused_adamw_with_fp16_trains_saves_and_resumes_on_the_gpu(make_cfg, client, gpu):
    settings = [f"device={gpu}", "amp=fp16", "optimizer.fused=true"]
    first = train(make_cfg(*settings, "trainer.max_steps=20"))
    resumed = train(make_cfg(*settings, "trainer.max_steps=40", "resume=last"))
    assert resumed["run_id"] == first["run_id"]
    assert client.get_run(resumed["run_id"]).data.tags["continuity"] == "ok"  # exact on the same device
    assert resumed["val/loss"] < first["val/loss"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda")
@pytest.mark.parametrize("setup", [[], ["experiment=char_lm", "amp=bf16"]], ids=["mlp", "gpt-bf16"])
def test_fifty_steps_that_do_not_log_never_wait_on_the_gpu(make_cfg, monkeypatch, setup):
    """Any host-device sync is an error from the second step to the 51st: whole steps, the loop
    around them and the loading of the batches between them. Logging, validation and saves fall
    outside, and so does the first step, which audits the placement."""
    real_step, guarded = recipe.train_step, []

    def train_step(run, micro_batches):
        torch.cuda.set_sync_debug_mode("error" if 1 <= run.step <= 50 else "default")
        if 1 <= run.step <= 50:
            guarded.append(run.step)
        return real_step(run, micro_batches)

    monkeypatch.setattr(recipe, "train_step", train_step)
    quiet = ["trainer.log_every_n_steps=100", "trainer.val_every_n_steps=100", "checkpoint.every_n_steps=100"]
    try:
        train(make_cfg("device=cuda", *setup, *quiet, "trainer.max_steps=60"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guarded == list(range(1, 51))


@pytest.mark.parametrize("gpu", GPUS)
def test_a_background_save_copies_the_gpu_state_into_pinned_buffers_kept_from_save_to_save(gpu):
    weight = torch.ones(2048, 2048, device=gpu)
    live = {"model": {"w": weight}, "optimizer": {"state": {0: {"step": torch.tensor(1.0)}}}}
    snapshot = Snapshot()
    first = snapshot.take(live)
    copy = first["model"]["w"]
    assert copy.device.type == "cpu" and copy.is_pinned() and torch.equal(copy, torch.ones(2048, 2048))
    assert not first["optimizer"]["state"][0]["step"].is_pinned(), "a CPU tensor's copy needs no pinned memory"
    busy = torch.randn(4096, 4096, device=gpu)
    for _ in range(20):  # the GPU is still busy when the copy is asked for, which must wait for it
        busy = busy @ busy / 4096
    weight.fill_(3.0)
    second = snapshot.take(live)
    assert second["model"]["w"].data_ptr() == copy.data_ptr(), "no allocation after the first save"
    assert torch.equal(second["model"]["w"], torch.full((2048, 2048), 3.0)), "complete when take returns"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda")
def test_a_model_logged_on_a_gpu_machine_loads_there_to_its_logged_val_loss(make_cfg, client, tracking_uri, capfd):
    trained = train(make_cfg("device=cuda", "mlflow.log_models=best"))
    (model,) = models_of(client, trained["run_id"]).values()
    logged = {metric.key: metric.value for metric in model.metrics}["val/loss"]
    val_fraction = make_cfg().data.val_fraction
    assert val_loss(loaded(tracking_uri, model.model_id), val_fraction) == pytest.approx(logged, rel=1e-4)
    assert "Failed to validate serving input" not in capfd.readouterr().err
