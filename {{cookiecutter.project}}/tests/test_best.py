"""The best checkpoint (`checkpoint.keep_best`): each save ranked by `optimized_metric` at its step,
`best` naming the best by `optimized_mode`, kept by retention through resumes and kill -9."""

import errno
import json
import logging
import os
import signal

import pytest
from conftest import losses, start

from {{cookiecutter.package}} import train as recipe
from {{cookiecutter.package}}.checkpoint import home, onefile
from {{cookiecutter.package}}.checkpoint.home import BEST, SCORES, path_of, steps
from {{cookiecutter.package}}.checkpoint.resume import load
from {{cookiecutter.package}}.errors import RunError

QUIET = "mlflow.enabled=false"

# Saves at 10, 20, 30 and 40; scheduled validations at 20 and 40 only, so 10 and 30 validate for
# their checkpoint. Judged by the highest val/loss, the best is an early checkpoint, one that
# retention of the newest 2 would delete.
WORST_IS_BEST = ["optimized_mode=max", "checkpoint.keep_last=2"]


def val_losses(client, run_id: str) -> dict[int, float]:
    return {step: value for step, (value,) in losses(client, run_id, "val/loss").items()}


def saved_steps(home) -> list[int]:
    return sorted(step for step, _ in steps(home))


def test_each_save_is_ranked_by_its_own_validation_and_retention_keeps_the_best(make_cfg, client, checkpoint_dir):
    result = recipe.train(make_cfg(*WORST_IS_BEST))
    logged = val_losses(client, result["run_id"])
    assert sorted(logged) == [10, 20, 30, 40], "a save point with no scheduled validation validates"
    best = max(logged, key=logged.get)
    assert best < 30, "the demo's val/loss falls: its highest is at an early save"
    assert (checkpoint_dir / BEST).read_text() == path_of(checkpoint_dir, best).name
    assert saved_steps(checkpoint_dir) == sorted({best, 30, 40})
    for step in saved_steps(checkpoint_dir):
        score = load(path_of(checkpoint_dir, step)).state["score"]
        assert score == {"metric": "val/loss", "mode": "max", "value": logged[step]}
    ranked = json.loads((checkpoint_dir / SCORES).read_text())
    assert ranked["scores"] == {
        path_of(checkpoint_dir, step).name: logged[step] for step in saved_steps(checkpoint_dir)
    }


def test_a_resume_from_an_earlier_step_ranks_what_is_left(make_cfg, client, checkpoint_dir):
    first = recipe.train(make_cfg("checkpoint.keep_last=5"))
    logged = val_losses(client, first["run_id"])
    assert (checkpoint_dir / BEST).read_text() == path_of(checkpoint_dir, min(logged, key=logged.get)).name
    recipe.train(make_cfg(f"resume={path_of(checkpoint_dir, 20)}", "trainer.max_steps=20"))
    assert saved_steps(checkpoint_dir) == [10, 20]  # 30 and 40 are set aside
    left = {step: logged[step] for step in (10, 20)}
    assert (checkpoint_dir / BEST).read_text() == path_of(checkpoint_dir, min(left, key=left.get)).name


def test_a_fine_tune_and_a_resume_can_start_from_best(make_cfg, client, checkpoint_dir, tmp_path):
    source = recipe.train(make_cfg(*WORST_IS_BEST))
    logged = val_losses(client, source["run_id"])
    best = max(logged, key=logged.get)
    tuned = recipe.train(
        make_cfg("name=from-best", f"checkpoint.dir={tmp_path / 'tuned'}", f"init.checkpoint={checkpoint_dir / BEST}")
    )
    assert client.get_run(tuned["run_id"]).data.tags["init.source_step"] == str(best)
    resumed = recipe.train(make_cfg(*WORST_IS_BEST, f"resume={checkpoint_dir / BEST}", f"trainer.max_steps={best}"))
    assert resumed["step"] == best


def test_keep_best_false_ranks_nothing_and_validates_only_on_schedule(make_cfg, client, checkpoint_dir):
    result = recipe.train(make_cfg("checkpoint.keep_best=false"))
    assert sorted(val_losses(client, result["run_id"])) == [20, 40]
    assert not (checkpoint_dir / BEST).exists() and not (checkpoint_dir / SCORES).exists()
    assert load(path_of(checkpoint_dir, 40)).state["score"] is None


def test_a_checkpoint_killed_before_its_ranking_is_ranked_by_the_resume_and_kept(project, save_gate):
    home = project / "checkpoints" / "demo"
    settings = [*WORST_IS_BEST, "device=cpu", "trainer.max_steps=40", "trainer.val_every_n_steps=20"]
    settings += ["checkpoint.every_n_steps=10", "checkpoint.async_save=false"]
    gate = save_gate(match=path_of(home, 10).name)  # killed with step 10, the best, renamed into place, not ranked
    run = start(project, *settings, env=gate.env)
    os.kill(gate.wait(run), signal.SIGKILL)
    run.communicate()
    assert not (home / BEST).exists()
    resumed = start(project, *settings, "resume=last")
    _, stderr = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, stderr
    scores = json.loads((home / SCORES).read_text())["scores"]
    assert (home / BEST).read_text() == max(scores, key=scores.get) == path_of(home, 10).name
    assert saved_steps(home) == [10, 30, 40]


def test_a_save_that_cannot_be_ranked_warns_and_prunes_nothing(make_cfg, checkpoint_dir, monkeypatch, caplog):
    real_rank, calls = home.rank, []

    def full_disk_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the save of step 30, which would prune step 10
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_rank(*args, **kwargs)

    monkeypatch.setattr(home, "rank", full_disk_once)
    with caplog.at_level(logging.WARNING):
        recipe.train(make_cfg(QUIET, *WORST_IS_BEST, "trainer.max_steps=30"))
    assert (
        "step_00000030.pt is saved but not ranked (No space left on device); nothing is pruned for now" in caplog.text
    )
    assert saved_steps(checkpoint_dir) == [10, 20, 30]


def test_a_checkpoint_from_before_the_ranking_resumes(make_cfg, checkpoint_dir):
    recipe.train(make_cfg(QUIET, "trainer.max_steps=10"))
    older = load(path_of(checkpoint_dir, 10)).state
    del older["monitor"], older["score"]
    onefile.write(older, path_of(checkpoint_dir, 10))
    resumed = recipe.train(make_cfg(QUIET, "trainer.max_steps=20", "resume=last"))
    assert resumed["step"] == 20 and resumed["continuity"] == "ok"


def test_best_naming_a_checkpoint_that_is_gone_is_one_line(make_cfg, checkpoint_dir):
    recipe.train(make_cfg(QUIET, *WORST_IS_BEST))
    path_of(checkpoint_dir, int((checkpoint_dir / BEST).read_text()[5:13])).unlink()
    with pytest.raises(RunError, match=r"best names no checkpoint that is still there; pass another checkpoint$"):
        recipe.train(make_cfg(QUIET, f"resume={checkpoint_dir / BEST}"))
