"""The best checkpoint (`checkpoint.keep_best`): each save ranked by `optimized_metric` at its step,
`best` naming the best by `optimized_mode`, kept by retention through resumes and kill -9."""

import errno
import json
import logging
import os
import signal

import pytest
from conftest import configured, losses, start

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import home, onefile
from {{cookiecutter.package}}.engine.checkpoint.home import BEST, SCORES, path_of, steps
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.errors import CheckpointError, RunError

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

QUIET = "mlflow.enabled=false"

# Saves at 10, 20, 30 and 40; scheduled validations at 20 and 40 only, so 10 and 30 validate for
# their checkpoint. Judged by the highest val/loss, the best is an early checkpoint, one that
# retention of the newest 2 would delete.
WORST_IS_BEST = ["optimized_mode=max", "checkpoint.keep_last=2"]
# Saves and validations at 10, 20, 30 and 40, and the newest checkpoint kept besides the best: the
# best (highest val/loss) is step 10, which only a ranking keeps.
ONLY_THE_RANKING_KEEPS = ["optimized_mode=max", "checkpoint.keep_last=1", "trainer.val_every_n_steps=10"]
HUGE = 10**400  # an integer past a float's range: OverflowError where it meets one

UNTRUSTED = {
    "is damaged": lambda ledger: ledger.write_text("{"),
    "is missing": lambda ledger: ledger.unlink(),
    "holds a score that is no metric's value": lambda ledger: ledger.write_text(
        json.dumps({"metric": "val/loss", "mode": "max", "scores": {"step_00000010.pt": HUGE}})
    ),
}


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
    home = project / "checkpoints" / configured().name
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


def ranked_best(home) -> tuple[str, bytes]:
    """The checkpoint `best` names, and its bytes."""
    name = (home / BEST).read_text()
    return name, (home / name).read_bytes()


@pytest.mark.parametrize("problem", UNTRUSTED)
def test_a_ranking_that_cannot_be_read_is_rebuilt_from_the_checkpoints_and_the_best_stays(
    make_cfg, checkpoint_dir, caplog, problem
):
    recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS))
    best = ranked_best(checkpoint_dir)
    assert best[0] == path_of(checkpoint_dir, 10).name
    UNTRUSTED[problem](checkpoint_dir / SCORES)
    with caplog.at_level(logging.WARNING):
        recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS, "trainer.max_steps=60", "resume=last"))
    assert ranked_best(checkpoint_dir) == best, "byte for byte"
    assert saved_steps(checkpoint_dir) == [10, 60]
    assert (
        f"{checkpoint_dir / SCORES} {problem}: the checkpoints are ranked again by the scores they hold" in caplog.text
    )


def test_a_resume_that_changes_optimized_metric_keeps_the_best_of_the_ranking_before(make_cfg, checkpoint_dir, caplog):
    recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS))
    best = ranked_best(checkpoint_dir)
    with caplog.at_level(logging.WARNING):
        recipe.train(
            make_cfg(
                QUIET, *ONLY_THE_RANKING_KEEPS, "optimized_metric=val/accuracy", "trainer.max_steps=60", "resume=last"
            )
        )
    assert (
        f"{best[0]}, the best by val/loss (max), is kept apart from this run's ranking by val/accuracy (max): delete it "
        f"yourself once done with it, or resume with optimized_metric=val/loss optimized_mode=max to rank by it again"
    ) in caplog.text
    assert (checkpoint_dir / best[0]).read_bytes() == best[1]
    assert best[0] in json.loads((checkpoint_dir / SCORES).read_text())["held"]
    recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS, "trainer.max_steps=70", "resume=last"))
    assert ranked_best(checkpoint_dir) == best  # ranked by val/loss again, and still its best


def test_a_fifo_as_the_ranking_is_refused_in_one_line_and_replaced(make_cfg, project):
    home = project / "checkpoints" / configured().name
    recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS, f"checkpoint.dir={home}"))
    best = ranked_best(home)
    (home / SCORES).unlink()
    os.mkfifo(home / SCORES)
    resumed = start(project, *ONLY_THE_RANKING_KEEPS, "device=cpu", "trainer.max_steps=50", "resume=last")
    output = "".join(resumed.communicate(timeout=120))  # a read of the FIFO would wait here, holding the lock
    assert resumed.returncode == 0, output
    assert f"{home / SCORES} is a FIFO: the checkpoints are ranked again by the scores they hold" in output
    assert "Traceback" not in output
    assert ranked_best(home) == best and json.loads((home / SCORES).read_text())["scores"][best[0]]


def test_a_huge_integer_where_a_checkpoint_holds_a_score_is_refused_in_one_line(make_cfg, checkpoint_dir, caplog):
    recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS, "trainer.max_steps=10"))
    state = load(path_of(checkpoint_dir, 10)).state
    state["score"]["value"] = HUGE
    onefile.write(state, path_of(checkpoint_dir, 10))
    with caplog.at_level(logging.WARNING):
        recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS, "trainer.max_steps=20", "resume=last"))
    assert "step_00000010.pt holds a score that is no metric's value; it is not ranked" in caplog.text
    state = load(path_of(checkpoint_dir, 20)).state
    state["monitor"]["best"] = HUGE
    onefile.write(state, path_of(checkpoint_dir, 20))
    with pytest.raises(CheckpointError) as error:
        recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS, "trainer.max_steps=30", "resume=last"))
    assert str(error.value) == (
        "the checkpoint's monitor does not load (its best value is not a finite number a float can hold); "
        "resume from another checkpoint, or start a new run with name=<new name>"
    )


def test_best_linked_to_a_binary_file_names_no_checkpoint_in_one_line(make_cfg, tmp_path):
    binary = tmp_path / "program"
    binary.write_bytes(bytes(range(256)) * 16)  # no UTF-8 text
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / BEST).symlink_to(binary)
    with pytest.raises(RunError) as error:
        recipe.train(make_cfg(QUIET, f"init.checkpoint={tmp_path / 'other' / BEST}"))
    assert (
        str(error.value)
        == f"{tmp_path / 'other' / BEST} names no checkpoint that is still there; pass another checkpoint"
    )


# Another run's ranking where this run's ought to be: by a link (`ln -s`, `ln`) or a copy (`cp`).
ANOTHER_RUNS = {
    "a symbolic link": lambda theirs, ours: ours.symlink_to(theirs),
    "a hard link": lambda theirs, ours: os.link(theirs, ours),
    "a copy": lambda theirs, ours: ours.write_bytes(theirs.read_bytes()),
}


@pytest.mark.parametrize("put", ANOTHER_RUNS)
def test_another_runs_ranking_in_the_home_never_costs_the_true_best(make_cfg, checkpoint_dir, tmp_path, caplog, put):
    recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS))
    best = ranked_best(checkpoint_dir)
    assert best[0] == path_of(checkpoint_dir, 10).name and saved_steps(checkpoint_dir) == [10, 40]
    other = tmp_path / "other"  # ranked the other way, and so naming its step 40 only
    recipe.train(make_cfg(QUIET, "name=other", f"checkpoint.dir={other}", "checkpoint.keep_last=1"))
    theirs = (other / SCORES).read_bytes()
    assert list(json.loads(theirs)["scores"]) == [path_of(other, 40).name]
    (checkpoint_dir / SCORES).unlink()
    ANOTHER_RUNS[put](other / SCORES, checkpoint_dir / SCORES)
    with caplog.at_level(logging.WARNING):
        recipe.train(make_cfg(QUIET, *ONLY_THE_RANKING_KEEPS, "trainer.max_steps=60", "resume=last"))
    assert saved_steps(checkpoint_dir) == [10, 60]
    assert ranked_best(checkpoint_dir) == best, "byte for byte"
    ranked = json.loads((checkpoint_dir / SCORES).read_text())["scores"]
    assert ranked.keys() == {best[0], path_of(checkpoint_dir, 60).name}
    assert (other / SCORES).read_bytes() == theirs, "the other run's ranking is read, never written"
    rebuilt = f"{checkpoint_dir / SCORES} is {put}: the checkpoints are ranked again by the scores they hold"
    assert (rebuilt in caplog.text) == (put != "a copy")  # a copy reads as a ranking, one that misses the best
