"""A checkpoint is data from anywhere, and so is the config it holds: a resume, eval.py and export.py
build from it only what this project could name itself, read it only once its checksum holds, never
resolve anything in it, and never take from it where the run is tracked. Each checkpoint here is
crafted as whoever sends one would: one this project wrote, its config changed, sealed again (the
seal is a checksum anyone can recompute, not a signature)."""

import logging
import math
import os
import shutil
import sys
from collections.abc import Callable
from functools import reduce
from pathlib import Path

import pytest
import torch
from conftest import CONFIG_ROOTS, configured, losses, run_cli, start
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
    """A checkpoint this project wrote: the configs' default run at step 2."""
    home = tmp_path_factory.mktemp("written")
    cfg, said = composed(home, tracking_uri, QUIET, "trainer.max_steps=2", "checkpoint.every_n_steps=2")
    recipe.train(cfg, said)
    return home / cfg.name / "step_00000002.pt"


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
    home = project / "checkpoints" / configured().name
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

SIZE = 3


class Model(nn.Module):
    def loss(self, outputs, targets):
        return outputs.sum()


def build() -> Model:
    return Model()


def rebound() -> None:
    pass


rebound = gzip.open
"""
SWEEP = "{{cookiecutter.package}}.engine.sweeps.SweepCallback"


def copied(src: Path) -> tuple[Path, Path]:
    """The package's folder copied into `src`, with modules of yours beside engine/: MINE, a subpackage,
    a module linked in from outside the folder, and two whose bodies write a file when imported (a
    program's `__main__.py`, and a module that defines nothing); the folder, and that file."""
    package = shutil.copytree(
        Path({{cookiecutter.package}}.__file__).parent, src / "{{cookiecutter.package}}", ignore=shutil.ignore_patterns("__pycache__")
    )
    marker = src / "ran"
    body = f"open({str(marker)!r}, 'w').close()\n"
    (package / "__main__.py").write_text(f"{body}\n\ndef main() -> None:\n    pass\n")
    (package / "ran_when_imported.py").write_text(body)
    (package / "mine.py").write_text(MINE)
    (package / "sub").mkdir()
    (package / "sub" / "deep.py").write_text("class Deep:\n    pass\n")
    (src / "elsewhere.py").write_text("class Evil:\n    pass\n")
    (package / "linked.py").symlink_to(src / "elsewhere.py")
    return package, marker


def test_a_class_the_package_defines_passes_and_one_a_module_of_it_imports_does_not(tmp_path, monkeypatch):
    """Decided from the package's source, nothing imported: the ready components are the engine's,
    and pass only where configs/ names them (`models.MLP` at `model._target_`), by the engine's path
    never; nor does a name an import or an assignment binds, a program's, or a module's through a link."""
    package, marker = copied(tmp_path)
    monkeypatch.setattr(targets, "FOLDER", package)
    modules = set(sys.modules)
    for target in ("mine.Model", "mine.build", "mine.Model.loss", "sub.deep.Deep"):
        targets.check({"model": {"_target_": f"{{cookiecutter.package}}.{target}"}}, {}, (), tmp_path / "sent.pt")
    targets.check({"model": {"_target_": "{{cookiecutter.package}}.models.MLP"}}, {}, CONFIG_ROOTS, tmp_path / "sent.pt")
    refused_here = (
        "mine.nn.Linear", "mine.gzip.open", "mine.SIZE", "mine.rebound", "mine.Model.loss.x", "mine.build.x",
        "engine.ready.models.MLP", "engine.checkpoint.files.remove", "models", "models.Nothing", "models.MLP",
        "data.Data", "__main__.main", "ran_when_imported.Model", "linked.Evil",
    )  # fmt: skip
    # By the package alone (no config folder); and by configs/, at a key other than the one it names MLP at.
    for roots, where, target in [*(((), "model", target) for target in refused_here), (CONFIG_ROOTS, "callbacks.x", "models.MLP")]:  # fmt: skip
        named = f"{{cookiecutter.package}}.{target}"
        config = reduce(lambda inner, key: {key: inner}, reversed(where.split(".")), {"_target_": named})
        with pytest.raises(RunError) as refused:
            targets.check(config, {}, roots, tmp_path / "sent.pt")
        assert str(refused.value) == refusal(tmp_path / "sent.pt", f"{where}._target_", named)
    assert set(sys.modules) == modules and not marker.exists()


@pytest.mark.daily
def test_a_config_files_targets_are_placed_under_its_group_or_where_its_package_line_says(tmp_path):
    files = {
        "config.yaml": "hydra:\n  callbacks:\n    sweep:\n      _target_: a.Sweep\n",
        "model/wide.yaml": "_target_: a.Wide\nlayers: [{_target_: a.Layer}]\n",
        "callbacks/curve.yaml": "curve:\n  _target_: a.Curve\n",
        "experiment/big.yaml": "# @package _global_\ndefaults:\n  - override /model: wide\nmodel:\n  _target_: a.Big\n",
        "hydra/launcher/cluster.yaml": "# @package hydra.launcher\n_target_: a.Launcher\n",
        "loss/nested.yaml": "# A comment before the line: Hydra reads no package line after it.\n# @package x\n_target_: a.Loss\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert targets.targets_in(tmp_path) == {
        ("hydra.callbacks.sweep._target_", "a.Sweep"),
        ("model._target_", "a.Wide"),
        ("model.layers.0._target_", "a.Layer"),
        ("callbacks.curve._target_", "a.Curve"),
        ("model._target_", "a.Big"),
        ("hydra.launcher._target_", "a.Launcher"),
        ("loss._target_", "a.Loss"),
    }


@pytest.mark.parametrize("target", ["__main__.main", "ran_when_imported.Model", "data.Data"])
def test_no_module_of_the_package_runs_before_a_target_it_does_not_define_is_refused(project, written, target):
    """A program's `__main__.py` and a module whose body acts are not imported to be refused, nor the
    shim that warns when it is: eval.py's whole output is the refusal."""
    _, marker = copied(project / "src")
    named = f"{{cookiecutter.package}}.{target}"
    sent = crafted(written, project / "sent.pt", lambda config: config["model"].update(_target_=named))
    env = {**os.environ, "PYTHONPATH": str(project / "src")}  # the copy is the package eval.py imports
    process = start(project, *CPU, f"checkpoint={sent}", script="eval.py", env=env)
    _, stderr = process.communicate(timeout=180)
    assert (process.returncode, stderr) == (2, f"error: {refusal(sent, 'model._target_', named)}\n")
    assert not marker.exists()


@pytest.mark.parametrize("key", ["callbacks.x._target_", "model._target_"])
def test_an_engine_class_that_configs_names_for_hydra_is_refused_at_any_other_key(typed, written, tmp_path, key):
    """configs/ names the sweep callback under `hydra.callbacks`: a checkpoint cannot have the run build
    it as a callback of its training, or as its model."""
    config = reduce(lambda inner, part: {part: inner}, reversed(key.split(".")[:-1]), {"_target_": SWEEP})
    sent = crafted(written, tmp_path / "sent.pt", lambda stored: stored.update(config))
    with pytest.raises(RunError) as refused:
        started("resume", typed, sent, tmp_path)
    assert str(refused.value) == refusal(sent, key, SWEEP)


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
    assert (experiment.name, run.info.run_name) == (configured().mlflow.experiment_name, configured().name)
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
        (lambda config: config["model"].update(x=nested(100)), f"whose model.x{'.x' * 31} lies deeper than 32 levels"),
        (lambda config: config.update({f"k{n}": n for n in range(5000)}), "of more than 5000 keys and list items"),
        (lambda config: config.update(trainer=[1, 2]), "whose trainer is a list ([1, 2]), where this project's setting is a mapping"),
        (lambda config: config["trainer"].update(max_steps="many"), "whose trainer.max_steps is a str ('many'), where this project's setting is of type int"),
        (lambda config: config["trainer"].update(max_steps="300"), "whose trainer.max_steps is a str ('300'), where this project's setting is of type int"),
        (lambda config: config["checkpoint"].update(keep_best="true"), "whose checkpoint.keep_best is a str ('true'), where this project's setting is of type bool"),
        (lambda config: config["init"].update(freeze=[1]), "whose init.freeze is a list ([1]), where this project's setting is of type list[str]"),
        (lambda config: config.update(model=[1, 2]), "whose model is not a mapping, as a component is"),
    ],
    ids=["deep", "large", "list-for-mapping", "string-for-number", "number-as-string", "boolean-as-string", "number-in-list", "list-for-component"],
)  # fmt: skip
def test_a_config_that_is_not_this_projects_plain_data_is_refused_in_one_line(typed, written, tmp_path, change, said):
    sent = crafted(written, tmp_path / "sent.pt", change)
    with pytest.raises(RunError) as refused:
        started("resume", typed, sent, tmp_path)
    assert str(refused.value) == f"{sent} holds a config {said}; pass a checkpoint this project wrote"
