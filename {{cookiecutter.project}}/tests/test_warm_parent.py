"""The warm parent (tests/warm_parent.py) forks the runs the other tests start: a forked run must be,
to the test, the new process `python run.py` would have been. Each check starts the same probe
twice, as a new interpreter and forked, and compares what each reports and how each ends."""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import warm_parent
from conftest import _warm_parent, kill_what_runs_still, start, started
from warm_parent import WarmPopen

pytestmark = pytest.mark.slow

# Named run.py, as the warm parent forks only the project's scripts. It reports what a process
# inherits from the one that started it, then ends as its stdin tells it to.
PROBE = """
import atexit, json, os, random, signal, sys, threading
import numpy, torch
import {{cookiecutter.package}}.engine.train

handlers = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGCHLD", "SIGUSR1")}
print(json.dumps({
    "pid": os.getpid(),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path0": sys.path[0],
    "main": __name__,
    "file": __file__,
    "spec": repr(__spec__),
    "loader": type(__loader__).__name__,
    "env": os.environ.get("PROBE_VALUE"),
    "threads": threading.active_count(),
    "torch_threads": [torch.get_num_threads(), torch.get_num_interop_threads()],
    "stdio": [[type(out.buffer).__name__, out.write_through, out.line_buffering, out.name] for out in (sys.stdout, sys.stderr)],
    "torch_seed": torch.initial_seed(),
    "torch_rand": torch.rand(4).tolist(),
    "random": random.random(),
    "numpy": float(numpy.random.random()),
    "handlers": {name: getattr(handler, "__name__", str(handler)) for name, handler in handlers.items()},
    "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "session": os.getsid(0) == os.getpid(),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
}), flush=True)
told = sys.stdin.readline().split()
print("told", *told, file=sys.stderr, flush=True)
if told[0] == "exit":
    sys.exit(int(told[1]))
if told[0] == "raise":
    raise RuntimeError("as a run that fails")
if told[0] == "leave":  # work left for the end: a thread that reads on, an atexit handler, unflushed output
    threading.Thread(target=lambda: sys.stdout.write("the thread read " + sys.stdin.readline())).start()
    atexit.register(print, "at exit")
    sys.stdout.write("unflushed\\n")  # a pipe's stdout is flushed as its buffer fills, or at the end
    if told[1:] == ["without-sys.stderr"]:  # the message then goes to the process's stderr itself
        sys.stderr = None
    sys.exit("a message")
signal.pause()
"""


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "run.py").write_text(PROBE)
    return tmp_path


def probed(probe, warm: bool, *argv: str, options: tuple[str, ...] = (), **popen) -> tuple[subprocess.Popen, dict]:
    command = [sys.executable, *options, "run.py", *argv]
    popen = {
        "cwd": probe,
        "stdin": subprocess.PIPE,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "text": True,
        **popen,
    }
    parent = _warm_parent()
    assert parent.can_start(command, popen.get("env"), popen)
    process = WarmPopen(parent, command, **popen) if warm else subprocess.Popen(command, **popen)
    return process, json.loads(process.stdout.readline())


# As a person starts a run, and as torchrun starts its workers: `python -u`, with OMP_NUM_THREADS=1
# (torchrun's default for many processes a machine) and its own variables.
AS_TORCHRUN = {"OMP_NUM_THREADS": "1", "TORCHELASTIC_RUN_ID": "probe", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


@pytest.mark.parametrize(("options", "variables"), [((), {}), (("-u",), AS_TORCHRUN)], ids=["run.py", "torchrun's"])
def test_a_forked_run_reports_what_a_new_interpreter_reports(probe, monkeypatch, options, variables):
    monkeypatch.setenv("PROBE_VALUE", "set by the test")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    reports = {}
    for warm in (False, True, True):
        process, report = probed(probe, warm, "a=1", "b=two", options=options)
        assert report.pop("pid") == process.pid
        process.communicate("exit 0\n")  # waits for its end: the probe exits when told
        reports.setdefault(warm, []).append(report)
    (cold,), (forked, again) = reports[False], reports[True]
    # Each new interpreter seeds its generators anew: two forks must not share a draw.
    drawn = ("random", "numpy", "torch_seed", "torch_rand")
    assert all(forked[key] != again[key] for key in drawn)
    for report in (cold, forked, again):
        for key in drawn:
            del report[key]
    assert forked == cold == again
    assert cold["argv"] == ["run.py", "a=1", "b=two"] and cold["env"] == "set by the test"
    assert cold["main"] == "__main__" and cold["path0"] == str(probe) and cold["threads"] == 1


def test_a_signal_the_starter_ignores_stays_ignored_in_a_fork_as_in_a_new_interpreter(probe):
    """A background job's SIGINT: the kernel hands an ignored signal on to a new process, and Python
    leaves SIGINT ignored then; a fork must too, not raise KeyboardInterrupt."""
    _warm_parent()  # started before: what the warm parent itself inherited is not what it hands on
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        handlers = []
        for warm in (False, True):
            process, report = probed(probe, warm)
            process.communicate("exit 0\n")  # waits for its end: the probe exits when told
            handlers.append(report["handlers"])
    finally:
        signal.signal(signal.SIGINT, before)
    assert handlers[0] == handlers[1] and handlers[0]["SIGINT"] == str(int(signal.SIG_IGN))


@pytest.mark.parametrize(
    "ending, returncode",
    [
        ("exit 3", 3),
        ("raise", 1),
        (signal.SIGTERM, -signal.SIGTERM),
        (signal.SIGKILL, -signal.SIGKILL),
        (signal.SIGINT, -signal.SIGINT),
    ],
    ids=["exit-3", "exception", "sigterm", "sigkill", "sigint"],
)
def test_a_forked_run_ends_as_a_new_interpreter_ends(probe, ending, returncode):
    if ending == signal.SIGINT and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        pytest.skip("this suite ignores SIGINT (a background job's), so a new interpreter would ignore it too")
    ended = {}
    for warm in (False, True):
        process, _ = probed(probe, warm)
        if isinstance(ending, str):
            process.stdin.write(ending + "\n")
            process.stdin.flush()
        else:
            process.stdin.write("pause\n")
            process.stdin.flush()
            assert process.stderr.readline().startswith("told")  # waiting in signal.pause() now
            process.send_signal(ending)
        stdout, stderr = process.communicate()  # waits for its end
        ended[warm] = (process.returncode, stderr.splitlines()[-1:])
    assert ended[True] == ended[False] and ended[True][0] == returncode


@pytest.mark.parametrize("told", ["leave", "leave without-sys.stderr"])
def test_what_a_run_leaves_for_its_end_happens_in_a_fork_as_in_a_new_interpreter(probe, told):
    """A thread still reading, an atexit handler, output not flushed and sys.exit's message: a fork
    ends without the interpreter's teardown (warm_parent.end_as_new), and none of them is lost."""
    ended = {}
    for warm in (False, True):
        process, _ = probed(probe, warm)
        stdout, stderr = process.communicate(f"{told}\nlast line\n")  # waits for its end
        # Sorted, as the thread's line comes before or after the main thread's.
        ended[warm] = (process.returncode, sorted(stdout.splitlines()), stderr.splitlines()[-1:])
    assert ended[True] == ended[False]
    assert ended[True] == (1, ["at exit", "the thread read last line", "unflushed"], ["a message"])


def test_an_ended_forked_run_is_found_by_its_pid_and_group_until_its_wait_as_a_new_interpreter(probe):
    """torchrun signals each worker's process group whose `poll()` says running: a worker that ends
    meanwhile must still be there to signal (a zombie), as a child of torchrun's own would be."""
    seen = {}
    for warm in (False, True):
        process, report = probed(probe, warm, start_new_session=True)
        pidfd = os.pidfd_open(process.pid)
        process.stdin.write("exit 0\n")
        process.stdin.flush()
        select.select([pidfd], [], [])  # readable once the run has ended
        os.close(pidfd)
        state = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        os.killpg(process.pid, signal.SIGTERM)  # raises if nothing is left to signal
        process.communicate()
        seen[warm] = (state, process.returncode, os.path.exists(f"/proc/{report['pid']}"))
    assert seen[True] == seen[False] == ("Z", 0, False)


def test_a_forked_run_in_a_session_of_its_own_leads_it(probe):
    process, report = probed(probe, True, start_new_session=True)
    process.communicate("exit 0\n")  # waits for its end: the probe exits when told
    assert report["session"] is True and process.returncode == 0


@pytest.mark.parametrize("warm", [False, True], ids=["new interpreter", "forked"])
def test_a_process_a_test_started_and_left_running_is_killed_as_the_test_ends(probe, warm):
    """conftest's no_process_outlives_its_test, for whatever conftest's `started` started."""
    popen = {"cwd": probe, "stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    process = started([sys.executable, "run.py"], cold=not warm, **popen)
    process.stdout.readline()  # its report: it runs, and waits for a line on its stdin
    kill_what_runs_still()  # as the fixture does once the test has ended
    assert process.returncode == -signal.SIGKILL


def test_a_request_that_a_fork_cannot_honour_starts_cold(probe):
    parent = _warm_parent()
    command = [sys.executable, "run.py"]
    assert parent.can_start(command, None, {"cwd": probe})
    # The interpreter reads these as it starts, before any fork could set them.
    assert not parent.can_start(command, {**parent.env, "PYTHONHASHSEED": "7"}, {"cwd": probe})
    assert not parent.can_start(command, {**parent.env, "OMP_PROC_BIND": "true"}, {"cwd": probe})
    nested = {**parent.env, "OMP_NUM_THREADS": "2,1"}  # OpenMP's nested levels: no count torch takes
    assert not parent.can_start(command, nested, {"cwd": probe})
    assert not parent.can_start(command, None, {"cwd": probe, "preexec_fn": print})
    assert not parent.can_start([sys.executable, "-c", "pass"], None, {})


def test_a_request_that_fails_before_it_is_sent_leaves_the_warm_parent_serving(probe):
    parent = _warm_parent()
    with pytest.raises(OSError):  # an fd that is not open cannot be passed on
        WarmPopen(parent, [sys.executable, "run.py"], cwd=probe, stdin=987654)
    process, report = probed(probe, True)
    process.communicate("exit 0\n")  # waits for its end: the probe exits when told
    assert report["pid"] == process.pid and process.returncode == 0


# A run that starts the MLflow sender as every tracked run does, and reports how it ended.
STARTS_THE_SENDER = """
import json, subprocess, sys
import {{cookiecutter.package}}.engine.train

command = [sys.executable, "-m", "{{cookiecutter.package}}.engine.tracking", *sys.argv[1:]]
sender = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
stdout, stderr = sender.communicate()
print(json.dumps({"forked": type(sender).__name__ == "WarmPopen", "ended": [sender.returncode, stdout, stderr]}))
"""


def test_a_forked_runs_sender_is_forked_too_and_ends_as_a_new_interpreters(tmp_path):
    (tmp_path / "run.py").write_text(STARTS_THE_SENDER)
    reports = {}
    for warm in (False, True):
        process = start(tmp_path, "no-such-command", cold=not warm)
        stdout, stderr = process.communicate()
        assert process.returncode == 0, stderr
        reports[warm] = json.loads(stdout)
    assert (reports[False]["forked"], reports[True]["forked"]) == (False, True)
    returncode, _, stderr = reports[True]["ended"]
    # argparse's usage names the module's file: `python -m` set sys.argv[0] to it.
    assert returncode == 2 and stderr.startswith("usage: __main__.py ")
    assert reports[True]["ended"] == reports[False]["ended"]
    # A test that trains in its own process starts its sender as a forked run does.
    command = [sys.executable, "-m", "{{cookiecutter.package}}.engine.tracking", "no-such-command"]
    sender = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert isinstance(sender, WarmPopen) and [sender.wait(), *sender.communicate()] == reports[True]["ended"]


@pytest.mark.parametrize("ending", ["exit 3", signal.SIGTERM], ids=["exit-3", "sigterm"])
def test_a_shells_client_ends_as_the_run_it_asked_for_ends(probe, ending):
    """`python tests/warm_parent.py --client SOCKET run.py` (a README's line, in the template's test)
    is to its shell the run: the run's streams, a signal to the client passed on, the run's end."""
    client = [sys.executable, warm_parent.__file__, "--client", _warm_parent().path, "run.py"]
    popen = {"cwd": probe, "stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    ended = {}
    for forked in (False, True):
        process = subprocess.Popen(client if forked else client[:1] + client[-1:], **popen)
        report = json.loads(process.stdout.readline())
        assert (report["pid"] != process.pid) == forked
        if isinstance(ending, str):
            process.stdin.write(ending + "\n")
        else:
            process.stdin.write("pause\n")
        process.stdin.flush()
        if not isinstance(ending, str):
            assert process.stderr.readline().startswith("told")  # waiting in signal.pause() now
            process.send_signal(ending)
        process.communicate(timeout=120)  # a run left behind would hold the pipes open
        ended[forked] = process.returncode
        assert not os.path.exists(f"/proc/{report['pid']}")  # the run itself ended, not only its client
    assert ended[True] == ended[False] == (3 if ending == "exit 3" else -signal.SIGTERM)
