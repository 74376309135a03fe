"""A job that came back by itself continues without a `resume=` (the SLURM tier, test_slurm.py,
shows the whole comeback on a real cluster)."""

import signal

import pytest

from {{cookiecutter.package}}.restarts import implied_resume, requeue


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
