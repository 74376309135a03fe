"""The engine's modules before its folders (engine/moved.py): a file of a project's written then
imports and runs them by their old paths, and a checkpoint saved then, whose config names its
components by those paths, resumes, is evaluated and exported, its targets read as they are now."""

import importlib
import subprocess
import sys

import pytest
from conftest import run_cli

from {{cookiecutter.package}}.engine import moved
from {{cookiecutter.package}}.engine.checkpoint import onefile
from {{cookiecutter.package}}.engine.data.formats import shards
from {{cookiecutter.package}}.engine.data.formats.save_to_disk import write_digits

ENGINE = "{{cookiecutter.package}}.engine"
OLD, NEW = f"{ENGINE}.ready.arrow.arrow_folder", f"{ENGINE}.data.formats.arrow.arrow_folder"


def test_each_old_module_path_imports_the_module_now_itself():
    assert moved.MOVED[f"{ENGINE}.ready.arrow"] == f"{ENGINE}.data.formats.arrow"
    for old, new in moved.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
        assert importlib.import_module(new).__spec__.name == new  # the module's own, as imported by its path now
    from {{cookiecutter.package}}.engine import goodput, standby  # as a run.py of before imports them

    assert (goodput.__name__, standby.__name__) == (f"{ENGINE}.lifecycle.goodput", f"{ENGINE}.lifecycle.standby")
    assert moved.current(OLD) == NEW and moved.current(NEW) == NEW
    assert moved.current(f"{ENGINE}.readyish.arrow") == f"{ENGINE}.readyish.arrow"


def test_python_m_of_an_old_path_runs_the_module_now(monkeypatch, capsys):
    """A new interpreter's `python -m` of the old path says what the module now says, asked here (as
    `python -m` would: its file the program); both at one width, whatever this terminal's."""
    monkeypatch.setenv("COLUMNS", "80")
    old = subprocess.run([sys.executable, "-m", f"{ENGINE}.ready.shards", "--help"], capture_output=True, text=True)
    monkeypatch.setattr(sys, "argv", [shards.__file__, "--help"])
    with pytest.raises(SystemExit) as ended:
        shards.main()
    new = capsys.readouterr()
    assert (old.returncode, old.stdout, old.stderr) == (ended.value.code, new.out, new.err)
    assert old.returncode == 0 and "write" in old.stdout


@pytest.mark.slow
def test_a_checkpoint_naming_old_paths_resumes_is_evaluated_and_exported_naming_them_as_now(project, tmp_path):
    write_digits(tmp_path / "digits", shards=2)
    data = ["data=arrow_folder", f"data.dir={tmp_path / 'digits'}", "data.inputs=pixels", "data.num_workers=0"]
    settings = ["name=moved", "device=cpu", "mlflow.enabled=false", "trainer.val_every_n_steps=2", *data]
    trained = run_cli(project, *settings, f"data._target_={OLD}", "trainer.max_steps=4")
    assert trained.returncode == 0, trained.stderr
    home = project / "checkpoints" / "moved"
    saved = home / "step_00000004.pt"
    assert onefile.read(saved, True, device="meta")["config"]["data"]["_target_"] == OLD

    resumed = run_cli(project, *settings, "trainer.max_steps=8", "resume=last")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 4" in resumed.stdout
    assert onefile.read(home / "step_00000008.pt", True, device="meta")["config"]["data"]["_target_"] == NEW
    evaluated = run_cli(project, *settings, f"checkpoint={saved}", script="eval.py")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "val/loss" in evaluated.stdout
    exported = run_cli(
        project, *settings, f"checkpoint={saved}", f"out={tmp_path / 'model.safetensors'}", script="export.py"
    )
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "model.safetensors").stat().st_size > 0
