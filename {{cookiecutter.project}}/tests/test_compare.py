"""`python -m <package>.engine.compare <run> <run>`: the settings two runs differ in, from their checkpoints
or MLflow, the better of the two by optimized_metric, then their final metrics, for runs named as they
were trained or by MLflow id."""

import shutil
import sqlite3
import sys

import pytest
from conftest import copy_project, new_experiment, run_cli
from mlflow.entities import Metric, Param

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.home import SCORES, path_of, rank
from {{cookiecutter.package}}.engine.checkpoint.onefile import write
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.compare import compare, main
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.evaluating import evaluate_checkpoint
from {{cookiecutter.package}}.engine.sweeps import figure

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# Each with a weight decay of its own, as the options give them, whatever the configs give both.
ADAMW = ("name=cmp-adamw", "optimizer.lr=0.001", "optimizer.weight_decay=0.01")
SGD = ("name=cmp-sgd", "optimizer=sgd", "optimizer.lr=0.02", "optimizer.weight_decay=0.0")
# The pair: one run best at step 100 and worse since, to 300; the other ends at 200 below
# where the first ends, but above its best.
LONG = {100: 0.5, 200: 0.9, 300: 0.8}
SHORT = {100: 0.7, 200: 0.6}


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
    settings = {key for key in shown if key not in ("setting", "best", "final", "metric", "step") and "/" not in key}
    # The components by short name, then what only one of them has or both have apart; nothing else.
    assert settings == {"optimizer", "optimizer.lr", "optimizer.betas", "optimizer.momentum", "optimizer.nesterov",
                        "optimizer.weight_decay", "trainer.max_steps", "scheduler.total_steps"}  # fmt: skip
    assert shown["optimizer"] == ("AdamW", "SGD")
    assert shown["optimizer.lr"] == ("0.001", "0.05")
    assert shown["optimizer.momentum"] == ("-", "0.9")
    assert shown["step"] == shown["trainer.max_steps"] == ("20", "30")
    for key in ("train/loss", "val/loss", "val/accuracy"):
        assert shown[key] == tuple(figure(client.get_run(run_id).data.metrics[key]) for run_id in ids)
    # Judged by val/loss from MLflow's history: the final is the last logged, the best the lowest.
    final = zip(shown["val/loss"], shown["step"], strict=True)
    assert shown["final"] == tuple(f"{value} at step {step}" for value, step in final)
    bests = [min(client.get_metric_history(run_id, "val/loss"), key=lambda metric: metric.value) for run_id in ids]
    assert shown["best"] == tuple(f"{figure(best.value)} at step {best.step}" for best in bests)
    assert f"{homes}/cmp-adamw, step 20; MLflow run {ids[0]}" in by_name
    # By MLflow id, and by name once the checkpoints are gone, the settings come from MLflow: the same table.
    labels = ("cmp-adamw (" + ids[0][:8] + ")", "cmp-sgd (" + ids[1][:8] + ")")
    assert rows(compare(cfg, *ids)) == {**shown, "setting": labels, "val/loss (min)": labels, "metric": labels}
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
    assert rows(shown)["val/loss"] == (figure(trained["val/loss"]),) * 2
    assert "(all the same)" in shown
    with pytest.raises(RunError) as refused:
        compare(cfg, "cmp-off", "cmp-of")
    assert str(refused.value) == (
        f"no run 'cmp-of': no checkpoint in {homes}/cmp-of, MLflow is off; runs found: cmp-off"
    )


def logged(client, experiment: str, name: str, optimized: tuple[str, str], **curves: dict[int, float]) -> str:
    """An MLflow run as a training run leaves it: its params, and each curve of `curves` (a metric's
    name, `/` as `_`) logged at its steps."""
    run_id = client.create_run(experiment, run_name=name).info.run_id
    steps = max(step for curve in curves.values() for step in curve)
    metric, mode = optimized
    params = {"name": name, "trainer.max_steps": steps, "optimized_metric": metric, "optimized_mode": mode}
    metrics = [
        Metric(key.replace("_", "/"), value, 0, step) for key, curve in curves.items() for step, value in curve.items()
    ]
    client.log_batch(run_id, metrics=metrics, params=[Param(key, str(value)) for key, value in params.items()])
    return run_id


def test_the_better_run_is_the_one_of_the_better_best_each_at_its_step_though_the_other_ends_lower(
    make_cfg, client, homes
):
    experiment = new_experiment(client, "cmp-judged")
    logged(client, experiment, "cmp-long", ("val/loss", "min"), val_loss=LONG, val_accuracy={100: 0.9, 300: 0.7})
    logged(client, experiment, "cmp-short", ("val/loss", "min"), val_loss=SHORT)
    logged(client, experiment, "cmp-acc", ("val/accuracy", "max"), val_accuracy={100: 0.8, 200: 0.7})
    cfg = make_cfg(f"checkpoint.dir={homes}/" + "${name}")

    shown = compare(cfg, "cmp-long", "cmp-short")

    assert rows(shown)["val/loss (min)"] == ("cmp-long", "cmp-short")
    assert rows(shown)["best"] == ("0.5 at step 100", "0.6 at step 200")
    assert rows(shown)["final"] == ("0.8 at step 300", "0.6 at step 200")
    assert "\nbetter by best val/loss (min): cmp-long, 0.5 at step 100 against 0.6 at step 200\n" in shown
    assert "\nbetter by best val/loss (min): neither, a tie at 0.6\n" in compare(cfg, "cmp-short", "cmp-short")
    # Runs that optimize different metrics are judged by the first's: higher is better for accuracy.
    apart = compare(cfg, "cmp-acc", "cmp-long")
    assert "\nthe runs optimize val/accuracy (max) and val/loss (min): judged by the first's\n" in apart
    assert rows(apart)["best"] == ("0.8 at step 100", "0.9 at step 100")
    assert "\nbetter by best val/accuracy (max): cmp-long, 0.9 at step 100 against 0.8 at step 100\n" in apart
    assert "\nbetter by best val/loss (min): unknown: cmp-acc has no finite value of it\n" in compare(
        cfg, "cmp-long", "cmp-acc"
    )


def test_untracked_runs_are_judged_by_the_scores_their_best_and_newest_checkpoints_hold(make_cfg, homes):
    home = f"checkpoint.dir={homes}/" + "${name}"
    for name, scores in (("cmp-off-long", LONG), ("cmp-off-short", SHORT)):
        steps = [f"trainer.max_steps={max(scores) // 10}", "trainer.val_every_n_steps=10"]
        steps += ["checkpoint.every_n_steps=10", "checkpoint.keep_last=3"]  # a save a score: 10, 20, 30
        recipe.train(make_cfg(home, f"name={name}", "mlflow.enabled=false", *steps))
        for step, value in scores.items():  # each save's val/loss, as the pair logged it
            path = path_of(homes / name, step // 10)
            state = load(path).state
            state["score"]["value"] = value
            write(state, path)
        (homes / name / SCORES).unlink()
        rank(homes / name, {}, "val/loss", "min")  # `best` again, by the scores the checkpoints hold

    shown = compare(make_cfg(home, "mlflow.enabled=false"), "cmp-off-long", "cmp-off-short")

    assert rows(shown)["best"] == ("0.5 at step 10", "0.6 at step 20")
    assert rows(shown)["final"] == ("0.8 at step 30", "0.6 at step 20")
    assert "\nbetter by best val/loss (min): cmp-off-long, 0.5 at step 10 against 0.6 at step 20\n" in shown


def test_the_command_in_the_project_folder_reads_its_own_store_and_checkpoints(make_cfg, project):
    on_disk = (
        f"checkpoint.dir={project}/checkpoints/" + "${name}",
        f"mlflow.tracking_uri=sqlite:///{project}/mlflow.db",
    )
    for run in (ADAMW, SGD):
        recipe.train(make_cfg(*on_disk, "trainer.max_steps=10", *run))

    done, missing = (
        run_cli(project, "{{cookiecutter.package}}.engine.compare", "cmp-adamw", other, script="-m", timeout=120)
        for other in ("cmp-sgd", "nothing")
    )

    assert done.returncode == 0, done.stderr
    assert rows(done.stdout)["optimizer"] == ("AdamW", "SGD")
    assert rows(done.stdout)["step"] == ("10", "10")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("error: no run 'nothing': ") and missing.stderr.count("\n") == 1
    assert missing.stderr.rstrip().endswith("runs found: cmp-adamw, cmp-sgd")


def test_a_value_planted_in_a_checkpoint_is_shown_without_its_control_characters(make_cfg, homes):
    home = f"checkpoint.dir={homes}/" + "${name}"
    for name in ("cmp-a", "cmp-b"):
        recipe.train(make_cfg(home, f"name={name}", "mlflow.enabled=false", "trainer.max_steps=5", "optimizer.lr=3e-3"))
    path = homes / "cmp-b" / "step_00000005.pt"
    state = load(path).state
    state["config"]["optimizer"]["lr"] = "0.5\x1b[2J"  # ESC [2J: clears the screen it is printed on
    write(state, path)

    shown = compare(make_cfg(home, "mlflow.enabled=false"), "cmp-a", "cmp-b")

    assert rows(shown)["optimizer.lr"] == ("0.003", "0.5[2J") and "\x1b" not in shown


@pytest.mark.parametrize(
    ("store", "said"),
    [
        ("locked", "is locked by another process; run this again once that is done"),
        (
            "no-database",
            "could not be read (file is not a database); name the store the runs logged to with "
            "mlflow.tracking_uri=sqlite:///<path>",
        ),
    ],
)
def test_a_store_another_process_locks_or_that_is_no_database_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys, store, said
):
    database = tmp_path / "mlflow.db"
    if store == "locked":  # as a process writing to it holds it, for longer than sqlite waits
        holder = sqlite3.connect(database, isolation_level=None)
        holder.execute("CREATE TABLE runs (id)")
        holder.execute("BEGIN EXCLUSIVE")
    else:
        database.write_text("notes, not a database\n" * 200)
    monkeypatch.chdir(copy_project(tmp_path))
    monkeypatch.setattr(sys, "argv", ["compare", "cmp-adamw", "cmp-sgd", f"mlflow.tracking_uri=sqlite:///{database}"])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        f"error: MLflow's store {database} {said}, or pass mlflow.enabled=false to compare the runs' checkpoints "
        f"alone\n"
    )
