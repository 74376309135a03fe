"""`python -m <package>.engine.compare <run> <run>`: the settings two runs differ in, from their checkpoints
or MLflow, then their final metrics, for runs named as they were trained or by MLflow id."""

import shutil
import subprocess
import sys

import pytest

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.compare import compare
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.evaluating import evaluate_checkpoint

ADAMW = ("name=cmp-adamw", "optimizer.lr=0.001")
SGD = ("name=cmp-sgd", "optimizer=sgd", "optimizer.lr=0.02")


def rows(table: str) -> dict[str, tuple[str, str]]:
    """The table's rows, `key | first | second`, by key."""
    cells = [[cell.strip() for cell in line.split("|")] for line in table.splitlines() if line.count("|") == 2]
    return {key: (first, second) for key, first, second in cells}


@pytest.fixture
def homes(tmp_path):
    return tmp_path / "homes"


def test_two_runs_show_the_optimizer_and_lr_they_differ_in_then_their_final_metrics(make_cfg, client, homes, tmp_path):
    home = f"checkpoint.dir={homes}/" + "${name}"
    ids = [recipe.train(make_cfg(home, "trainer.max_steps=20", *run))["run_id"] for run in (ADAMW, SGD)]
    # A resume's changes: in the checkpoint's config, and in MLflow as resume.1.<key> tags beside the first params.
    recipe.train(make_cfg(home, *SGD, "optimizer.lr=0.05", "trainer.max_steps=30", "resume=last"))
    cfg = make_cfg(home)

    by_name = compare(cfg, "cmp-adamw", "cmp-sgd")

    shown = rows(by_name)
    settings = {key for key in shown if key not in ("setting", "metric", "step", "train/loss") and "/" not in key}
    # The components by short name, then what only one of them has or both have apart; nothing else.
    assert settings == {"optimizer", "optimizer.lr", "optimizer.betas", "optimizer.momentum", "optimizer.nesterov",
                        "optimizer.weight_decay", "trainer.max_steps", "scheduler.total_steps"}  # fmt: skip
    assert shown["optimizer"] == ("AdamW", "SGD")
    assert shown["optimizer.lr"] == ("0.001", "0.05")
    assert shown["optimizer.momentum"] == ("-", "0.9")
    assert shown["step"] == shown["trainer.max_steps"] == ("20", "30")
    for key in ("train/loss", "val/loss", "val/accuracy"):
        assert shown[key] == tuple(f"{client.get_run(run_id).data.metrics[key]:.4f}" for run_id in ids)
    assert f"{homes}/cmp-adamw, step 20; MLflow run {ids[0]}" in by_name
    # By MLflow id, and by name once the checkpoints are gone, the settings come from MLflow: the same table.
    labels = ("cmp-adamw (" + ids[0][:8] + ")", "cmp-sgd (" + ids[1][:8] + ")")
    assert rows(compare(cfg, *ids)) == {**shown, "setting": labels, "metric": labels}
    evaluate_checkpoint(make_cfg(home, *ADAMW), "last", tmp_path)  # an MLflow run that carries the name too
    shutil.rmtree(homes)
    from_mlflow = compare(cfg, "cmp-adamw", "cmp-sgd")
    assert rows(from_mlflow) == shown
    assert f"cmp-adamw: MLflow run {ids[0]}\n" in from_mlflow


def test_an_untracked_run_shows_its_checkpoints_step_and_score_and_an_unknown_one_names_the_runs_found(make_cfg, homes):
    home = f"checkpoint.dir={homes}/" + "${name}"
    trained = recipe.train(make_cfg(home, "name=cmp-off", "mlflow.enabled=false", "trainer.max_steps=20"))
    cfg = make_cfg(home, "mlflow.enabled=false")

    shown = compare(cfg, "cmp-off", "cmp-off")

    assert f"{homes}/cmp-off, step 20; untracked" in shown
    assert rows(shown)["step"] == ("20", "20")
    assert rows(shown)["val/loss"] == (f"{trained['val/loss']:.4f}",) * 2
    assert "(all the same)" in shown
    with pytest.raises(RunError) as refused:
        compare(cfg, "cmp-off", "cmp-of")
    assert str(refused.value) == (
        f"no run 'cmp-of': no checkpoint in {homes}/cmp-of, MLflow is off; runs found: cmp-off"
    )


def test_the_command_in_the_project_folder_reads_its_own_store_and_checkpoints(make_cfg, project):
    on_disk = (
        f"checkpoint.dir={project}/checkpoints/" + "${name}",
        f"mlflow.tracking_uri=sqlite:///{project}/mlflow.db",
    )
    for run in (ADAMW, SGD):
        recipe.train(make_cfg(*on_disk, "trainer.max_steps=10", *run))

    done, missing = (
        subprocess.run(
            [sys.executable, "-m", "{{cookiecutter.package}}.engine.compare", "cmp-adamw", other],
            cwd=project,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for other in ("cmp-sgd", "nothing")
    )

    assert done.returncode == 0, done.stderr
    assert rows(done.stdout)["optimizer"] == ("AdamW", "SGD")
    assert rows(done.stdout)["step"] == ("10", "10")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("error: no run 'nothing': ") and missing.stderr.count("\n") == 1
    assert missing.stderr.rstrip().endswith("runs found: cmp-adamw, cmp-sgd")
