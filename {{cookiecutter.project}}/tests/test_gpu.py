"""Runs on a real GPU: a short training, a save, and a resume onto the GPU from a CPU
checkpoint. Skipped where the device is absent; on a GPU machine: `pytest -m cuda` or `-m xpu`."""

import pytest
import torch

from {{cookiecutter.package}}.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.train import train

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
