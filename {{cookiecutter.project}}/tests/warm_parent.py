"""A warm parent for the `python run.py ...` a test starts: one process per pytest worker that has
imported what a run imports (torch, Hydra, the engine: seconds on two cores), and forks a child for
each run, so that start-up is paid once per worker instead of once per run. (It imports what the
MLflow sender imports first, and the rest as the first request for anything else comes: a worker
that forks only senders pays for no more.)

A forked run is a new process to the test: it is `WarmPopen`, a `subprocess.Popen` whose pid is the
run's own (signals, `pgrep -P`, pidfds and claims see the run), whose pipes are the ones the test
asked for, and whose exit status is the run's wait status (the warm parent passes the status on and
reaps the run once the test has it: until then an ended run is a zombie, as a child of the test's own
would be). The child starts as a new interpreter would: the argv, working directory, environment
and standard streams of the request, `sys.path[0]` the script's folder, the signal handlers and
RNG states of a fresh interpreter, no thread, socket or file of the warm parent's; it ends as an
interpreter ends, less the teardown of its modules (`end_as_new` says why).

What a forked process starts that the warm parent can start is forked by the warm parent too
(`fork_from`): the MLflow sender (`python -m <package>.engine.tracking drain`) that a run, or a test
that runs the recipe in its own process, starts; torchrun's workers (`python -u run.py ...`, with
the variables torchrun sets) where torchrun itself (`python -m torch.distributed.run`) is forked.
Such a child's parent is the warm parent, not its requester, and its /proc cmdline and environ are
the warm parent's: `WarmParent.started_by` finds a requester's forked children with their
environment, and `WarmParent.command` each one's command line (conftest's `started_by`, `environ`
and `command` look there and in /proc).

What a fork cannot give, a request that differs there is started cold (`can_start` says which): an
environment variable that an interpreter or a library reads as it starts or is imported (PYTHON*,
OMP_*, LD_*, ...), less the exceptions a child sets up as a new interpreter would: a folder put
first on PYTHONPATH whose sitecustomize.py the child imports as `site` would (tests/gates/), `-u`
(unbuffered standard streams) and OMP_NUM_THREADS (torch's threads), which torchrun gives its
workers. Python's hash seed is the warm parent's in every child. Tests about start-up itself start a
cold interpreter (plain `subprocess`).

    python tests/warm_parent.py SOCKET READY   # READY: a pipe's fd, told "ready" once it serves
    python tests/warm_parent.py --client SOCKET run.py ...   # as `python run.py ...`, for a shell
"""

import contextlib
import ctypes
import functools
import importlib.util
import inspect
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

# The variables read as an interpreter starts or a library is imported: a child whose request
# differs in one would not be the process it asks for.
AT_START = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "LANG", "LC_", "TZ")
# Read as a run goes, not as it starts: torchrun's variables for its workers, OMP_NUM_THREADS,
# which a child gives torch as torch would have read it, and Inductor's cache folder, which Inductor
# reads each time it looks for a graph.
AT_RUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")
SCRIPTS = ("run.py", "eval.py", "export.py")
SENDER = "{{cookiecutter.package}}.engine.tracking"  # run as `python -m` by a tracked run
COMPARE = "{{cookiecutter.package}}.engine.compare"  # a person's `python -m`, as the docs give it
MODULES = (SENDER, "torch.distributed.run", COMPARE)
# Popen's arguments that a request carries; any other one set means a cold start.
CARRIED = {"stdin", "stdout", "stderr", "text", "encoding", "errors", "universal_newlines", "bufsize", "cwd", "env"}
CARRIED |= {"start_new_session"}
MESSAGE = 1 << 20  # a request's most bytes: its argv and environment
# What a sender imports, with what it imports as it opens the sqlite store (SQLAlchemy, Alembic's
# schema check: a second): imported first, and alone while only senders are asked for (the daily
# tier's tests train in their own process), half of what a run imports besides (torch, its compiler).
SENDER_IMPORTS = ("{{cookiecutter.package}}.engine.tracking.sender", "mlflow.store.tracking.sqlalchemy_store")
SENDER_IMPORTS += ("mlflow.store.tracking.sqlalchemy_workspace_store", "mlflow.store.model_registry.sqlalchemy_store")
SENDER_IMPORTS += ("alembic.config", "sqlalchemy.dialects.sqlite")
# What the rest import: once, as the first request for anything but a sender comes.
IMPORTS = ("{{cookiecutter.package}}.engine.train", "{{cookiecutter.package}}.engine.evaluating")
IMPORTS += ("{{cookiecutter.package}}.engine.exporting", "torch._dynamo", "torch.distributed.run", COMPARE)


class WarmParent:
    """The warm parent of this pytest worker, started by `start()` and stopped by `stop()`."""

    def __init__(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="warm-")  # a socket's path is short: not pytest's tmp_path
        self.path = os.path.join(self._folder, "warm.sock")
        self.env = dict(os.environ)
        self.imports_set: dict[str, str] = {}  # what the warm parent's imports set, as a run of its has it
        ready, told_ready = os.pipe()
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.path, str(told_ready)],
            stdin=subprocess.DEVNULL, pass_fds=[told_ready], preexec_fn=_die_with_parent,
        )  # fmt: skip
        os.close(told_ready)
        with os.fdopen(ready) as said:  # the line it writes once its imports are done, or nothing
            told = said.read()
        if told != "ready\n":
            self.process.wait()
            raise RuntimeError(f"the warm parent did not start (exit {self.process.returncode})")

    def can_start(self, command: list[str], env: dict[str, str] | None, popen: dict) -> bool:
        """Whether a fork of this parent is the process `command` would start."""
        if _started(command) is None or not set(popen) <= CARRIED or not self.serves():
            return False
        env = os.environ if env is None else env
        at_start = {key for key in {*env, *self.env} if key.startswith(AT_START) and not key.startswith(AT_RUN)}
        same = all(env.get(key) in (self.env.get(key), self.imports_set.get(key)) for key in at_start - {"PYTHONPATH"})
        threads = env.get("OMP_NUM_THREADS")
        threads_given = threads == self.env.get("OMP_NUM_THREADS") or (threads or "").isdigit()
        return same and threads_given and _added_path(env, self.env) is not None

    def started_by(self, requester: int) -> dict[int, dict[str, str]]:
        """The children forked at `requester`'s request that run still, each with its environment."""
        return {pid: child["env"] for pid, child in self._children().items() if child["requester"] == requester}

    def environ(self, pid: int) -> dict[str, str] | None:
        """The environment child `pid` was forked with, while it runs (None: no child of this one)."""
        return self._children().get(pid, {}).get("env")

    def command(self, pid: int) -> list[str] | None:
        """The command child `pid` was forked for, while it runs (None: no child of this one)."""
        return self._children().get(pid, {}).get("argv")

    def _children(self) -> dict[int, dict]:
        found = {}
        for record in Path(self._folder).glob("*.json"):
            with contextlib.suppress(FileNotFoundError):  # reaped meanwhile
                found[int(record.stem)] = json.loads(record.read_text())
        return found

    def serves(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait()
        shutil.rmtree(self._folder)


class WarmPopen(subprocess.Popen):
    """`subprocess.Popen(command, ...)` forked by `parent`: the same object to the test."""

    def __init__(self, parent: WarmParent, command: list[str] | tuple[str, ...], **popen) -> None:
        self._parent = parent
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._connection.connect(parent.path)
        try:
            super().__init__(command, **popen)
        except BaseException:
            self._connection.close()
            raise

    def _execute_child(self, *given) -> None:
        given = dict(zip(_CHILD_ARGUMENTS, given, strict=True))
        streams = [
            given[name] if given[name] != -1 else default
            for name, default in (("p2cread", 0), ("c2pwrite", 1), ("errwrite", 2))
        ]
        env = dict(os.environ if given["env"] is None else given["env"])
        request = {
            "argv": [str(part) for part in given["args"]],
            "cwd": os.fspath(given["cwd"] or os.getcwd()),
            "env": env,
            "session": bool(given["start_new_session"]),
            "added": _added_path(env, self._parent.env),
            "ignored": _ignored(),
        }
        socket.send_fds(self._connection, [json.dumps(request).encode()], streams)
        told = self._connection.recv(64)
        if not told:
            raise RuntimeError("the warm parent ended (its output is in the pytest worker's)")
        self.pid = int(told)
        self._child_created = True
        self._close_pipe_fds(*(given[name] for name in _PIPES))

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if wait_flags & os.WNOHANG and not select.select([self._connection], [], [], 0)[0]:
            return 0, 0
        status = self._connection.recv(64)
        if not status:
            raise ChildProcessError(f"the warm parent ended before run {self.pid} did; its exit status is lost")
        # Until now the child was a zombie, as a child of this process's own would be until its wait:
        # a signal to its pid or group still found it. Heard, it is reaped before this wait returns.
        with contextlib.suppress(OSError):
            self._connection.send(b"reap")
            self._connection.recv(64)
        self._connection.close()
        return self.pid, int(status)

    def _internal_poll(self, _deadstate=None, **_) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                pid, status = self._try_wait(os.WNOHANG)
                if pid:
                    self._handle_exitstatus(status)
            except OSError:
                if _deadstate is None:
                    raise
                self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


_CHILD_ARGUMENTS = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]
_PIPES = ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread", "errwrite")


def _started(command) -> tuple[bool, list[str]] | None:
    """For `python [-u] <script> ...` or `python [-u] -m <module> ...` of what the warm parent runs:
    whether it is unbuffered (-u), and the rest (script or -m module, then the arguments)."""
    command = list(command)
    if not command or command[0] != sys.executable:
        return None
    unbuffered = command[1:2] == ["-u"]
    rest = command[1 + unbuffered :]
    if rest[:1] and rest[0] in SCRIPTS or rest[:1] == ["-m"] and rest[1:2] and rest[1] in MODULES:
        return unbuffered, rest
    return None


def _added_path(env, parent_env) -> list[str] | None:
    """The folders `env`'s PYTHONPATH puts before the warm parent's ([] for none), or None where it
    differs otherwise."""
    requested = [part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part]
    own = [part for part in parent_env.get("PYTHONPATH", "").split(os.pathsep) if part]
    if len(requested) < len(own) or requested[len(requested) - len(own) :] != own:
        return None
    return requested[: len(requested) - len(own)]


class _ThisWarmParent(WarmParent):
    """The warm parent as a run it forked sees it: where the run asks for its sender."""

    def __init__(self, path: str, env: dict[str, str], imports_set: dict[str, str]) -> None:
        self.path, self.env, self.imports_set = path, env, imports_set

    def serves(self) -> bool:
        return True  # it does while this run, its child, runs


def fork_from(parent_of: Callable[[], WarmParent | None], senders_only: bool = False) -> None:
    """`subprocess.Popen` in this process (a forked run or torchrun; `senders_only` in a test that runs
    the recipe in its own process), and torchrun's own reference to it: what it starts that the warm
    parent `parent_of()` gives can start (the sender, torchrun's workers) is forked by it (None: none,
    with `--cold-starts`); any other command starts as before."""
    cold = subprocess.Popen

    def forks(args) -> bool:
        started = _started(args) if isinstance(args, list | tuple) else None
        return started is not None and (not senders_only or started[1][:2] == ["-m", SENDER])

    class Popen(cold):
        def __new__(cls, args, *rest, **popen):
            parent = parent_of() if not rest and forks(args) else None
            if parent is not None and parent.can_start(args, popen.get("env"), popen):
                return WarmPopen(parent, args, **popen)
            return super().__new__(cls)

    subprocess.Popen = Popen
    torchrun = sys.modules.get("torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler")
    if torchrun is not None:  # it took Popen by name as it was imported
        torchrun.Popen = Popen


def _die_with_parent() -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: it ends with the pytest worker


# --- the warm parent's side -----------------------------------------------------------------------


def serve(path: str, ready: int) -> list[str]:
    """Imports what a sender imports, then forks a child for each request, having imported what a run
    imports before the first that is no sender's; returns in the child only, once it is set up as the
    interpreter its request asks for, the command it asked for."""
    env = dict(os.environ)
    imports_set, threads = imported(SENDER_IMPORTS, env)
    runs_imported = False
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    os.write(ready, b"ready\n")
    os.close(ready)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd: (pid, the requester's connection)
    # A child that ended is told to its requester and stays a zombie, as the requester's own child
    # would, until the requester has heard its status (or ended): then it is reaped.
    ended: dict[socket.socket, int] = {}  # the requester's connection: the pid it waits to reap
    while True:
        readable, _, _ = select.select([listener, *children, *ended], [], [])
        for pidfd in set(readable) & set(children):
            pid, connection = children.pop(pidfd)
            os.close(pidfd)
            status = _wait_status(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT))
            try:
                connection.send(str(status).encode())
                ended[connection] = pid
            except OSError:  # a requester that ended first
                _reap(path, pid, connection)
        for connection in set(readable) & set(ended):
            _reap(path, ended.pop(connection), connection)
        if listener not in readable:
            continue
        connection, _ = listener.accept()
        requester, _, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        message, streams, _, _ = socket.recv_fds(connection, MESSAGE, 3)
        if len(streams) != 3:  # a requester whose Popen failed before it asked
            for stream in streams:
                os.close(stream)
            connection.close()
            continue
        request = json.loads(message)
        if not runs_imported and _started(request["argv"])[1][:2] != ["-m", SENDER]:
            imports_set, threads = imported(IMPORTS, env)
            runs_imported = True
        # A thread started since the imports would not be in the child: a fork would lose its work.
        now = len(os.listdir("/proc/self/task"))
        assert now <= threads, f"the warm parent has {now} threads, {threads} after its imports"
        pid = os.fork()
        if pid == 0:
            listener.close()
            for pidfd, (_, other) in children.items():
                os.close(pidfd)
                other.close()
            for other in ended:
                other.close()
            connection.close()
            fork_from(functools.partial(_ThisWarmParent, path, env, imports_set))
            _as_new(request, streams, imports_set)
            return request["argv"]
        for stream in streams:
            os.close(stream)
        record = json.dumps({"requester": requester, "argv": request["argv"], "env": request["env"]})
        Path(_record(path, pid) + ".tmp").write_text(record)
        os.rename(_record(path, pid) + ".tmp", _record(path, pid))  # whole, to `started_by`
        connection.send(str(pid).encode())
        children[os.pidfd_open(pid)] = (pid, connection)


def imported(names: tuple[str, ...], env: dict[str, str]) -> tuple[dict[str, str], int]:
    """Imports `names`; returns what the imports so far set in the environment of `env` (MLflow's
    request time-outs, ...), which each child has too, as it has the modules that set it, unless its
    request sets it; and the threads this process has now (torch's own, started by its import)."""
    for name in names:
        importlib.import_module(name)
    imports_set = {key: value for key, value in os.environ.items() if env.get(key) != value}
    return imports_set, len(os.listdir("/proc/self/task"))


def _wait_status(ended: os.waitid_result) -> int:
    """The status `os.waitpid` gives for the child whose end `os.waitid` reported as `ended`."""
    if ended.si_code == os.CLD_EXITED:
        return ended.si_status << 8
    return ended.si_status | (0x80 if ended.si_code == os.CLD_DUMPED else 0)


def _reap(path: str, pid: int, connection: socket.socket) -> None:
    """Reaps ended child `pid`, then tells its requester so on `connection` (if it listens still)."""
    os.waitpid(pid, 0)
    os.unlink(_record(path, pid))
    with contextlib.suppress(OSError):
        connection.send(b"reaped")
    connection.close()


def _ignored() -> list[int]:
    """The signals a new process started from this one would start with ignored: those this process
    ignores (the kernel's mask: a background job's SIGINT and SIGQUIT, `nohup`'s SIGHUP), less those
    that every Python interpreter ignores as it starts and Popen restores for its child, and the C
    library's own (32 and 33, which the mask may show and no program may set)."""
    with open("/proc/self/status") as status:
        mask = int(next(line for line in status if line.startswith("SigIgn:")).split()[1], 16)
    settable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE, signal.SIGXFSZ}
    return sorted(number for number in settable if mask >> (number - 1) & 1)


def _record(path: str, pid: int) -> str:
    """Where the warm parent serving at socket `path` keeps what child `pid` was asked for."""
    return os.path.join(os.path.dirname(path), f"{pid}.json")


def _as_new(request: dict, streams: list[int], imports_set: dict[str, str]) -> None:
    """This child as the interpreter that `python <script> ...` would start."""
    if request["session"]:
        os.setsid()
    for number, stream in enumerate(streams):
        os.dup2(stream, number)
    for stream in set(streams) - {0, 1, 2}:
        os.close(stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(imports_set | request["env"])
    unbuffered, rest = _started(request["argv"])
    if rest[0] == "-m":  # as `python -m` sets them while it finds the module
        sys.argv = ["-m", *rest[2:]]
        sys.path[:0] = [request["cwd"], *request["added"]]
    else:
        sys.argv = rest
        script = os.path.join(request["cwd"], sys.argv[0])
        sys.path[:0] = [os.path.dirname(script), *request["added"]]
    if unbuffered:  # as `python -u` makes them: each write reaches the stream at once
        for name, number in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            raw = io.FileIO(number, "w", closefd=False)
            raw.name = f"<{name}>"
            stream = io.TextIOWrapper(raw, old.encoding, old.errors, write_through=True)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    tempfile.tempdir = None  # read from TMPDIR again, as a new interpreter would
    # What the requester ignores, a new interpreter inherits ignored (and Python then leaves SIGINT so);
    # otherwise SIGINT raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for number in request["ignored"]:
        signal.signal(number, signal.SIG_IGN)
    # A new interpreter seeds Python's, NumPy's and torch's generators anew: so must each fork. (One
    # not imported here, as torch is not in a sender's, seeds itself as the child imports it, and
    # reads OMP_NUM_THREADS then.)
    import random

    random.seed()
    if numpy := sys.modules.get("numpy"):
        numpy.random.seed()
    if torch := sys.modules.get("torch"):
        torch.seed()
        if "OMP_NUM_THREADS" in request["env"]:  # as torch reads it as it starts
            torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    for folder in request["added"]:
        found = Path(folder, "sitecustomize.py")
        if found.is_file():
            spec = importlib.util.spec_from_file_location("sitecustomize", found)
            sys.modules["sitecustomize"] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            break


def run_as_main(script: str) -> None:
    """Runs `script` as `python <script>` runs it: as a new module `__main__`, `__file__` absolute,
    `sys.argv[0]` as typed (runpy.run_path would set both to one path)."""
    import builtins
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(script)
    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = path, None, builtins
    main.__loader__ = SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec")
    exec(code, vars(main))


def run_module_as_main(module: str) -> None:
    """Runs `module` as `python -m <module>` runs it, in a new module `__main__`."""
    import builtins
    import runpy

    sys.modules.pop(module, None)  # the engine imported it here; a new interpreter runs it first as __main__
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    runpy._run_module_as_main(module)  # what `python -m` calls


def end_as_new(main: Callable[[], None]) -> NoReturn:
    """Runs `main`, then ends this child as an interpreter ends, seen from outside: the exit status
    of its `SystemExit` or uncaught exception (printed as Python prints it; an uncaught
    KeyboardInterrupt ends it by SIGINT), its threads waited for, its atexit handlers run, its
    streams flushed (C's too). What is left out is the interpreter's teardown, which Python does not
    promise to finish (the finalizers of objects alive at the end) and which in a fork clears every
    module the warm parent imported, copying most of its memory page by page: 0.8 CPU-s a child,
    a third of a short run's, where a new interpreter's teardown copies nothing."""
    import atexit
    import threading
    import traceback

    code = 0
    try:
        main()
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # a message: printed, and the status 1
            if sys.stderr is not None:
                print(stop.code, file=sys.stderr)
            else:  # as Python: to the process's own stderr
                os.write(2, f"{stop.code}\n".encode())
            code = 1
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        code = -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1
    try:
        threading._shutdown()  # the threads that are not daemons, waited for
    except BaseException:
        print("Exception ignored on threading shutdown:", file=sys.stderr)
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            code = 120 if stream is sys.stdout else code  # Python's status where stdout's flush fails
    ctypes.CDLL(None).fflush(None)
    if code == -signal.SIGINT:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


# --- a shell's side ------------------------------------------------------------------------------


def as_client(path: str, argv: list[str]) -> None:
    """`python <argv>` in place of this process, forked by the warm parent serving at `path` where it
    can be (a new interpreter otherwise), as a shell sees it: this process's standard streams,
    working directory and environment; the signals this process takes passed on; the run's exit
    status as its own (a run that a signal ended ends this process by the same signal)."""
    command = [sys.executable, *argv]
    if _started(command) is None:
        os.execv(sys.executable, command)
    process = WarmPopen(_ThisWarmParent(path, dict(os.environ), {}), command)
    for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, lambda number, _: process.send_signal(number))
    returncode = process.wait()
    if returncode < 0:
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode)


if __name__ == "__main__":
    sys.path.pop(0)  # this folder's, which a run's interpreter would not have
    if sys.argv[1] == "--client":
        as_client(sys.argv[2], sys.argv[3:])
    command = serve(sys.argv[1], int(sys.argv[2]))  # in the child only: the warm parent serves until it ends
    _, rest = _started(command)
    if rest[0] == "-m":
        end_as_new(functools.partial(run_module_as_main, rest[1]))
    end_as_new(functools.partial(run_as_main, sys.argv[0]))
