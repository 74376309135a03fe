"""Goodput: each leg of a run accounts for its wall time in buckets that add up to it, in the home's
goodput.json and, summed over the legs, in the run's `goodput/*` metrics; a leg stopped by SIGTERM
or killed without warning is counted by the next, which also counts the steps it trains again;
an account that is not one the run wrote, or holds what no leg of it can have written, is set aside
in one line, never followed through a link; the account stays small and is written at most once a
second; a leg counts from its Python interpreter's start (not a shell's before it), a sweep's job
in one process from its own."""

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import configured, goodput_of, run_cli, runs_named, start, wait_for_a_save
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine.checkpoint.home import GOODPUT as LEDGER
from {{cookiecutter.package}}.engine.lifecycle import goodput
from {{cookiecutter.package}}.engine.lifecycle.goodput import BUCKETS, KEPT_LEGS, WRITE_EVERY_S, Clock

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
    (run,) = runs_named(client, configured().name)
    return client, run


def test_a_sigterm_leg_and_the_next_each_add_up_and_the_metrics_continue_in_one_run(project):
    began = time.time()
    first = start(project, *ENDLESS)
    wait_for_a_save(project / "checkpoints" / configured().name, first)
    first.send_signal(signal.SIGTERM)
    said = "".join(first.communicate(timeout=120))
    ended = time.time()
    assert first.returncode == 128 + signal.SIGTERM, said
    assert (stop := re.search(r"stopped at step (\d+) by SIGTERM", said)), said
    stopped = int(stop[1])
    assert re.search(r"goodput \d\.\d\d over 1 leg \(", said), said

    home = project / "checkpoints" / configured().name
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
    home = project / "checkpoints" / configured().name
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


@pytest.mark.parametrize(
    "planted", ["a symbolic link", "damaged", "not an account this project wrote", "a leg that ends in the future"]
)
def test_an_account_the_run_did_not_write_is_set_aside_in_one_line_and_never_written_through(project, planted):
    short = ["device=cpu", "trainer.max_steps=20", "checkpoint.every_n_steps=10"]
    assert run_cli(project, *short).returncode == 0
    home, victim = project / "checkpoints" / configured().name, project / "victim.json"
    (theirs,) = legs(home)
    victim.write_text(json.dumps({"legs": [theirs, theirs]}))
    (home / LEDGER).unlink()
    if planted == "a symbolic link":
        (home / LEDGER).symlink_to(victim)
    elif planted == "damaged":
        (home / LEDGER).write_text('{"legs": [')
    elif planted == "not an account this project wrote":
        (home / LEDGER).write_text(json.dumps({"legs": [{**theirs, "started": -1.0}]}))
    else:  # finite, and absurd: believed, it made every later total inf or nan
        (home / LEDGER).write_text(json.dumps({"legs": [{**theirs, "ended": 1e308}, theirs]}))

    resumed = run_cli(project, "device=cpu", "resume=last", "trainer.max_steps=30")
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, said
    verb = "holds" if planted.startswith("a leg") else "is"
    assert f"{home / LEDGER} {verb} {planted}: goodput counts from this leg on" in said
    assert "Traceback" not in said and re.search(r"goodput \d\.\d\d over 1 leg \(\d+\.\d s\)", said), said
    assert all(map(math.isfinite, goodput_of(the_run(project)[1]).values()))
    assert victim.read_text() == json.dumps({"legs": [theirs, theirs]})  # nothing written through the link
    assert not (home / LEDGER).is_symlink()
    (leg,) = legs(home)
    check_adds_up(leg)


class Stopwatch:
    """goodput's clocks, moved by the test: its wall clock and its stopwatch advance together."""

    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def watch(monkeypatch) -> Stopwatch:
    moved = Stopwatch(time.time())
    monkeypatch.setattr(goodput, "time", moved)
    return moved


def plausible(count: int, ended: float, buckets=BUCKETS) -> list[dict]:
    """`count` legs of 2 s each (0.5 s start-up, the rest training), 1 s apart, the last ending at `ended`."""
    first = ended - 3.0 * count + 1.0
    return [
        {
            "started": first + 3.0 * index,
            "ended": first + 3.0 * index + 2.0,
            "step": 10 * (index + 1),
            "seconds": {bucket: {"startup": 0.5, "train": 1.5}.get(bucket, 0.0) for bucket in buckets},
        }
        for index in range(count)
    ]


def account(home: Path, legs: list[dict]) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    (home / LEDGER).write_text(json.dumps({"legs": legs}))
    return home


OVERFULL = dict.fromkeys(BUCKETS, 0.0) | {"train": 1e300}
ABSURD = {
    "holds a leg that ends in the future": {"ended": 1e308},
    "holds a leg that starts before any run of this project": {"started": 1.0},
    "holds a leg whose buckets add up to more than its wall time": {"seconds": OVERFULL},
    f"holds a leg at step {10**30}, past trainer.max_steps=300": {"step": 10**30},
    "holds more than 1000000 legs, more than any run restarts": {"legs": 10**30, "wall": 2.0, "between": 0.0},
    "holds legs summed into more time than they span": {"legs": 2, "wall": 1e300, "between": 0.0},
}


@pytest.mark.parametrize("said", ABSURD)
def test_an_account_holding_what_no_leg_of_the_run_can_have_written_is_set_aside_in_one_line(
    tmp_path, watch, caplog, said
):
    good, bad = plausible(2, watch.now - 10.0)
    home = account(tmp_path / "demo", [good, {**bad, **ABSURD[said]}])
    clock = Clock(watch.now)
    clock.keep(home, continuing=True, anchored=True, max_steps=300)
    assert [record.getMessage() for record in caplog.records] == [
        f"{home / LEDGER} {said}: goodput counts from this leg on"
    ]
    watch.now += 5.0
    clock.training(0)
    totals = clock.totals(0)
    assert totals["goodput/legs"] == 1 and totals["goodput/wall_s"] == pytest.approx(5.0)
    assert all(map(math.isfinite, totals.values()))
    clock.close(0)
    assert [leg["started"] for leg in legs(home)] == [clock.started]  # the count starts again


def test_a_huge_account_is_kept_small_with_the_same_totals_and_written_at_most_once_a_second(
    tmp_path, watch, monkeypatch
):
    earlier = plausible(20_000, watch.now - 30.0)
    home = account(tmp_path / "demo", earlier)
    writes, real_write = [], goodput.write_text

    def slow_write(path: Path, text: str) -> None:
        entered = watch.now
        real_write(path, text)
        watch.now += 3.0  # a disk that takes seconds to write whatever it is given
        writes.append((entered, watch.now, json.loads(text)["legs"]))

    monkeypatch.setattr(goodput, "write_text", slow_write)
    began = watch.now - 4.0
    clock = Clock(began)
    clock.keep(home, continuing=True, anchored=True, max_steps=10**6)
    clock.training(earlier[-1]["step"])
    for step in range(earlier[-1]["step"] + 1, earlier[-1]["step"] + 200):
        watch.now += 0.1
        clock.beat(step)

    assert len(writes) >= 5
    # Each write a second after the last one ended, at the earliest, however long that one took.
    assert all(later[0] - before[1] >= WRITE_EVERY_S for before, later in zip(writes, writes[1:], strict=False))
    assert all(len(written) <= KEPT_LEGS for _, _, written in writes)
    assert (home / LEDGER).stat().st_size < 50_000
    first, *kept, this = legs(home)
    assert kept == earlier[-len(kept) :] and first["legs"] == 20_000 - len(kept)
    # The totals, as if every leg had been kept one by one.
    totals = clock.totals(step)
    assert totals["goodput/legs"] == 20_001
    assert totals["goodput/wall_s"] == pytest.approx(2.0 * 20_000 + watch.now - began, rel=1e-12)
    assert totals["goodput/between_legs_s"] == pytest.approx(1.0 * 19_999 + began - earlier[-1]["ended"], rel=1e-12)
    assert totals["goodput/startup_s"] == pytest.approx(0.5 * 20_000 + 4.0, rel=1e-12)
    # Read again by the next leg, the summed account gives the same totals.
    after = Clock(watch.now)
    after.keep(home, continuing=True, anchored=True, max_steps=10**6)
    again = after.totals(step)
    assert again["goodput/legs"] == 20_002
    assert again["goodput/startup_s"] == pytest.approx(totals["goodput/startup_s"], rel=1e-12)


def test_time_in_callbacks_has_its_bucket_and_an_account_kept_before_it_existed_reads_it_as_0(tmp_path, watch):
    home = account(tmp_path / "demo", plausible(2, watch.now - 10.0, [b for b in BUCKETS if b != "hooks"]))
    clock = Clock(watch.now)
    clock.keep(home, continuing=True, anchored=True, max_steps=300)
    clock.training(20)
    with clock.during("hooks"):
        watch.now += 120.0
    watch.now += 10.0
    clock.close(30)
    this = legs(home)[-1]
    assert this["seconds"]["hooks"] == pytest.approx(120.0) and this["seconds"]["train"] == pytest.approx(10.0)
    totals = clock.totals(30)
    assert totals["goodput/legs"] == 3 and totals["goodput/hooks_s"] == pytest.approx(120.0)
    assert totals["goodput/fraction"] == pytest.approx((1.5 * 2 + 10.0) / (2.0 * 2 + 130.0))
    assert "callbacks 120.0 s" in clock.summary(), clock.summary()


def test_a_hook_within_a_save_takes_its_time_from_the_save_not_from_training(watch):
    clock = Clock(watch.now)
    clock.training(0)
    watch.now += 1.0
    with clock.during("save"):
        watch.now += 0.3
        with clock.during("hooks"):
            watch.now += 0.2
        watch.now += 0.1
    watch.now += 2.0
    clock.lap("train")
    assert clock.seconds["save"] == pytest.approx(0.4) and clock.seconds["hooks"] == pytest.approx(0.2)
    assert clock.seconds["train"] == pytest.approx(3.0)


def test_a_later_leg_in_one_process_counts_neither_the_earlier_ones_time_nor_their_compiling(watch, monkeypatch):
    monkeypatch.setattr(goodput, "_begun", False)
    monkeypatch.setattr(goodput, "_interpreter", watch.now - 7.0)
    assert goodput.leg_begins() == watch.now - 7.0  # the first: from the interpreter's start, its imports
    watch.now += 100.0  # the first job trains, and compiles 40 s of it
    monkeypatch.setattr(goodput, "compile_seconds", lambda: 40.0)
    began = goodput.leg_begins()
    assert began == watch.now
    clock = Clock(began)
    watch.now += 3.0
    clock.training(0)
    assert clock.seconds["startup"] == pytest.approx(3.0) and clock.seconds["compile"] == 0.0


def test_a_leg_behind_a_shell_counts_from_its_python_interpreters_start_not_the_shells(project):
    done = project / "shell-done"
    launched = time.time()
    # As the README's set-up line or a job script runs it: bash execs its last command, in its own process.
    shell = subprocess.run(
        ["bash", "-c", 'sleep 1 && touch shell-done && exec "$0" run.py "$@"', sys.executable, "device=cpu",
         "trainer.max_steps=20"],
        cwd=project, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert shell.returncode == 0, shell.stdout + shell.stderr
    (leg,) = legs(project / "checkpoints" / configured().name)
    check_adds_up(leg)
    shell_s = done.stat().st_mtime - launched
    assert shell_s >= 0.98  # the `sleep 1`, less a tick of the kernel's coarse clock that stamps mtimes
    # From the interpreter's start, less at most the few milliseconds of the shell's own CPU time.
    assert leg["started"] >= done.stat().st_mtime - 0.05, (leg, shell_s)
    assert leg["seconds"]["startup"] < leg["ended"] - done.stat().st_mtime


def test_each_job_of_a_sweep_in_one_process_counts_from_its_own_start(project):
    began = time.time()
    sweep = run_cli(project, "-m", "optimizer.lr=1e-3,2e-3,3e-3", "device=cpu", "trainer.max_steps=10", timeout=600)
    ended = time.time()
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    homes = sorted((project / "checkpoints" / configured().name).iterdir())
    jobs = sorted((legs(home)[0] for home in homes), key=lambda leg: leg["started"])
    assert len(jobs) == 3
    for leg in jobs:
        check_adds_up(leg)
    # Each job's leg begins after the one before it ended: the jobs tile the process's time, none twice.
    assert all(later["started"] >= before["ended"] for before, later in zip(jobs, jobs[1:], strict=False)), jobs
    assert sum(leg["ended"] - leg["started"] for leg in jobs) <= ended - began
