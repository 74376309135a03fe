"""eval.py: a checkpoint's model judged on the validation (and test) split, logged to an MLflow run
of its own under the run that trained it, which it leaves as it was, on disk and in MLflow."""

import functools
import logging
import os
import re
import shutil
import signal

import pytest
import torch
from conftest import configured, losses, run_cli, runs_named, start
from test_distributed import CPU, finished, store, torchrun
from test_remembered import composed
from test_tracking import inputs_of

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.home import BEST, path_of, steps
from {{cookiecutter.package}}.engine.checkpoint.initial import load_weights
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.evaluating import evaluate_checkpoint

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# Judged by the highest val/loss, the best checkpoint is an early one that retention of the newest 2
# alone would delete (test_best.py).
PEAK = ["optimized_mode=max", "checkpoint.keep_last=2"]


def val_losses(client, run_id: str, key: str = "val/loss") -> dict[int, float]:
    return {step: values[-1] for step, values in losses(client, run_id, key).items()}


def on_disk(home) -> dict[str, tuple[bytes, int]]:
    """Every file under `home`, its bytes and its modification time."""
    return {
        str(path.relative_to(home)): (path.read_bytes(), path.stat().st_mtime_ns)
        for path in sorted(home.rglob("*"))
        if path.is_file()
    }


def in_mlflow(client, run_id: str) -> tuple:
    """All that MLflow holds of a run: its info, params, tags, every metric's history, its files."""
    run = client.get_run(run_id)
    histories = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in run.data.metrics}
    files = [entry.path for entry in client.list_artifacts(run_id)]
    return run.info.status, run.info.end_time, run.data.params, run.data.tags, histories, files


def printed(output: str) -> dict[str, float]:
    """The metrics eval.py prints, a line each: `  val/loss 0.123...`."""
    return {key: float(value) for key, value in re.findall(r"^  ((?:val|test)/\w+) (\S+)$", output, re.MULTILINE)}


def test_the_best_checkpoint_gives_the_val_loss_logged_at_its_step_and_the_training_run_is_left_as_it_was(
    make_cfg, client, checkpoint_dir, tmp_path
):
    trained = recipe.train(make_cfg(*PEAK))
    logged = val_losses(client, trained["run_id"])
    best = max(logged, key=logged.get)
    assert best < 30 and path_of(checkpoint_dir, best).exists()  # kept by retention for being the best
    files, run = on_disk(checkpoint_dir), in_mlflow(client, trained["run_id"])

    judged = evaluate_checkpoint(make_cfg(*PEAK), "best", tmp_path / "eval")

    assert judged["step"] == best
    assert judged["val/loss"] == logged[best]  # exactly: the same weights, batches and order
    assert judged["val/accuracy"] == val_losses(client, trained["run_id"], "val/accuracy")[best]
    assert not any(key.startswith("test/") for key in judged), "the digits give no test split by default"
    assert on_disk(checkpoint_dir) == files
    assert in_mlflow(client, trained["run_id"]) == run
    evaluation = client.get_run(judged["run_id"])
    assert evaluation.info.status == "FINISHED"
    assert evaluation.data.tags["mlflow.parentRunId"] == trained["run_id"]
    assert evaluation.data.tags["eval.source_step"] == str(best)
    assert evaluation.data.tags["eval.source_checkpoint"] == str(path_of(checkpoint_dir, best))
    assert val_losses(client, judged["run_id"]) == {best: logged[best]}
    assert inputs_of(client, judged["run_id"]).keys() == {"validation"}


def test_a_test_split_is_judged_beside_validation(make_cfg, client, tmp_path):
    split = "data.test_fraction=0.1"
    recipe.train(make_cfg(split, "mlflow.enabled=false"))
    judged = evaluate_checkpoint(make_cfg(split), "last", tmp_path / "eval")
    assert judged["step"] == 40
    assert {"test/loss", "test/accuracy", "val/loss", "val/accuracy"} <= judged.keys()
    assert judged["test/loss"] != judged["val/loss"]
    assert val_losses(client, judged["run_id"], "test/loss") == {40: judged["test/loss"]}
    assert inputs_of(client, judged["run_id"]).keys() == {"validation", "test"}


def test_eval_by_name_computes_as_the_newest_checkpoint_trained_unless_amp_is_typed(tmp_path, tracking_uri, client):
    """A run whose last leg trained in bf16 is judged in bf16 (its val/loss, exactly as logged at that
    step), though the command line says nothing of amp; `amp=off` typed judges it in float32."""
    typed = functools.partial(composed, tmp_path / "checkpoints", tracking_uri)
    recipe.train(*typed("trainer.max_steps=20"))
    trained = recipe.train(*typed("resume=last", "amp=bf16"))
    logged = val_losses(client, trained["run_id"])[40]

    cfg, said = typed()
    judged = evaluate_checkpoint(cfg, "last", tmp_path / "eval", said)
    assert (judged["step"], judged["val/loss"]) == (40, logged)
    assert client.get_run(judged["run_id"]).data.tags["amp"] == "bfloat16"

    cfg, said = typed("amp=off")
    in_float32 = evaluate_checkpoint(cfg, "last", tmp_path / "eval", said)
    assert client.get_run(in_float32["run_id"]).data.tags["amp"] == "off"
    assert in_float32["val/loss"] != logged


@pytest.mark.parametrize(
    ("first", "asked", "said"),
    [
        (
            None,
            "best",
            r"checkpoint=best: .* holds no checkpoint of {name}; train it first \(python run.py name={name}\)",
        ),
        (["checkpoint.keep_best=false"], "best", r"names no best checkpoint .*; pass checkpoint=last"),
        ([], "no/such.pt", r"checkpoint=no/such.pt: no such file or folder; pass checkpoint=best, checkpoint=last or"),
        (["model=cnn"], "last", r"was trained with model._target_=.*CNN, .*and this command asks for model._target_="),
        (["data.test_fraction=0.1"], "last", r"test_fraction=0.1, and this command asks for data.test_fraction=0.0"),
    ],
)
def test_what_names_no_checkpoint_or_another_model_is_one_line(make_cfg, checkpoint_dir, tmp_path, first, asked, said):
    if first is not None:
        recipe.train(make_cfg("mlflow.enabled=false", *first))
    files = on_disk(checkpoint_dir) if checkpoint_dir.exists() else {}
    with pytest.raises(RunError, match=said.format(name=re.escape(make_cfg().name))):
        evaluate_checkpoint(make_cfg("mlflow.enabled=false"), asked, tmp_path / "eval")
    assert (on_disk(checkpoint_dir) if checkpoint_dir.exists() else {}) == files


def test_eval_py_judges_the_best_while_the_run_trains_and_after_a_kill_and_a_resume(project, save_gate):
    home, settings = project / "checkpoints" / configured().name, [*PEAK, *CPU, "trainer.max_steps=40"]
    settings += ["trainer.val_every_n_steps=20", "checkpoint.every_n_steps=10", "checkpoint.async_save=false"]
    gate = save_gate(match=path_of(home, 30).name)  # the run holds its home, held at its save of step 30
    run = start(project, *settings, env=gate.env)
    pid = gate.wait(run)
    files = on_disk(home)
    during = run_cli(project, *settings, "checkpoint=best", script="eval.py")
    assert during.returncode == 0, during.stderr
    assert on_disk(home) == files
    os.kill(pid, signal.SIGKILL)
    run.communicate()
    resumed = run_cli(project, *settings, "resume=last")
    assert resumed.returncode == 0, resumed.stderr

    after = run_cli(project, *settings, "checkpoint=best", script="eval.py")
    assert after.returncode == 0, after.stderr
    client = store(project)
    trained, judged = runs_of(client, home.name)
    logged = val_losses(client, trained.info.run_id)
    best = int((home / BEST).read_text().removeprefix("step_").removesuffix(".pt"))
    assert best < 30, "val/loss falls: its highest is at an early save"
    assert printed(after.stdout)["val/loss"] == printed(during.stdout)["val/loss"] == logged[best]
    assert len(judged) == 2 and {run.data.tags["mlflow.parentRunId"] for run in judged} == {trained.info.run_id}


def runs_of(client, name: str) -> tuple:
    """The training run of `name`, and the evaluations nested under it."""
    runs = runs_named(client, name)
    (trained,) = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    return trained, [run for run in runs if "mlflow.parentRunId" in run.data.tags]


def test_a_sharded_checkpoint_of_two_processes_is_judged_by_one_and_a_one_file_checkpoint_by_two(project):
    finished(torchrun(project, "name=big", "trainer.max_steps=10", strategy="fsdp"))
    alone = run_cli(project, *CPU, "name=big", "checkpoint=last", script="eval.py")
    assert alone.returncode == 0, alone.stderr
    assert run_cli(project, *CPU, "name=one", "trainer.max_steps=10").returncode == 0
    pair = finished(torchrun(project, "name=one", "checkpoint=last", script="eval.py"))
    client = store(project)
    for name, output in (("big", alone.stdout), ("one", pair)):
        trained, (judged,) = runs_of(client, name)
        assert judged.data.tags["mlflow.parentRunId"] == trained.info.run_id
        logged = val_losses(client, trained.info.run_id)[10]
        # Another number of processes adds the shares in another order: equal to rounding.
        assert printed(output)["val/loss"] == pytest.approx(logged, rel=1e-5)
        assert judged.data.metrics["val/loss"] == printed(output)["val/loss"]
        # The same samples right, counted over every process's share: one process's alone differ.
        right = val_losses(client, trained.info.run_id, "val/accuracy")[10]
        assert printed(output)["val/accuracy"] == pytest.approx(right, abs=1e-6)


def test_weights_of_other_shapes_are_refused_naming_the_models_setting(make_cfg, checkpoint_dir):
    recipe.train(make_cfg("mlflow.enabled=false", "trainer.max_steps=10"))
    other = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    with pytest.raises(RunError, match=r"give the overrides it was trained with \(its model: .*models.MLP\)"):
        load_weights(other, load(path_of(checkpoint_dir, 10)), [], shards=False, fine_tuning=False)


# --- a machine without the run's home: checkpoint.remote (docs/preemptible-machines.md) ------------


@pytest.fixture(params=["folder", "s3"])
def remote_url(request, tmp_path) -> str:
    """checkpoint.remote: a mounted folder's path, or a bucket's folder on conftest.py's S3 server."""
    return str(tmp_path / "mounted") if request.param == "folder" else request.getfixturevalue("bucket")[0]


def test_with_its_home_gone_the_runs_last_and_best_are_read_from_the_remote_as_they_were_logged(
    make_cfg, client, checkpoint_dir, tmp_path, remote_url
):
    remote = f"checkpoint.remote={remote_url}"
    # Its end waits until every checkpoint is remote, the best among them (the uploads go on in a
    # thread of this process, which the home's removal below would race on a busy machine).
    trained = recipe.train(make_cfg(*PEAK, remote, "checkpoint.remote_wait_s=600"))
    logged = val_losses(client, trained["run_id"])
    best = max(logged, key=logged.get)
    assert best < 30, "the best is an early checkpoint, not the newest"
    for which, step in (("last", 40), ("best", best)):
        shutil.rmtree(checkpoint_dir)
        judged = evaluate_checkpoint(make_cfg(*PEAK, remote), which, tmp_path / "eval")
        assert (judged["step"], judged["val/loss"]) == (step, logged[step])
        # Both, whichever was asked: a later read of this home by the other name reads the right one.
        assert sorted(number for number, _ in steps(checkpoint_dir)) == [best, 40]
        assert (checkpoint_dir / BEST).read_text() == path_of(checkpoint_dir, best).name


def damage(path) -> None:
    """A flipped bit in the middle of `path`, its size kept."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def test_a_damaged_remote_checkpoint_is_skipped_in_one_line_and_none_that_checks_is_refused_in_one(
    make_cfg, client, checkpoint_dir, tmp_path, caplog
):
    mounted = tmp_path / "mounted"
    settings = [*PEAK, "trainer.val_every_n_steps=10", f"checkpoint.remote={mounted}"]
    logged = val_losses(client, recipe.train(make_cfg(*settings))["run_id"])
    best = max(logged, key=logged.get)
    assert best < 30, "the best is an early checkpoint, not the newest"
    there = mounted / make_cfg().name
    assert sorted(path.name for path in there.glob("step_*")) == [path_of(there, step).name for step in (best, 30, 40)]
    for step in (40, best):
        damage(path_of(there, step))

    shutil.rmtree(checkpoint_dir)
    caplog.clear()
    judged = evaluate_checkpoint(make_cfg(*settings), "last", tmp_path / "eval")
    assert (judged["step"], judged["val/loss"]) == (30, logged[30])
    warned = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warned == [
        f"skipping {there / path_of(there, step).name}: {path_of(there, step).name} is damaged: its content no longer "
        f"matches the checksum written at save; {instead}"
        for step, instead in (
            (40, "falling back to an older one"),
            (best, f"`best` names a checkpoint {checkpoint_dir} does not hold"),
        )
    ]
    with pytest.raises(RunError, match=r"best names no checkpoint that is still there; pass another checkpoint"):
        evaluate_checkpoint(make_cfg(*settings), "best", tmp_path / "eval")

    # A best that is the damaged newest is not fetched twice, nor said twice.
    (there / BEST).write_text(path_of(there, 40).name)
    shutil.rmtree(checkpoint_dir)
    caplog.clear()
    assert evaluate_checkpoint(make_cfg(*settings), "last", tmp_path / "eval")["step"] == 30
    assert len([record for record in caplog.records if record.levelno == logging.WARNING]) == 1

    damage(path_of(there, 30))
    shutil.rmtree(checkpoint_dir)
    nothing = (
        rf"holds no checkpoint of {make_cfg().name}, nor checkpoint.remote={re.escape(str(mounted))} one that checks"
    )
    with pytest.raises(RunError, match=nothing):
        evaluate_checkpoint(make_cfg(*settings), "last", tmp_path / "eval")


def test_eval_py_on_a_machine_without_the_runs_home_reads_it_from_a_mounted_folder_by_name_or_as_last(project):
    home, remote = project / "checkpoints" / configured().name, f"checkpoint.remote={project / 'mounted'}"
    settings = ["trainer.max_steps=20", "trainer.val_every_n_steps=10", "checkpoint.every_n_steps=10"]
    trained = run_cli(project, *CPU, *settings, remote)
    assert trained.returncode == 0, trained.stderr
    client = store(project)
    (run,) = runs_named(client, configured().name)
    logged = val_losses(client, run.info.run_id)[20]
    for typed in (["checkpoint=last"], ["name=judge", f"checkpoint={home.name}"]):
        shutil.rmtree(home)
        judged = run_cli(project, *CPU, *typed, remote, script="eval.py")
        assert judged.returncode == 0, judged.stderr
        assert printed(judged.stdout)["val/loss"] == logged
        assert max(number for number, _ in steps(home)) == 20
    assert not (project / "checkpoints" / "judge").exists()
