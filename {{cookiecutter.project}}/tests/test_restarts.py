"""A job that came back by itself continues without a `resume=` (the SLURM tier, test_slurm.py,
shows the whole comeback on a real cluster); a job variable set by hand that cannot be used stops
the run at its start, in one line."""

import signal

import pytest

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.lifecycle.restarts import implied_resume, requeue

LAUNCHERS = ("torchrun and SLURM set it for each process they start; unset the variables set by hand, or start the "
             "job with torchrun or SLURM")  # fmt: skip


@pytest.mark.parametrize("variable", ["SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"])
def test_a_job_that_came_back_resumes_as_with_resume_auto_unless_resume_says_otherwise(monkeypatch, variable):
    for other in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(other, raising=False)
    assert implied_resume(None) is None
    monkeypatch.setenv(variable, "0")  # the first attempt
    assert implied_resume(None) is None
    monkeypatch.setenv(variable, "2")
    assert implied_resume(None) == "auto"
    assert implied_resume("last") == "last"


def test_outside_slurm_nothing_is_requeued(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert requeue(signal.SIGUSR2) is None


@pytest.mark.parametrize(
    ("variables", "overrides", "said"),
    [
        ({"SLURM_RESTART_COUNT": "abc"}, [], f"SLURM_RESTART_COUNT=abc is no whole number: {LAUNCHERS}"),
        ({"TORCHELASTIC_RESTART_COUNT": "1.5"}, [], f"TORCHELASTIC_RESTART_COUNT=1.5 is no whole number: {LAUNCHERS}"),
        # Else read by the requeue, only after the save that a SIGUSR1 asked for.
        ({"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}, [],
         "SLURM_ARRAY_TASK_ID=3 is set but SLURM_ARRAY_JOB_ID is not, and a requeue needs both: SLURM sets them "
         "together for a task of an array job; unset SLURM_ARRAY_TASK_ID, or set both"),
        ({"WORLD_SIZE": "two"}, [], f"WORLD_SIZE=two is no whole number: {LAUNCHERS}"),
        ({"WORLD_SIZE": "2"}, ["strategy=ddp"], f"RANK is unset while WORLD_SIZE is set: {LAUNCHERS}"),
    ],
)  # fmt: skip
def test_a_job_variable_that_cannot_be_used_is_one_line_and_exit_2_before_anything_is_written(
    make_cfg, checkpoint_dir, monkeypatch, capsys, variables, overrides, said
):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit:
        recipe.main(make_cfg(*overrides))
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {said}"]
    assert not checkpoint_dir.exists()
