"""A standby leg (`standby=true`): started while another leg trains, it imports at the lowest
priority, waits for that leg to end however it ends, then continues the run from its newest
checkpoint, its time counted from then; stopped while it waits, it has read and written nothing;
started where it cannot stand by, it says so in one line."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import configured, goodput_of, hold, run_cli, runs_named, start, wait_for_a_save
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine import priority
from {{cookiecutter.package}}.engine.checkpoint.home import GOODPUT as LEDGER
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.lifecycle import standby
from {{cookiecutter.package}}.engine.lifecycle.goodput import process_start

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

ENDLESS = ["device=cpu", "trainer.max_steps=1000000", "resume=auto"]


def said_until(process: subprocess.Popen, wanted: str) -> str:
    """The lines `process` prints up to the first that holds `wanted`; fails if it ends first."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if wanted in line:
            return "".join(lines)
    raise AssertionError(f"ended before saying {wanted!r}: {''.join(lines)}{process.communicate()}")


def snapshot(home: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(home.iterdir()) if path.is_file()}


def test_a_standby_takes_over_from_a_killed_leg_at_its_newest_checkpoint_and_counts_its_time_from_then(project):
    home = project / "checkpoints" / configured().name
    first = start(project, *ENDLESS, "checkpoint.every_n_steps=500")
    wait_for_a_save(home, first)  # it holds the home
    launched = time.time()
    second = start(project, *ENDLESS, "standby=true")
    said = said_until(second, "standing by")
    assert first.poll() is None  # so the standby waits for it

    killed = time.time()
    first.kill()
    first.communicate()
    newest = int((home / "latest").read_text().removeprefix("step_").removesuffix(".pt"))
    said += said_until(second, "resumed at step")
    second.send_signal(signal.SIGTERM)
    out, err = second.communicate(timeout=120)
    said += out + err
    assert second.returncode == 128 + signal.SIGTERM, said
    assert re.search(rf"took over {re.escape(str(home))} after standing by [\d.]+ s", said), said
    assert f"resumed at step {newest} on cpu" in said and "Traceback" not in said
    assert "standby False -> True" not in said  # how a leg starts is no setting of the run's

    before, after = json.loads((home / LEDGER).read_text())["legs"]
    for leg in (before, after):
        assert sum(leg["seconds"].values()) == pytest.approx(leg["ended"] - leg["started"], abs=0.01), leg
    # Its process started before the kill; its leg, when the killed one's lock was freed.
    assert launched < killed <= after["started"]
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = runs_named(client, configured().name)
    assert goodput_of(run)["legs"] == 2


@pytest.mark.parametrize("ended", ["stopped while it waits", "released after the run finished"])
def test_a_standby_that_never_trains_reads_and_writes_nothing(project, ended):
    name = configured().name
    home = project / "checkpoints" / name
    assert run_cli(project, "device=cpu", "trainer.max_steps=20").returncode == 0
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = runs_named(client, name)
    holder = hold(home)  # another process holds the home, as a leg that trains would
    kept = snapshot(home)
    second = start(project, "device=cpu", "resume=auto", "standby=true")
    said = said_until(second, "standing by")
    if ended == "stopped while it waits":
        second.send_signal(signal.SIGTERM)
        said += "".join(second.communicate(timeout=120))  # before the holder lets go
    holder.stdin.close()  # the lock freed: a standby still waiting takes over
    holder.wait()
    if ended != "stopped while it waits":
        said += "".join(second.communicate(timeout=120))
    if ended == "stopped while it waits":
        assert second.returncode == 128 + signal.SIGTERM, said
        assert "standby stopped by SIGTERM before it took over; nothing was read or written" in said
        assert f"took over {home}" not in said
    else:
        assert second.returncode == 0, said
        assert f"{name} finished at step 20 already: nothing to train" in said
    assert "Traceback" not in said
    assert {name: data for name, data in snapshot(home).items() if name != "run.lock"} == {
        name: data for name, data in kept.items() if name != "run.lock"
    }
    (after,) = runs_named(client, name)
    assert after.data.metrics == run.data.metrics and after.info.end_time == run.info.end_time


def test_a_standby_that_finds_the_home_free_goes_on_at_once_and_its_whole_start_up_is_the_runs(project):
    home = project / "checkpoints" / configured().name
    assert run_cli(project, "device=cpu", "trainer.max_steps=20").returncode == 0
    second = start(project, "device=cpu", "trainer.max_steps=40", "resume=auto", "standby=true")
    began = process_start(second.pid)
    said = "".join(second.communicate(timeout=120))
    assert second.returncode == 0, said
    assert f"no leg holds {home}: this one goes on at once" in said and "resumed at step 20" in said
    before, after = json.loads((home / LEDGER).read_text())["legs"]
    # From its interpreter's start, not from when it found the home free: its imports and its
    # warm-up are its start-up, as any leg's are (none was overlapped).
    assert began - 0.01 <= after["started"] < began + after["seconds"]["startup"], after


def test_a_standby_is_refused_in_one_line_where_it_cannot_stand_by(project, make_cfg, monkeypatch):
    name = configured().name
    refused = run_cli(project, "device=cpu", "standby=true")
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2, said
    assert (
        "error: standby=true continues the run whose leg it waits for, not a fresh run: "
        f"start it with name={name} resume=auto (or resume=last)"
    ) in said
    assert "Traceback" not in said and not (project / "checkpoints").exists()

    with pytest.raises(RunError, match=rf"not resume=.*step_00000010\.pt: start it with name={name} resume=auto"):
        standby.check(make_cfg("standby=true", "resume=checkpoints/demo/step_00000010.pt"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RunError, match=r"a torchrun job restarts its workers itself \(torchrun --max-restarts=N\)"):
        standby.check(make_cfg("standby=true", "resume=auto"))


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's SCHED_IDLE")
def test_work_at_the_lowest_priority_runs_on_a_thread_of_its_own_and_leaves_the_process_as_it_was():
    assert priority.lowest(lambda: os.sched_getscheduler(0)) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER

    def fails() -> None:
        raise ValueError("from the idle thread")

    with pytest.raises(ValueError, match="from the idle thread"):
        priority.lowest(fails)


def test_a_standby_warms_up_what_the_first_step_would_import_and_its_sender_at_the_lowest_priority():
    check = (
        "import sys; from {{cookiecutter.package}}.engine.lifecycle import standby; "
        "from {{cookiecutter.package}}.engine.tracking import tracker as tracking; tracking.start_sender(); "
        "ahead = tracking._started._child; assert 'torch' not in sys.modules; standby.warm_up(); "
        "print(ahead.returncode, tracking._started._child.args[-1], "
        "all(name in sys.modules for name in ('{{cookiecutter.package}}.engine.train', 'torch._dynamo')))"
    )
    # A bound on a hang only: its imports run at the lowest priority, which a busy machine starves.
    warmed = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=600)
    # The sender started ahead ended at once, in place of one that imports at the lowest priority.
    assert warmed.stdout.split() == [str(-signal.SIGKILL), "--idle", "True"], warmed.stderr
    assert warmed.stderr == ""  # nothing said of the sender that was never to be used


# --- with checkpoint.remote ------------------------------------------------------------------------


def test_a_standby_with_a_remote_takes_over_from_a_killed_leg_and_mirrors_what_it_trains(project, tmp_path):
    """The killed leg's claim on the mounted folder went with its process: the standby takes the
    run and its remote over, continues from the home (newer than the remote: nothing is fetched),
    and its stop's checkpoint is remote."""
    name = configured().name
    home, mounted = project / "checkpoints" / name, tmp_path / "mounted"
    first = start(project, *ENDLESS, "checkpoint.every_n_steps=500", f"checkpoint.remote={mounted}")
    wait_for_a_save(home, first)
    second = start(project, *ENDLESS, "standby=true", f"checkpoint.remote={mounted}")
    said = said_until(second, "standing by")
    assert first.poll() is None
    first.kill()
    first.communicate()
    newest = int((home / "latest").read_text().removeprefix("step_").removesuffix(".pt"))
    said += said_until(second, "resumed at step")
    committed = mounted / name / "committed"  # step_N.json, each written whole from a temporary beside it
    while not any(int(path.stem.removeprefix("step_")) > newest for path in committed.glob("step_*.json")):
        assert second.poll() is None, said + "".join(second.communicate())
        time.sleep(0.05)  # until the standby's own first save is remote
    second.send_signal(signal.SIGTERM)
    out, err = second.communicate(timeout=120)
    said += out + err
    assert second.returncode == 128 + signal.SIGTERM, said
    assert f"resumed at step {newest} on cpu" in said and "fetched" not in said and "Traceback" not in said
    stopped = int(re.search(r"stopped at step (\d+) by SIGTERM", said)[1])
    assert stopped > newest, said
    assert f"remote: step_{stopped:08d}.pt is in {mounted / name}" in said, said
    assert (mounted / name / "committed" / f"step_{stopped:08d}.json").is_file()


LOCKED = """
import fcntl, sys
with open(sys.argv[1], "r+b") as lock:
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("free")
    except OSError:
        print("held")
"""


def test_a_standby_that_fetches_from_the_remote_holds_its_home_until_it_ends(make_cfg, tmp_path, monkeypatch):
    """Its home older than the remote (another machine trained on), the standby fetches into the
    home it holds: the fetch's own claim of it must not free the lock, which is the process's."""
    from {{cookiecutter.package}}.engine import train as recipe

    here, there, mounted = tmp_path / "here", tmp_path / "there", tmp_path / "mounted"
    common = ["name=demo", "mlflow.enabled=false", "device=cpu", "checkpoint.every_n_steps=10"]
    common += [f"checkpoint.remote={mounted}"]
    recipe.train(make_cfg(*common, "trainer.max_steps=10", f"checkpoint.dir={here}"))
    recipe.train(make_cfg(*common, "trainer.max_steps=20", "resume=auto", f"checkpoint.dir={there}"))
    seen, resumed = [], recipe.resumed

    def seen_then_resumed(cfg, said):
        probe = subprocess.run([sys.executable, "-c", LOCKED, str(here / "run.lock")], capture_output=True, text=True)
        seen.append(probe.stdout.strip() or probe.stderr)
        return resumed(cfg, said)

    monkeypatch.setattr(recipe, "resumed", seen_then_resumed)
    standing = make_cfg(*common, "trainer.max_steps=30", "resume=auto", "standby=true", f"checkpoint.dir={here}")
    result = recipe.train(standing)
    assert seen == ["held"] and result["step"] == 30
    assert (here / "step_00000020.pt").is_file()  # fetched, and continued from
