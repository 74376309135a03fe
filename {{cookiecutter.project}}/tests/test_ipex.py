"""The opt-in IPEX path: a clear line where IPEX cannot run, a real run where it can."""

import importlib.util

import pytest
import torch

from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.train import train

IPEX_USABLE = (
    torch.__version__.startswith("2.8.") and importlib.util.find_spec("intel_extension_for_pytorch") is not None
)


@pytest.mark.skipif(IPEX_USABLE, reason="IPEX is installed and usable here")
def test_ipex_requested_where_it_cannot_run_is_one_clear_line(make_cfg):
    with pytest.raises(
        RunError, match=r"device.ipex=true needs torch 2.8|device.ipex=true but IPEX does not import"
    ) as raised:
        train(make_cfg("device.ipex=true", "mlflow.enabled=false"))
    assert "\n" not in str(raised.value) and "drop device.ipex" in str(raised.value)


@pytest.mark.skipif(
    not IPEX_USABLE, reason="needs intel-extension-for-pytorch with torch 2.8.* (pip install -e '.[ipex]')"
)
def test_ipex_optimize_runs_after_the_restore_and_training_continues(make_cfg):
    first = train(make_cfg("device.ipex=true", "trainer.max_steps=20", "mlflow.enabled=false"))
    resumed = train(make_cfg("device.ipex=true", "trainer.max_steps=40", "mlflow.enabled=false", "resume=last"))
    assert (first["step"], resumed["step"]) == (20, 40)
    assert resumed["val/loss"] < first["val/loss"]
