"""A run remembers its settings: resumed, evaluated and exported by its name alone, from the config
its checkpoint holds; what a command line types changes what it names, and nothing else."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import BASE, CONFIG_ROOTS, PROJECT, configured, losses, run_cli, runs_named
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_distributed import CPU, store

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.remembered import CommandLine, merged

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# A small character-level GPT: a run that the defaults (an MLP on the digits) do not build.
LM = [
    "experiment=char_lm", "name=lm", "model.width=16", "model.depth=1", "model.heads=2", "data.block_size=16",
    "data.max_chars=20000", "data.batch_size=8", "trainer.max_steps=10",
]  # fmt: skip


@pytest.fixture
def typed(tmp_path, tracking_uri):
    """Composes `python run.py <overrides>` and says what was typed, as run.py hands it to the recipe;
    each run's checkpoints in a home of its name."""

    return lambda *overrides: composed(tmp_path / "checkpoints", tracking_uri, *overrides)


def composed(homes: Path, tracking_uri: str, *overrides: str) -> tuple:
    """The config of `python run.py <overrides>`, each run's home in `homes`, and what was typed."""
    values = {**BASE, "checkpoint.dir": f"{homes}/" + "${name}", "mlflow.tracking_uri": tracking_uri}
    values.update(override.split("=", 1) for override in overrides)
    said = tuple(f"{key}={value}" for key, value in values.items())
    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        cfg, defaults = compose("config", overrides=list(said)), compose("config")
    return cfg, CommandLine(said, lambda: defaults, CONFIG_ROOTS)


def test_a_resume_by_name_takes_the_runs_settings_and_changes_only_what_it_types(typed, client, caplog, tmp_path):
    first = recipe.train(*typed(*LM))
    with pytest.raises(RunError) as refused:  # the model's width: not a resume's to change
        recipe.train(*typed("name=lm", "resume=last", "++model.width=32"))
    said = r"the checkpoint does not fit this model \(.*\); this run changes model.width 16 -> 32: resume without it"
    assert re.fullmatch(said + ".*", str(refused.value))  # one line

    with caplog.at_level(logging.INFO):
        resumed = recipe.train(*typed("name=lm", "resume=last", "trainer.max_steps=20", "optimizer.lr=1e-3"))
    assert resumed["step"] == 20 and resumed["run_id"] == first["run_id"] and "val/perplexity" in resumed
    (said,) = [line for line in caplog.messages if line.startswith("resuming with changed settings")]
    assert set(re.findall(r"(\S+) \S+ -> \S+", said)) == {"trainer.max_steps", "optimizer.lr", "scheduler.total_steps"}
    tags = client.get_run(first["run_id"]).data.tags
    assert tags["resume.1.trainer.max_steps"] == "20" and tags["resume.1.optimizer.lr"] == "0.001"
    assert sorted(losses(client, first["run_id"])) == list(range(1, 21))
    assert newest_valid(tmp_path / "checkpoints" / "lm").config["model"]["width"] == 16


def test_a_fine_tune_resumes_without_its_init_settings_and_keeps_its_layers_frozen(typed, tmp_path):
    source_name = configured().name
    recipe.train(*typed("trainer.max_steps=10", "mlflow.enabled=false"))
    fine_tune = ["name=ft", f"init.checkpoint={source_name}", "init.ignore=[head.*]", "init.freeze=[body.*]"]
    recipe.train(*typed(*fine_tune, "trainer.max_steps=10", "mlflow.enabled=false"))
    resumed = recipe.train(*typed("name=ft", "resume=last", "trainer.max_steps=20", "mlflow.enabled=false"))
    assert resumed["step"] == 20
    source, saved = (newest_valid(tmp_path / "checkpoints" / name) for name in (source_name, "ft"))
    assert saved.step == 20 and saved.config["init"]["freeze"] == ["body.*"]
    for key, tensor in saved.part("model").items():
        assert torch.equal(tensor, source.part("model")[key]) == key.startswith("body."), key


def test_typed_settings_win_even_at_their_defaults_and_derived_ones_follow_unless_the_run_set_them(typed):
    defaults = configured()
    steps, lr = defaults.trainer.max_steps, defaults.optimizer.lr

    def resumed_from(*trained: str):
        saved = OmegaConf.to_container(typed(*LM, "strategy=fsdp", *trained)[0], resolve=True)
        cfg, said = typed("name=lm", "resume=last", f"trainer.max_steps={steps}", f"optimizer.lr={lr}")  # the defaults'
        return merged(cfg, PROJECT / "step_00000010.pt", saved, said, cfg.keys())  # a path its messages would name

    derived = resumed_from("optimizer.lr=1e-3")
    assert (derived.model._target_, derived.model.width, derived.data.block_size) == (
        "{{cookiecutter.package}}.models.GPT",
        16,
        16,
    )
    assert list(derived.metrics) == ["perplexity"]
    assert derived.strategy.type == "single", "where and how it runs is this command line's: one process here"
    assert (derived.trainer.max_steps, derived.optimizer.lr, derived.scheduler.total_steps) == (steps, lr, steps)
    assert resumed_from("scheduler.total_steps=100").scheduler.total_steps == 100
    # Where its checkpoints are mirrored is this command line's too (none here), never the checkpoint's.
    mirrored = resumed_from("checkpoint.remote=s3://bkt/runs", "checkpoint.remote_wait_s=100").checkpoint
    assert (mirrored.remote, mirrored.remote_wait_s) == (None, defaults.checkpoint.remote_wait_s)


def test_run_eval_and_export_py_take_a_char_lm_run_by_its_name_alone(project, tmp_path):
    trained = run_cli(project, *CPU, *LM, "checkpoint.every_n_steps=10")
    assert trained.returncode == 0, trained.stderr
    resumed = run_cli(project, *CPU, "name=lm", "resume=last", "trainer.max_steps=20")
    assert resumed.returncode == 0, resumed.stderr
    said = "resuming with changed settings: trainer.max_steps 10 -> 20, scheduler.total_steps 10 -> 20\n"
    assert said in resumed.stdout + resumed.stderr
    judged = run_cli(project, *CPU, "name=lm", "checkpoint=last", "data.batch_size=4", script="eval.py")
    assert judged.returncode == 0, judged.stderr
    assert re.search(r"^  val/perplexity \d", judged.stdout, re.MULTILINE)
    out = tmp_path / "lm.safetensors"
    exported = run_cli(project, "name=lm", "checkpoint=last", f"out={out}", script="export.py")
    assert exported.returncode == 0, exported.stderr
    model = json.loads(out.with_suffix(".json").read_text())["model"]
    assert (model["_target_"], model["width"], model["depth"]) == ("{{cookiecutter.package}}.models.GPT", 16, 1)
    (run,) = [run for run in runs_named(store(project), "lm") if "mlflow.parentRunId" not in run.data.tags]
    assert run.data.tags["resumes"] == "1" and run.data.params["model"] == "GPT"
