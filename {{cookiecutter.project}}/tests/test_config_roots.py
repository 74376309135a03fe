"""A run's config comes from two roots: the project's configs/ (yours: the defaults list, the
experiments, what you change) and the engine's (every group, option and setting, which updates
bring), the first one's files winning."""

import shutil

import pytest
import yaml
from conftest import CONFIG_ROOTS, PROJECT, run_cli
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

from {{cookiecutter.package}}.engine.config_roots import check_roots, config_roots
from {{cookiecutter.package}}.engine.errors import RunError


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
    (configs / "optimizer").mkdir(exist_ok=True)
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


def hiding_the_engines_settings(configs):
    (configs / "engine.yaml").write_text("trainer:\n  max_steps: 50\n")
    return f"{configs / 'engine.yaml'} hides the engine's engine ({CONFIG_ROOTS[1] / 'engine.yaml'}): Hydra reads yours"


def dropping_the_engines_entry(configs):
    choices = yaml.safe_load((configs / "config.yaml").read_text())
    choices["defaults"].remove("engine")
    (configs / "config.yaml").write_text(yaml.safe_dump(choices, sort_keys=False))
    return f"{configs / 'config.yaml'}'s defaults list drops engine, the engine's {CONFIG_ROOTS[1] / 'engine.yaml'}"


def searching_elsewhere(configs):
    choices = yaml.safe_load((configs / "config.yaml").read_text())
    choices["hydra"]["searchpath"] = ["file://shared/configs"]
    (configs / "config.yaml").write_text(yaml.safe_dump(choices, sort_keys=False))
    return (
        f"{configs / 'config.yaml'}'s hydra.searchpath (file://shared/configs) leaves out the engine's configs, "
        "pkg://{{cookiecutter.package}}.engine.configs, where every group and option is: add it to that list"
    )


CHANGES = [hiding_the_engines_settings, dropping_the_engines_entry, searching_elsewhere]


@pytest.mark.parametrize("change", CHANGES)
def test_a_configs_folder_that_hides_or_drops_the_engines_root_is_refused_in_one_line_naming_the_file(tmp_path, change):
    configs = shutil.copytree(PROJECT / "configs", tmp_path / "configs")
    check_roots([configs], configs / "config.yaml", [])
    said = change(configs)
    with pytest.raises(RunError) as refused:
        check_roots([configs], configs / "config.yaml", [])
    assert str(refused.value).startswith(said) and "\n" not in str(refused.value)


def test_a_search_path_typed_without_the_engines_root_is_refused_and_one_that_names_it_is_not():
    with pytest.raises(RunError, match=r"^hydra.searchpath=\[file:///srv\] replaces the search path of .*: name it"):
        check_roots([PROJECT / "configs"], PROJECT / "configs" / "config.yaml", ["hydra.searchpath=[file:///srv]"])
    searched = "hydra.searchpath=[file:///srv,pkg://{{cookiecutter.package}}.engine.configs]"
    check_roots([PROJECT / "configs"], PROJECT / "configs" / "config.yaml", [searched])


@pytest.mark.parametrize(
    "spelled",
    ["pkg://{{cookiecutter.package}}/engine/configs", "pkg://{{cookiecutter.package}}.engine.configs/", f"file://{CONFIG_ROOTS[1]}"]
    + ["/engine", "engine.yaml", "engine@_here_", "engine@_global_"],  # the defaults list's entry
)
def test_the_engines_root_spelled_as_hydra_also_reads_it_is_not_refused(tmp_path, spelled):
    """Each of these composes every setting: refused, as the spelling of config.yaml's was the only
    one taken, a run that works would never start."""
    configs = shutil.copytree(PROJECT / "configs", tmp_path / "configs")
    choices = yaml.safe_load((configs / "config.yaml").read_text())
    if "://" in spelled:
        choices["hydra"]["searchpath"] = [spelled]
    else:
        choices["defaults"][choices["defaults"].index("engine")] = spelled
    (configs / "config.yaml").write_text(yaml.safe_dump(choices, sort_keys=False))
    assert composed(configs).trainer.max_steps == composed(PROJECT / "configs").trainer.max_steps
    check_roots([configs], configs / "config.yaml", [])
    if "://" in spelled:
        check_roots([PROJECT / "configs"], PROJECT / "configs" / "config.yaml", [f"hydra.searchpath=[{spelled}]"])


@pytest.mark.parametrize(
    "change, script", [*((change, "run.py") for change in CHANGES), (CHANGES[0], "eval.py"), (CHANGES[1], "export.py")]
)
def test_each_command_on_such_a_configs_folder_says_that_one_line_and_exits_2(project, change, script):
    """Hydra said these with a traceback (`Key 'standby' is not in struct`), in 7 lines (`Key 'name'
    is not in struct`), or with its search path, naming neither the file nor the fix."""
    said = change(project / "configs")
    result = run_cli(project, "device=cpu", script=script)
    assert (result.returncode, result.stderr.count("\n")) == (2, 1), result.stderr
    assert result.stderr.startswith(f"error: {said}")


@pytest.mark.parametrize(
    "option, typed",
    [
        ("--config-name", ["--config-name", "mine"]),
        ("-cn", ["-cn=mine.yaml", "-c", "job"]),  # Hydra's -c is --cfg's: it would print a config without the engine's
        ("--config-path", ["--config-path", "mine"]),
        ("--config-dir", ["-cd", "mine"]),
    ],
)
def test_the_config_or_folder_hydras_options_name_is_checked_as_configs_config_yaml_is(project, option, typed):
    """`--config-name`, `--config-path` and `--config-dir` choose what Hydra composes from: a config
    there that drops the engine's root, or a file there that hides it, had Hydra's errors (`Key
    'trainer' is not in struct`), or a run with the wrong settings."""
    configs = project / "configs"
    if option == "--config-path":
        configs = shutil.copytree(configs, project / "mine")
        said = dropping_the_engines_entry(configs)
    elif option == "--config-dir":
        (project / "mine").mkdir()
        said = hiding_the_engines_settings(project / "mine")
    else:
        said = dropping_the_engines_entry(configs).replace("config.yaml", "mine.yaml")
        (configs / "config.yaml").rename(configs / "mine.yaml")
        shutil.copy(PROJECT / "configs" / "config.yaml", configs / "config.yaml")
    result = run_cli(project, *typed, "device=cpu", "trainer.max_steps=2")
    assert (result.returncode, result.stdout, result.stderr.count("\n")) == (2, "", 1), result.stderr
    assert result.stderr.startswith(f"error: {said}")
