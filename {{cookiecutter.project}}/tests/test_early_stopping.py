"""Early stopping on `optimized_metric` by `optimized_mode`, its patience kept in the checkpoint."""

import math
import os
import signal

import pytest
from conftest import losses

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine import validation as evaluation
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.monitor import Monitor

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# A validation every 5 steps; an improvement must be larger than any the demo makes, so the first
# validation sets the best and each after it waits: with patience 2 the run stops at step 15.
PATIENT = [
    "trainer.max_steps=40",
    "trainer.val_every_n_steps=5",
    "trainer.early_stopping.patience=2",
    "trainer.early_stopping.min_delta=100",
]


@pytest.mark.parametrize("judged_by", [[], ["optimized_metric=val/accuracy", "optimized_mode=max"]], ids=["min", "max"])
def test_a_run_stops_once_its_patience_is_spent_and_a_resume_with_it_trains_no_further(
    make_cfg, client, checkpoint_dir, judged_by
):
    stopped = recipe.train(make_cfg(*PATIENT, *judged_by))
    assert stopped["step"] == 15
    run = client.get_run(stopped["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["stopped_early"] == "15"
    assert sorted(losses(client, stopped["run_id"])) == list(range(1, 16))
    saved = newest_valid(checkpoint_dir).state
    assert saved["step"] == 15 and saved["monitor"]["waited"] == 2 and saved["monitor"]["best_step"] == 5

    again = recipe.train(make_cfg(*PATIENT, *judged_by, "resume=last"))
    assert again["step"] == 15 and "train/loss" not in again
    assert sorted(losses(client, stopped["run_id"])) == list(range(1, 16))

    more = recipe.train(make_cfg(*PATIENT, *judged_by, "resume=last", "trainer.early_stopping.patience=4"))
    assert more["step"] == 25, "two more validations of patience"


def test_a_stop_during_the_patience_resumes_to_the_step_the_unbroken_run_stopped_at(
    make_cfg, monkeypatch, sigterm_at, tmp_path
):
    unbroken = recipe.train(make_cfg(*PATIENT, f"checkpoint.dir={tmp_path / 'unbroken'}", "mlflow.enabled=false"))
    assert unbroken["step"] == 15
    sigterm_at(12)  # after the validation at step 10, the first that waited
    with pytest.raises(SystemExit):
        recipe.train(make_cfg(*PATIENT, "mlflow.enabled=false"))
    monkeypatch.undo()
    resumed = recipe.train(make_cfg(*PATIENT, "resume=last", "mlflow.enabled=false"))
    assert resumed["step"] == 15 and resumed["val/loss"] == unbroken["val/loss"]


def test_a_stop_during_a_validation_of_the_patience_resumes_to_the_step_the_unbroken_run_stopped_at(
    make_cfg, monkeypatch, tmp_path, checkpoint_dir
):
    """The validation a stop cut short is owed: the resumed run judges it first, and so stops early
    where the unbroken run did, not a validation later."""
    unbroken = recipe.train(make_cfg(*PATIENT, f"checkpoint.dir={tmp_path / 'unbroken'}", "mlflow.enabled=false"))
    real_evaluate = evaluation.evaluate

    def stopped_in_the_validation_at_10(run, loader, *args, **kwargs):
        if run.step == 10 and loader is run.val_loader:
            os.kill(os.getpid(), signal.SIGTERM)  # before its first batch: it is under way
        return real_evaluate(run, loader, *args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", stopped_in_the_validation_at_10)
    with pytest.raises(SystemExit):
        recipe.train(make_cfg(*PATIENT, "mlflow.enabled=false"))
    monitor = newest_valid(checkpoint_dir).state["monitor"]
    assert (monitor["waited"], monitor["owed"][0]) == (0, 10)
    monkeypatch.undo()
    resumed = recipe.train(make_cfg(*PATIENT, "resume=last", "mlflow.enabled=false"))
    assert resumed["step"] == unbroken["step"] == 15 and resumed["val/loss"] == unbroken["val/loss"]
    assert newest_valid(checkpoint_dir).state["monitor"]["waited"] == 2


@pytest.mark.parametrize(
    "mode, values, improved_at",
    [
        ("min", [3.0, 2.5, 2.45, math.nan, 2.0], [0, 1, 4]),
        ("max", [0.5, 0.7, 0.75, math.inf, 0.9], [0, 1, 4]),
    ],
)
def test_only_a_finite_value_better_by_more_than_min_delta_is_an_improvement(make_cfg, mode, values, improved_at):
    monitor = Monitor(make_cfg(f"optimized_mode={mode}", "trainer.early_stopping.min_delta=0.1"))
    improved = []
    for step, value in enumerate(values):
        monitor.validated(step, {"val/loss": value})
        monitor.observe()
        if monitor.waited == 0:
            improved.append(step)
    assert improved == improved_at and monitor.best == values[-1]


def test_a_resume_that_watches_another_metric_starts_its_patience_afresh(make_cfg):
    before = Monitor(make_cfg())
    for step in (5, 10):
        before.validated(step, {"val/loss": 1.0})
        before.observe()
    after = Monitor(make_cfg("optimized_metric=val/accuracy", "optimized_mode=max"))
    after.load_state_dict(before.state_dict())
    assert (after.best, after.waited) == (None, 0)
    same = Monitor(make_cfg())
    same.load_state_dict(before.state_dict())
    assert (same.best, same.best_step, same.waited) == (1.0, 5, 1)
