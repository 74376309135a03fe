"""Components by `_target_`: each setting is checked against its target's signature before
anything is built, and a build passes a constructor only the run-time values it names."""

import pytest
import torch
from conftest import runs_named
from omegaconf import open_dict

from {{cookiecutter.package}}.engine import components, strategies
from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.config import check_values
from {{cookiecutter.package}}.engine.distributed import World
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.validation import check_wiring

PACKAGE = "{{cookiecutter.package}}"
# Components a user might write, in a module of their own.
MINE = """
from torch import nn


class Head(nn.Linear):
    def __init__(self, num_classes: int, width: int = 4):
        super().__init__(width, num_classes)


class Anything:
    def __init__(self, **settings):
        self.settings = settings
"""


def problems(make_cfg, *overrides: str) -> list[str]:
    return components.problems(make_cfg(*overrides))


@pytest.fixture
def mine(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(MINE)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (
            ["+model.hiden_sizes=[8]"],
            f"model.hiden_sizes is not a setting of {PACKAGE}.models.MLP (did you mean model.hidden_sizes?)",
        ),
        (
            ["model=cnn", "+model.chanels=[8]"],
            f"model.chanels is not a setting of {PACKAGE}.models.CNN (did you mean model.channels?)",
        ),
        (
            ["+optimizer.weight_decy=1"],
            "optimizer.weight_decy is not a setting of torch.optim.AdamW (did you mean optimizer.weight_decay?)",
        ),
        (["model.dropout=abc"], "model.dropout='abc' is not a number"),
        (["optimizer.lr=abc"], "optimizer.lr='abc' is not a number"),  # torch's `float | Tensor` is a float here
        (["model.hidden_sizes=[a]"], "model.hidden_sizes=['a'] is not a list[int]"),
        (["data.batch_size=x"], "data.batch_size='x' is not an integer"),
        (["optimizer.fused=maybe"], "optimizer.fused='maybe' is not true or false or null"),
        (
            ["+optimizer.params=[1]"],
            "optimizer.params is given by the run when optimizer is built; remove it from the config",
        ),
        (
            ["model._target_=nowhere.Model"],
            "model._target_=nowhere.Model cannot be imported (No module named 'nowhere')",
        ),
        (["+metrics.f-1._target_=torchmetrics.F1Score"], "metrics.f-1: a metric's name is logged as val/<name>"),
    ],
    ids=lambda value: value[-1] if isinstance(value, list) else "",
)
def test_a_setting_its_target_would_refuse_is_named_in_one_line(make_cfg, overrides, problem):
    assert problem in "; ".join(problems(make_cfg, *overrides))
    with pytest.raises(RunError) as raised:
        check_values(make_cfg(*overrides))
    assert problem in str(raised.value) and "\n" not in str(raised.value)


def test_a_required_setting_left_out_is_named(make_cfg):
    cfg = make_cfg()
    with open_dict(cfg):
        del cfg.scheduler.total_steps
        del cfg.data.batch_size
    found = components.problems(cfg)
    assert (
        f"scheduler.total_steps is required by {PACKAGE}.schedulers.cosine; set it in its YAML file or with "
        f"scheduler.total_steps=<value>" in found
    )
    assert "data.batch_size is required by the loader; set it in the data's YAML file" in found


def test_a_required_setting_that_neither_the_config_nor_the_data_gives_is_named_when_it_is_built(make_cfg):
    """A model's parameter may be one of the data's facts, known only once the data is built."""
    cfg = make_cfg()
    with open_dict(cfg):
        del cfg.model.hidden_sizes
    assert components.problems(cfg) == []
    with pytest.raises(RunError) as raised:
        components.build("model", cfg.model, **runtime("model"))
    assert str(raised.value) == (
        f"model.hidden_sizes is required by {PACKAGE}.models.MLP and neither its config nor the data gives it (the "
        f"data's facts: input_shape, num_classes); set model.hidden_sizes=<value>, or report it from the data"
    )


def test_a_setting_that_the_data_also_gives_is_refused_when_it_is_built(make_cfg):
    cfg = make_cfg("+model.num_classes=3")
    assert components.problems(cfg) == []
    with pytest.raises(RunError) as raised:
        components.build("model", cfg.model, **runtime("model"))
    assert (
        str(raised.value)
        == "model.num_classes is given by the data (10) when model is built; remove it from the config"
    )


@pytest.mark.parametrize(
    "options",
    [[], ["model=cnn"], ["optimizer=sgd", "scheduler=constant"], ["experiment=cnn_digits"], ["experiment=char_lm"]],
    ids=" ".join,
)
def test_every_shipped_option_passes(make_cfg, options):
    assert problems(make_cfg, *options) == []


def mine_as_the_model(make_cfg, target: str, **settings: object):
    cfg = make_cfg(f"model._target_={target}")
    with open_dict(cfg):
        del cfg.model.hidden_sizes, cfg.model.dropout
        cfg.model.update(settings)
    return cfg


def test_a_build_passes_only_the_run_time_values_its_constructor_names(make_cfg, mine):
    cfg = mine_as_the_model(make_cfg, "mine.Head", width=6)
    assert components.problems(cfg) == []
    head = components.build("model", cfg.model, input_shape=(1, 8, 8), num_classes=3)  # input_shape is not asked for
    assert (head.in_features, head.out_features) == (6, 3)


def test_a_target_that_takes_any_keyword_accepts_any_setting_as_a_plain_value(make_cfg, mine):
    cfg = mine_as_the_model(make_cfg, "mine.Anything", sizes=[1, 2], whatever="x")
    assert components.problems(cfg) == []
    built = components.build("model", cfg.model, input_shape=(1, 8, 8), num_classes=3)
    assert built.settings == {"sizes": [1, 2], "whatever": "x"} and type(built.settings["sizes"]) is list


def runtime(group: str) -> dict:
    """What the run would pass `group` at build time."""
    model = torch.nn.Linear(2, 2)
    return {
        "data": {},
        "model": {"input_shape": (1, 8, 8), "num_classes": 10},
        "optimizer": {"params": model.parameters()},
        "scheduler": {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)},
    }[group]


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimizer.lr=-1", "optimizer (torch.optim.AdamW): Invalid learning rate: -1"),
        ("model.hidden_sizes=[0]", f"model ({PACKAGE}.models.MLP): hidden_sizes=[0] must hold sizes of at least 1"),
        ("model.dropout=1.5", f"model ({PACKAGE}.models.MLP): dropout probability has to be between 0 and 1"),
        ("scheduler.min_lr_ratio=2", f"scheduler ({PACKAGE}.schedulers.cosine): min_lr_ratio=2 must be from 0 to 1"),
        (
            "scheduler.warmup_steps=-10",
            f"scheduler ({PACKAGE}.schedulers.cosine): warmup_steps=-10 must not be negative",
        ),
        ("data.val_fraction=1.0", f"data ({PACKAGE}.datasets.digits): val_fraction=1.0 must be above 0 and below 1"),
    ],
)
def test_a_value_its_constructor_refuses_stops_the_run_in_one_line(make_cfg, override, message):
    group = override.split(".")[0]
    with pytest.raises(RunError) as raised:
        components.build(group, make_cfg(override)[group], **runtime(group))
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_a_cnn_too_deep_for_its_images_is_refused_naming_why(make_cfg):
    cfg = make_cfg("model=cnn", "model.channels=[4,4,4,4]")
    with pytest.raises(RunError, match=r"channels=\[4, 4, 4, 4\] gives 4 blocks that each halve the \(8, 8\) images"):
        components.build("model", cfg.model, **runtime("model"))


def test_an_optimizer_written_with_partial_as_lightning_hydra_template_does_builds_the_same(make_cfg):
    cfg = make_cfg("+optimizer._partial_=true")
    model = torch.nn.Linear(2, 2)
    optimizer = components.build("optimizer", cfg.optimizer, params=model.parameters())
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == cfg.optimizer.lr


def test_a_metric_is_built_for_the_datas_classes(make_cfg):
    accuracy = components.build("metrics", make_cfg().metrics.accuracy, num_classes=10)
    accuracy.update(torch.eye(10), torch.arange(10))
    assert accuracy.num_classes == 10 and accuracy.compute().item() == 1.0


@pytest.mark.parametrize(
    ("override", "part"),
    [
        ("+metrics.r2._target_=torchmetrics.R2Score", r"metrics\.r2 \(torchmetrics\.R2Score\) does not fit"),
        ("loss._target_=torch.nn.MSELoss", r"loss \(torch\.nn\.MSELoss\) does not fit"),
    ],
)
def test_a_part_that_does_not_fit_the_others_stops_the_run_before_its_first_step(
    make_cfg, checkpoint_dir, client, override, part
):
    """Found on one batch before training, named with both shapes; no checkpoint, no MLflow run."""
    cfg = make_cfg(override, "name=miswired")
    with open_dict(cfg):
        cfg.loss.pop("label_smoothing")  # cross_entropy's, which MSELoss does not take
    shapes = r"the model's outputs \(\d+, 10\) float32 and the data's targets \(\d+,\) int64: \S"
    with pytest.raises(RunError, match=f"^{part} {shapes}"):
        recipe.train(cfg)
    assert not list(checkpoint_dir.glob("step_*"))
    assert runs_named(client, "miswired") == []  # the store is the session's


def test_a_metric_that_is_not_one_number_stops_the_run_before_its_first_step(make_cfg, checkpoint_dir, monkeypatch):
    """A confusion matrix would train, then fail at the first validation's `.item()`."""
    steps = []
    monkeypatch.setattr(recipe, "train_step", lambda *args: steps.append(args))
    target = "torchmetrics.classification.MulticlassConfusionMatrix"
    cfg = make_cfg("mlflow.enabled=false", f"+metrics.confmat._target_={target}")
    with pytest.raises(RunError) as raised:
        recipe.train(cfg)
    assert str(raised.value) == (
        f"metrics.confmat ({target}) computes (10, 10) int64, not the one number val/confmat must be; use a metric "
        f"that gives one (per-class scores: average=macro), or drop it: ~metrics.confmat"
    )
    assert steps == [] and not list(checkpoint_dir.glob("step_*"))


def test_the_wiring_check_leaves_the_metrics_as_built(make_cfg):
    """The check's batch is not counted in the first validation."""
    cfg, world = make_cfg(), World(torch.device("cpu"))
    built = recipe.build(cfg, world, strategies.choose(cfg, world))
    check_wiring(built)
    assert [metric.sums.tolist() for metric in built.metrics.values()] == [[0, 0]]  # samples right, and counted
