"""A checkpoint is data from anywhere, and so is the config it holds: a resume, eval.py and export.py
build from it only what this project could name itself, read it only once its checksum holds, never
resolve anything in it, and never take from it where the run is tracked. Each checkpoint here is
crafted as whoever sends one would: one this project wrote, its config changed, sealed again (the
seal is a checksum anyone can recompute, not a signature)."""

import logging
import math
import shutil
import sys
import types
from collections.abc import Callable
from functools import reduce
from pathlib import Path

import pytest
import torch
from conftest import PROJECT, losses, run_cli
from omegaconf import OmegaConf
from test_checkpoints import corrupt
from test_distributed import CPU, store
from test_remembered import composed

import {{cookiecutter.package}}
from {{cookiecutter.package}}.engine import targets
from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import onefile
from {{cookiecutter.package}}.engine.errors import CheckpointError, RunError
from {{cookiecutter.package}}.engine.evaluating import evaluate_checkpoint
from {{cookiecutter.package}}.engine.exporting import export
from {{cookiecutter.package}}.engine.remembered import trained

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

QUIET = "mlflow.enabled=false"
ENTRIES = ("eval.py", "export.py", "resume", "resume=last")
SECRET = "${oc.env:SECRET_TOKEN}"
PRECISION = "torchmetrics.classification.MulticlassPrecision"
MARGIN = "torch.nn.MultiMarginLoss"


@pytest.fixture(scope="module")
def written(tmp_path_factory, tracking_uri) -> Path:
    """A checkpoint this project wrote: the default run (`demo`) at step 2."""
    home = tmp_path_factory.mktemp("written")
    cfg, said = composed(home, tracking_uri, QUIET, "trainer.max_steps=2", "checkpoint.every_n_steps=2")
    recipe.train(cfg, said)
    return home / "demo" / "step_00000002.pt"


@pytest.fixture
def typed(tmp_path, tracking_uri) -> Callable:
    """Composes `python run.py <overrides>` (eval.py, export.py: the same config) with MLflow off, and
    says what was typed, as the scripts hand it on; each run's home under this test's folder."""
    return lambda *overrides: composed(tmp_path / "checkpoints", tracking_uri, QUIET, *overrides)


def crafted(written: Path, path: Path, change: Callable[[dict], object]) -> Path:
    """`written` with its config changed by `change`, sealed again with the project's own writer."""
    state = torch.load(written, weights_only=True)
    change(state["config"])
    onefile.write(state, path)
    return path


def placed(entry: str, path: Path, project: Path) -> Path:
    """Where `entry` finds the checkpoint sent: planted in the run's home under `project` for
    resume=last, else where it is."""
    if entry != "resume=last":
        return path
    home = project / "checkpoints" / "demo"
    home.mkdir(parents=True)
    return Path(shutil.copy(path, home / "step_00000002.pt"))


def started(entry: str, typed: Callable, path: Path, tmp_path: Path, *overrides: str) -> dict | Path:
    """`python eval.py checkpoint=<path>`, `export.py checkpoint=<path>`, `run.py resume=<path>` or
    `run.py resume=last`, in this process."""
    if entry == "eval.py":
        cfg, said = typed(*overrides)
        return evaluate_checkpoint(cfg, str(path), tmp_path, said)
    if entry == "export.py":
        cfg, said = typed(*overrides)
        return export(cfg, str(path), tmp_path / "model.safetensors", "fp32", said)
    return recipe.train(*typed("resume=last" if entry == "resume=last" else f"resume={path}", *overrides))


def refusal(source: Path, key: str, target: str) -> str:
    return (
        f"{source} holds a config that names {key}={target}, which neither configs/ nor this project's package "
        f"names: a checkpoint from elsewhere runs no code of its choosing; if you trust it, type ++{key}={target} "
        f"on the command line"
    )


def payload(kind: str, victim: Path, marker: Path) -> tuple[str, dict, str]:
    """A component of the checkpoint's config, and the key and `_target_` in it that would run:
    `victim` (a file of the user's) copied to `marker`, or truncated."""
    copies = {"_target_": "shutil.copyfile", "src": str(victim), "dst": str(marker)}
    truncates = {"_target_": "builtins.open", "file": str(victim), "mode": "w"}
    return {
        "copyfile": ("data", {**copies, "batch_size": 8}, "data._target_=shutil.copyfile"),
        "open": ("model", truncates, "model._target_=builtins.open"),
        "metric": ("metrics", {"x": truncates}, "metrics.x._target_=builtins.open"),
        # Reached through a module of the package, which imports gzip: not the package's own function.
        "gzip": ("loss", {"_target_": "{{cookiecutter.package}}.datasets.gzip.open", "filename": str(victim), "mode": "wb"}, "loss._target_={{cookiecutter.package}}.datasets.gzip.open"),
        # Hydra builds `_args_` first, whatever the component around them.
        "args": ("loss", {"_target_": "torch.nn.CrossEntropyLoss", "_args_": [copies]}, "loss._args_.0._target_=shutil.copyfile"),
    }[kind]  # fmt: skip


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        *((entry, kind) for entry in ENTRIES for kind in ("copyfile", "open")),
        *(("eval.py", kind) for kind in ("metric", "gzip", "args")),
    ],
)
def test_a_checkpoint_that_names_code_from_elsewhere_is_refused_before_any_of_it_runs(
    typed, written, tmp_path, entry, kind
):
    victim, marker = tmp_path / "notes.txt", tmp_path / "PWNED"
    victim.write_text("mine")
    component, node, named = payload(kind, victim, marker)
    sent = crafted(written, tmp_path / "sent.pt", lambda config: config.update({component: node}))
    sent = placed(entry, sent, tmp_path)
    with pytest.raises(RunError) as refused:
        started(entry, typed, sent, tmp_path)
    assert str(refused.value) == refusal(sent, *named.split("="))
    assert not marker.exists() and victim.read_text() == "mine"
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.parametrize(("script", "asked"), [("eval.py", "checkpoint"), ("export.py", "checkpoint"), ("run.py", "resume"), ("run.py", "resume=last")])  # fmt: skip
def test_each_script_refuses_a_crafted_checkpoint_in_one_line_and_exits_2(project, written, tmp_path, script, asked):
    victim, marker = tmp_path / "notes.txt", tmp_path / "PWNED"
    victim.write_text("mine")
    component, node, named = payload("copyfile", victim, marker)
    sent = crafted(written, tmp_path / "sent.pt", lambda config: config.update({component: node}))
    sent = placed(asked, sent, project)
    result = run_cli(project, *CPU, asked if asked == "resume=last" else f"{asked}={sent}", script=script)
    assert (result.returncode, result.stderr) == (2, f"error: {refusal(sent, *named.split('='))}\n")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "key", "target"),
    [
        (lambda config: config["metrics"].update(precision={"_target_": PRECISION}), "metrics.precision._target_", PRECISION),
        (lambda config: config.update(loss={"_target_": MARGIN, "margin": 2.0}), "loss._target_", MARGIN),
    ],
    ids=["metric", "loss"],
)  # fmt: skip
def test_a_target_typed_on_the_command_line_is_accepted_with_the_checkpoints_settings(
    typed, written, tmp_path, change, key, target
):
    """A colleague's run with a metric, or a loss, that this project's configs do not name: refused,
    then built as the checkpoint has it once its target is typed."""
    sent = crafted(written, tmp_path / "sent.pt", change)
    with pytest.raises(RunError) as refused:
        started("eval.py", typed, sent, tmp_path)
    assert str(refused.value) == refusal(sent, key, target)
    cfg, said = typed(f"++{key}={target}")
    component = key.split(".")[0]
    stored = torch.load(sent, weights_only=True)["config"][component]
    assert OmegaConf.to_container(trained(cfg, sent, said)[component]) == stored
    judged = started("eval.py", typed, sent, tmp_path, f"++{key}={target}")
    assert math.isfinite(judged["val/loss"]) and ("val/precision" in judged) == (component == "metrics")


# A module of yours beside engine/, as a user writes one.
MINE = """
import gzip

from torch import nn


class Model(nn.Module):
    def loss(self, outputs, targets):
        return outputs.sum()


def build() -> Model:
    return Model()
"""


@pytest.mark.daily
def test_a_class_the_package_defines_passes_and_one_a_module_of_it_imports_does_not(tmp_path, monkeypatch):
    """The ready components are the engine's: they pass where configs/ names them (`models.MLP`), and by
    the engine's path never."""
    mine = types.ModuleType("{{cookiecutter.package}}.mine")
    exec(MINE, mine.__dict__)
    monkeypatch.setitem(sys.modules, mine.__name__, mine)
    monkeypatch.setattr({{cookiecutter.package}}, "mine", mine, raising=False)
    nothing = tmp_path / "configs"  # names no target: only the package can
    nothing.mkdir()
    for target in ("mine.Model", "mine.build", "mine.Model.loss"):
        targets.check({"model": {"_target_": f"{{cookiecutter.package}}.{target}"}}, {}, (nothing,), tmp_path / "sent.pt")
    targets.check({"model": {"_target_": "{{cookiecutter.package}}.models.MLP"}}, {}, (PROJECT / "configs",), tmp_path / "sent.pt")  # fmt: skip
    for target in ("mine.nn.Linear", "mine.gzip.open", "engine.ready.models.MLP", "engine.checkpoint.files.remove", "models", "models.Nothing"):  # fmt: skip
        named = f"{{cookiecutter.package}}.{target}"
        with pytest.raises(RunError) as refused:
            targets.check({"model": {"_target_": named}}, {}, (nothing,), tmp_path / "sent.pt")
        assert str(refused.value) == refusal(tmp_path / "sent.pt", "model._target_", named)


def importing(tmp_path: Path, monkeypatch) -> tuple[Callable[[dict], object], Path]:
    """A change that makes the checkpoint's model a class of a module sent along with it, and the file
    that module creates when it is imported."""
    marker = tmp_path / "imported"
    (tmp_path / "sent_along.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Model:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return lambda config: config["model"].update(_target_="sent_along.Model"), marker


@pytest.mark.parametrize("seal", ["holds", "broken"])
def test_a_module_a_checkpoint_names_is_never_imported_and_a_broken_seal_keeps_its_config_unread(
    typed, written, tmp_path, monkeypatch, seal
):
    change, marker = importing(tmp_path, monkeypatch)
    sent = crafted(written, tmp_path / "sent.pt", change)
    if seal == "broken":
        corrupt(sent)
    with pytest.raises(RunError) as refused:
        started("eval.py", typed, sent, tmp_path)
    if seal == "holds":
        assert str(refused.value) == refusal(sent, "model._target_", "sent_along.Model")
    else:  # named by the whole read that follows, as damaged: not by what its config says
        assert isinstance(refused.value, CheckpointError)
        assert str(refused.value) == f"{sent} is damaged: its content no longer matches the checksum written at save"
    assert not marker.exists() and "sent_along" not in sys.modules


def test_resume_last_passes_over_a_newest_checkpoint_whose_seal_does_not_hold_without_reading_its_config(
    typed, written, tmp_path, monkeypatch
):
    change, marker = importing(tmp_path, monkeypatch)
    home = placed("resume=last", written, tmp_path).parent
    corrupt(crafted(written, home / "step_00000003.pt", change))
    assert recipe.train(*typed("resume=last", "trainer.max_steps=4"))["step"] == 4  # from step 2, with its config
    assert not marker.exists() and "sent_along" not in sys.modules


def test_a_resume_is_tracked_where_its_command_line_says_whatever_its_checkpoint_says(project, written, tmp_path):
    """A checkpoint of a project copied from elsewhere names the other folder's store: as would one
    whose config was changed to send the run, its metrics, params and provenance to another store."""
    elsewhere = tmp_path / "elsewhere.db"
    stored = {"tracking_uri": f"sqlite:///{elsewhere}", "experiment_name": "theirs", "run_name": "theirs"}
    sent = crafted(written, tmp_path / "sent.pt", lambda config: config["mlflow"].update(stored, enabled=True))
    placed("resume=last", sent, project)
    resumed = run_cli(project, *CPU, "resume=last", "trainer.max_steps=4")
    assert resumed.returncode == 0, resumed.stderr
    assert not elsewhere.exists()
    client = store(project)
    (experiment,) = [found for found in client.search_experiments() if found.name != "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert (experiment.name, run.info.run_name) == ("{{ cookiecutter.project }}", "demo")
    assert sorted(losses(client, run.info.run_id)) == [3, 4]


@pytest.mark.parametrize(("entry", "key"), [("resume", "mlflow.run_name"), ("eval.py", "model.hidden_sizes")])
def test_an_interpolation_in_a_checkpoints_config_is_refused_and_never_resolved(
    typed, written, tmp_path, monkeypatch, capsys, caplog, entry, key
):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2-never-shown")
    group, setting = key.split(".")
    sent = crafted(written, tmp_path / "sent.pt", lambda config: config[group].update({setting: SECRET}))
    with caplog.at_level(logging.INFO), pytest.raises(RunError) as refused:
        started(entry, typed, sent, tmp_path)
    assert str(refused.value) == (
        f"{sent} holds a config whose {key} is an interpolation ({SECRET}), which this project "
        f"never stores and never resolves from a checkpoint; pass a checkpoint this project wrote"
    )
    shown = capsys.readouterr()
    assert "hunter2" not in shown.out + shown.err + caplog.text


def nested(depth: int) -> dict:
    return reduce(lambda inner, _: {"x": inner}, range(depth), {})


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda config: config["model"].update(x=nested(100)), f"model.x{'.x' * 31} lies deeper than 32 levels"),
        (
            lambda config: config.update(trainer=[1, 2]),
            "trainer does not fit this project's setting (Merge error: list is not a subclass of TrainerConfig. value: [1, 2])",
        ),  # fmt: skip
        (
            lambda config: config["trainer"].update(max_steps="many"),
            "trainer.max_steps does not fit this project's setting (Value 'many' of type 'str' could not be converted to Integer)",
        ),  # fmt: skip
        (lambda config: config.update(model=[1, 2]), "model is not a mapping, as a component is"),
    ],
    ids=["deep", "list-for-mapping", "string-for-number", "list-for-component"],
)
def test_a_config_that_is_not_this_projects_plain_data_is_refused_in_one_line(typed, written, tmp_path, change, said):
    sent = crafted(written, tmp_path / "sent.pt", change)
    with pytest.raises(RunError) as refused:
        started("resume", typed, sent, tmp_path)
    assert str(refused.value) == f"{sent} holds a config whose {said}; pass a checkpoint this project wrote"
