"""A run's config comes from two roots: the project's configs/ (yours: the defaults list, the
experiments, what you change) and the engine's (every group, option and setting, which updates
bring), the first one's files winning."""

import shutil

import yaml
from conftest import CONFIG_ROOTS, PROJECT
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from {{cookiecutter.package}}.engine.config import config_roots


def composed(configs, *overrides):
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_a_run_is_composed_from_the_projects_configs_then_the_engines(monkeypatch):
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)
    HydraConfig.instance().set_config(composed(PROJECT / "configs"))
    assert config_roots() == CONFIG_ROOTS
    yours, engines = CONFIG_ROOTS
    assert {"config.yaml", "experiment"} <= {path.name for path in yours.iterdir()}
    assert (engines / "engine.yaml").is_file() and (engines / "optimizer" / "adamw.yaml").is_file()


def test_a_file_of_yours_wins_over_the_engines_of_the_same_path_and_yours_adds_options(tmp_path):
    configs = shutil.copytree(PROJECT / "configs", tmp_path / "configs")
    choices = yaml.safe_load((configs / "config.yaml").read_text())  # its settings win over any file
    (configs / "config.yaml").write_text(yaml.safe_dump({key: choices[key] for key in ("defaults", "hydra")}))
    (configs / "optimizer").mkdir()
    (configs / "optimizer" / "adamw.yaml").write_text("_target_: torch.optim.AdamW\nlr: 0.125\n")
    (configs / "optimizer" / "slow_sgd.yaml").write_text("_target_: torch.optim.SGD\nlr: 0.001\n")
    assert dict(composed(configs).optimizer) == {"_target_": "torch.optim.AdamW", "lr": 0.125}
    assert composed(configs, "optimizer=slow_sgd").optimizer.lr == 0.001
    assert composed(configs, "optimizer=sgd").optimizer.momentum == 0.9  # the engine's, beside yours


def test_a_setting_of_your_config_yaml_wins_over_the_engines_default_and_an_experiment_over_both(tmp_path):
    configs = shutil.copytree(PROJECT / "configs", tmp_path / "configs")
    choices = yaml.safe_load((configs / "config.yaml").read_text())
    choices.setdefault("trainer", {})["max_steps"] = 50
    (configs / "config.yaml").write_text(yaml.safe_dump(choices, sort_keys=False))
    assert composed(configs).trainer.max_steps == 50
    assert composed(configs).trainer.log_every_n_steps == composed(PROJECT / "configs").trainer.log_every_n_steps
    experiment = yaml.safe_load((configs / "experiment" / "char_lm.yaml").read_text())
    assert composed(configs, "experiment=char_lm").trainer.max_steps == experiment["trainer"]["max_steps"]
