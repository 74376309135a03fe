"""Device resolution with availability faked, and the placement audit on the `meta` device.

Tensors moved to `meta` keep that device tag, which is all the audit and the restore order are
about; so these tests run the real restore code against a stand-in accelerator on any machine.
"""

import pytest
import torch
from omegaconf import OmegaConf, open_dict
from torch import nn

from {{cookiecutter.package}}.engine.config import DeviceConfig
from {{cookiecutter.package}}.engine.devices import DEFAULT_THREADS, audit_placement, describe, resolve_device, set_cpu_threads
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.train import train, train_step

META = torch.device("meta")
# A model that makes its head on first use, on the inputs' device: the placement audit passes it.
LAZY = """
import math

from torch import nn


class LazyHead(nn.Module):
    def __init__(self, input_shape: list[int], num_classes: int):
        super().__init__()
        self.stem, self.body = nn.Linear(math.prod(input_shape), 16), nn.Linear(16, 16)
        self.num_classes, self.head = num_classes, None

    def forward(self, inputs):
        if self.head is None:
            self.head = nn.Linear(16, self.num_classes).to(inputs.device)
        return self.head(self.body(self.stem(inputs.flatten(1))))
"""


@pytest.fixture(autouse=True)
def moves_keep_parameter_identity():
    """A move to cuda or xpu keeps each Parameter object and swaps its data; a move to meta would
    make new ones unless told to swap, and the audit is about the first kind of move."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


def device_cfg(kind: str, index: int = 0) -> DeviceConfig:
    return OmegaConf.structured(DeviceConfig(type=kind, index=index, backend="gloo"))


@pytest.fixture
def fake_accelerators(monkeypatch):
    """Pretends which accelerators are present, and how many of each."""

    def fake(cuda: int = 0, xpu: int = 0, mps: bool = False) -> None:
        for module, count in ((torch.cuda, cuda), (torch.xpu, xpu)):
            monkeypatch.setattr(module, "is_available", lambda count=count: count > 0)
            monkeypatch.setattr(module, "device_count", lambda count=count: count)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)

    return fake


@pytest.mark.parametrize(
    "present, expected",
    [
        ({"cuda": 1, "xpu": 1, "mps": True}, "cuda:0"),
        ({"xpu": 2, "mps": True}, "xpu:0"),
        ({"mps": True}, "mps"),
        ({}, "cpu"),
    ],
)
def test_auto_prefers_cuda_then_xpu_then_mps_then_cpu(fake_accelerators, present, expected):
    fake_accelerators(**present)
    assert str(resolve_device(device_cfg("auto"))) == expected


@pytest.mark.parametrize("kind", ["xpu", "auto"])
def test_a_present_accelerator_resolves_to_the_asked_index(fake_accelerators, kind):
    fake_accelerators(xpu=2)
    assert resolve_device(device_cfg(kind, 1)) == torch.device("xpu", 1)


@pytest.mark.parametrize("kind", ["cuda", "xpu"])
def test_a_missing_accelerator_is_one_line_naming_what_torch_reports_and_the_fix(fake_accelerators, kind):
    fake_accelerators()
    with pytest.raises(RunError) as raised:
        resolve_device(device_cfg(kind))
    message = str(raised.value)
    assert "\n" not in message
    assert f"torch.{kind}.is_available() is False" in message
    assert torch.__version__ in message
    assert "device=auto or device=cpu" in message


def test_too_few_devices_names_the_count(fake_accelerators):
    fake_accelerators(cuda=1)
    with pytest.raises(
        RunError, match=r"device.index=3 .* torch.cuda.device_count\(\) is 1; pick an index from 0 to 0"
    ):
        resolve_device(device_cfg("cuda", 3))


def test_a_device_flag_of_false_is_not_read_as_true(make_cfg, fake_accelerators):
    """The LPRNet failure: argparse's type=bool turned "False" into True. Typed config does not."""
    fake_accelerators(cuda=1)
    cfg = make_cfg("device=cuda", "device.pin_memory=False", "device.non_blocking=false")
    assert cfg.device.pin_memory is False and cfg.device.non_blocking is False


def test_the_missing_device_fails_before_anything_is_built(make_cfg, fake_accelerators, monkeypatch):
    fake_accelerators()
    built = []
    monkeypatch.setattr("{{cookiecutter.package}}.engine.components.build", lambda *args, **runtime: built.append(args))
    with pytest.raises(RunError, match="device=xpu was asked for"):
        train(make_cfg("device=xpu"))
    assert built == []


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.1)


def trained_optimizer_state() -> dict:
    """Optimizer state after two CPU steps, as a checkpoint would carry it."""
    model = small_model()
    optimizer = build_optimizer(model)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_restore_after_the_move_puts_optimizer_state_on_the_device():
    saved = trained_optimizer_state()
    model = small_model().to(META)
    optimizer = build_optimizer(model)
    optimizer.load_state_dict(saved["optimizer"])
    audit_placement(META, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    devices = {value.device.type for state in optimizer.state.values() for key, value in state.items() if key != "step"}
    assert devices == {"meta"}


def test_restore_before_the_move_is_caught_and_each_tensor_named():
    saved = trained_optimizer_state()
    model = small_model()
    optimizer = build_optimizer(model)
    optimizer.load_state_dict(saved["optimizer"])  # the bug: state is cast to the CPU here
    model.to(META)
    with pytest.raises(RunError) as raised:
        audit_placement(META, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    message = str(raised.value)
    assert "optimizer state 'exp_avg' of model.0.weight is on cpu" in message
    assert "optimizer state 'exp_avg_sq' of model.2.bias is on cpu" in message
    assert "move the model first, then build the optimizer and load its state" in message


def test_an_optimizer_built_on_parameters_the_model_replaced_is_caught():
    torch.__future__.set_swap_module_params_on_conversion(False)  # this move makes new Parameters
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.to(META)
    with pytest.raises(RunError, match=r"the optimizer holds a \(8, 4\) parameter on cpu that the model no longer has"):
        audit_placement(META, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))


def test_a_head_replaced_after_the_move_is_named():
    model = small_model().to(META)
    model[2] = nn.Linear(8, 5)  # a new classifier head, made on the CPU
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RunError) as raised:
        audit_placement(META, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    message = str(raised.value)
    assert "model.2.weight is on cpu" in message and "model.2.bias is on cpu" in message
    assert "model.0.weight" not in message
    assert "created or replaced after model.to(device)" in message


def test_buffers_are_audited_too():
    model = small_model().to(META)
    model[1].running_mean = torch.zeros(8)
    with pytest.raises(RunError, match="model.1.running_mean is on cpu"):
        audit_placement(
            META, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False)
        )


def test_cpu_step_counters_pass_only_where_the_optimizer_keeps_them_there():
    model = small_model().to(META)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.state[model[0].weight] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(8, 4, device=META)}
    audit_placement(META, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))
    optimizer.param_groups[0]["capturable"] = True  # capturable and fused keep `step` on the device
    with pytest.raises(RunError, match="optimizer state 'step' of model.0.weight is on cpu"):
        audit_placement(META, model, optimizer, torch.amp.GradScaler("cpu", enabled=False))


def test_a_scaler_for_another_device_type_is_caught():
    model = small_model()
    scaler = torch.amp.GradScaler("xpu")  # unlike cuda's, it stays enabled without the device
    with pytest.raises(RunError, match="GradScaler is for xpu"):
        audit_placement(torch.device("cpu"), model, torch.optim.SGD(model.parameters(), lr=0.1), scaler)


def test_a_layer_built_in_forward_stops_the_run_after_the_first_step_naming_it(
    make_cfg, checkpoint_dir, tmp_path, monkeypatch
):
    """It would get gradients at every step and never change; a frozen layer is not named."""
    (tmp_path / "lazy_head.py").write_text(LAZY)
    monkeypatch.syspath_prepend(str(tmp_path))
    steps = []
    monkeypatch.setattr("{{cookiecutter.package}}.engine.train.train_step", lambda *args: steps.append(1) or train_step(*args))
    cfg = make_cfg("mlflow.enabled=false", "init.freeze=[stem.*]")
    with open_dict(cfg):
        cfg.model = {"_target_": "lazy_head.LazyHead"}
    with pytest.raises(RunError) as raised:
        train(cfg)
    assert str(raised.value) == (
        "2 parameter(s) of the model train but are not in the optimizer, and would never change: model.head.weight, "
        "model.head.bias; they were built after it, e.g. in the model's forward: build every layer in the model's "
        "__init__"
    )
    assert len(steps) == 1 and not list(checkpoint_dir.glob("step_*"))


@pytest.mark.parametrize("asked, expected", [(0, max(1, DEFAULT_THREADS - 1)), (3, 3)])
def test_cpu_threads_leave_a_core_free_unless_set(monkeypatch, asked, expected):
    monkeypatch.setattr(
        torch, "set_num_threads", lambda count: monkeypatch.setattr(torch, "get_num_threads", lambda: count)
    )
    config = device_cfg("cpu")
    config.cpu_threads = asked
    set_cpu_threads(config)
    assert torch.get_num_threads() == expected


@pytest.mark.parametrize(("threads", "said"), [(1, "1 thread)"), (4, "4 threads)")])
def test_the_cpu_is_described_with_its_threads_counted_in_english(monkeypatch, threads, said):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert describe(torch.device("cpu")).endswith(said)
