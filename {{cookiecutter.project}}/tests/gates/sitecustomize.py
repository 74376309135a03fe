"""Test-only, and inert unless TEST_SAVE_GATE is set (tests/conftest.py, SaveGate): Python imports
this file at start-up in the processes a test starts with the gate's environment.

The first checkpoint commit among such processes (the rename of a temporary to step_N.pt, or to
the folder step_N; with TEST_SAVE_GATE_MATCH, only one whose path holds that text) connects to the
gate's socket, says its pid, and waits until the test lets go of the connection, after the rename
or, with TEST_SAVE_GATE_WHEN=before, before it. Only the thread that commits waits; the test
decides what the rest of the process may do meanwhile."""

import os

_GATE = os.environ.get("TEST_SAVE_GATE")

if _GATE:
    import re
    import socket

    _BEFORE = os.environ.get("TEST_SAVE_GATE_WHEN") == "before"
    _MATCH = os.environ.get("TEST_SAVE_GATE_MATCH", "")
    _EACH = os.environ.get("TEST_SAVE_GATE_EACH") == "1"
    _COMMIT = re.compile(r"step_\d{8,}(\.pt)?")
    _replace = os.replace
    _waited = False

    def _wait_at_the_gate() -> None:
        global _waited
        _waited = True
        if not _EACH:  # the first process only, of all that share the gate (a job requeued runs again)
            try:
                os.close(os.open(_GATE + ".taken", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
        with socket.socket(socket.AF_UNIX) as gate:
            gate.connect(_GATE)
            gate.sendall(f"{os.getpid()}\n".encode())
            while gate.recv(64):  # until the test closes its end
                pass

    def _gated_replace(src, dst, *args, **kwargs):
        commit = (
            not _waited
            and str(src).endswith(".tmp")
            and _COMMIT.fullmatch(os.path.basename(dst)) is not None
            and _MATCH in str(dst)
        )
        if commit and _BEFORE:
            _wait_at_the_gate()
        result = _replace(src, dst, *args, **kwargs)
        if commit and not _BEFORE:
            _wait_at_the_gate()
        return result

    os.replace = _gated_replace
