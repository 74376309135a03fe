"""Goodput: each leg of a run accounts for its wall time in buckets that add up to it, in the home's
goodput.json and, summed over the legs, in the run's `goodput/*` metrics; a leg stopped by SIGTERM
or killed without warning is counted by the next, which also counts the steps it trains again;
an account that is not one the run wrote is set aside in one line, never followed through a link."""

import json
import re
import signal
import time
from pathlib import Path

import pytest
from conftest import goodput_of, run_cli, runs_named, start, wait_for_a_save
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine.goodput import BUCKETS, LEDGER

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

ENDLESS = ["device=cpu", "trainer.max_steps=1000000", "trainer.log_every_n_steps=10"]


def legs(home: Path) -> list[dict]:
    return json.loads((home / LEDGER).read_text())["legs"]


def check_adds_up(leg: dict) -> None:
    """A leg's buckets tile its time: they add up to the wall clock's reading of it."""
    assert sum(leg["seconds"].values()) == pytest.approx(leg["ended"] - leg["started"], abs=0.01), leg
    assert set(leg["seconds"]) == set(BUCKETS) and min(leg["seconds"].values()) >= 0, leg


def the_run(project: Path):
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = runs_named(client, "demo")
    return client, run


def test_a_sigterm_leg_and_the_next_each_add_up_and_the_metrics_continue_in_one_run(project):
    began = time.time()
    first = start(project, *ENDLESS)
    wait_for_a_save(project / "checkpoints" / "demo", first)
    first.send_signal(signal.SIGTERM)
    said = "".join(first.communicate(timeout=120))
    ended = time.time()
    assert first.returncode == 128 + signal.SIGTERM, said
    assert (stop := re.search(r"stopped at step (\d+) by SIGTERM", said)), said
    stopped = int(stop[1])
    assert re.search(r"goodput \d\.\d\d over 1 leg \(", said), said

    home = project / "checkpoints" / "demo"
    (leg,) = legs(home)
    check_adds_up(leg)
    # The process's own life, from its start (which Linux gives to 10 ms, and the uptime it is read against too).
    assert began - 0.03 <= leg["started"] and leg["ended"] <= ended
    assert leg["step"] == stopped and leg["seconds"]["startup"] > 0 and leg["seconds"]["save"] > 0

    second = run_cli(project, "device=cpu", "resume=last", f"trainer.max_steps={stopped + 20}")
    said = second.stdout + second.stderr
    assert second.returncode == 0, said
    assert re.search(r"goodput \d\.\d\d over 2 legs \(.*; the [\d.]+ s between legs is not the run's", said), said
    before, after = legs(home)
    assert before == leg  # the first leg's account, kept as it was
    check_adds_up(after)
    assert after["started"] >= before["ended"] and after["seconds"]["restore"] > 0
    assert after["seconds"]["retrained"] == 0  # a SIGTERM saved the step it stopped at

    client, run = the_run(project)  # one MLflow run: each leg logged the sums so far, at its last step
    found = goodput_of(run)
    assert found["legs"] == 2
    # Logged as the leg hands MLflow its last metrics, before the rest of its end that goodput.json holds.
    walls = [leg["ended"] - leg["started"] for leg in (before, after)]
    assert walls[0] < found["wall_s"] <= sum(walls)
    assert found["between_legs_s"] == pytest.approx(after["started"] - before["ended"])
    history = {metric.step: metric.value for metric in client.get_metric_history(run.info.run_id, "goodput/legs")}
    assert history == {stopped: 1, stopped + 20: 2}


def test_a_leg_killed_without_warning_is_counted_and_the_steps_it_loses_are_trained_again(project):
    home = project / "checkpoints" / "demo"
    first = start(project, *ENDLESS, "checkpoint.every_n_steps=1000")
    wait_for_a_save(home, first)
    saved = int((home / "latest").read_text().removeprefix("step_").removesuffix(".pt"))
    # Killed once its account shows steps past its newest checkpoint: those are lost.
    while not (home / LEDGER).exists() or legs(home)[-1]["step"] < saved + 100:
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    first.kill()
    first.communicate()
    (killed,) = legs(home)
    check_adds_up(killed)
    reached = killed["step"]
    assert int((home / "latest").read_text().removeprefix("step_").removesuffix(".pt")) < reached

    second = run_cli(project, "device=cpu", "resume=last", f"trainer.max_steps={reached + 50}")
    said = second.stdout + second.stderr
    assert second.returncode == 0, said
    assert re.search(r"goodput \d\.\d\d over 2 legs \(.*steps trained again [\d.]+ s", said), said
    before, after = legs(home)
    assert before == killed
    check_adds_up(after)
    assert after["seconds"]["retrained"] > 0 and after["seconds"]["train"] > 0
    found = goodput_of(the_run(project)[1])
    assert found["legs"] == 2 and found["retrained_s"] == pytest.approx(after["seconds"]["retrained"])


@pytest.mark.parametrize("planted", ["a symbolic link", "damaged", "not an account this project wrote"])
def test_an_account_the_run_did_not_write_is_set_aside_in_one_line_and_never_written_through(project, planted):
    short = ["device=cpu", "trainer.max_steps=20", "checkpoint.every_n_steps=10"]
    assert run_cli(project, *short).returncode == 0
    home, victim = project / "checkpoints" / "demo", project / "victim.json"
    (theirs,) = legs(home)
    victim.write_text(json.dumps({"legs": [theirs, theirs]}))
    (home / LEDGER).unlink()
    if planted == "a symbolic link":
        (home / LEDGER).symlink_to(victim)
    elif planted == "damaged":
        (home / LEDGER).write_text('{"legs": [')
    else:
        (home / LEDGER).write_text(json.dumps({"legs": [{**theirs, "started": -1.0}]}))

    resumed = run_cli(project, "device=cpu", "resume=last", "trainer.max_steps=30")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"{home / LEDGER} is {planted}: goodput counts from this leg on" in resumed.stdout + resumed.stderr
    assert "Traceback" not in resumed.stdout + resumed.stderr
    assert victim.read_text() == json.dumps({"legs": [theirs, theirs]})  # nothing written through the link
    assert not (home / LEDGER).is_symlink()
    (leg,) = legs(home)
    check_adds_up(leg)
