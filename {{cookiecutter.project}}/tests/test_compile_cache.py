"""torch.compile's cache beside the checkpoints (engine/compile_cache.py): a compiled run resumed on a
machine whose Inductor cache is empty takes its graphs from its own home instead of compiling them;
a cache that is damaged, of another key, of another torch, or a link is refused in one line, and the
run compiles afresh and goes on. Each leg here gets an empty TORCHINDUCTOR_CACHE_DIR, as a requeue
on another machine does, and a HOME of the test's, where the user's key lives."""

import collections
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils
from conftest import copy_project, start

from {{cookiecutter.package}}.engine import compile_cache

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

CPU = torch.device("cpu")
SAID = re.compile(r"torch\.compile: (\d+) graphs compiled, (\d+) from the compile cache \(\d+\.\d s\)")
SETTINGS = ("device=cpu", "mlflow.enabled=false", "trainer.compile=true", "checkpoint.every_n_steps=5")


def leg(project: Path, user: Path, *overrides: str) -> tuple[tuple[int, int], list[str]]:
    """`python run.py` with an empty Inductor cache of its own; the graphs it compiled and took from
    the cache, and the lines it printed about the home's compile cache. It must train to its end."""
    inductor = project / f"inductor-{secrets.token_hex(4)}"
    env = {**os.environ, "HOME": str(user), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    process = start(project, *SETTINGS, *overrides, env=env)
    stdout, stderr = process.communicate(timeout=600)
    lines = (stdout + stderr).splitlines()
    assert process.returncode == 0, stderr
    assert any(line.startswith("finished at step") for line in lines), lines
    counts = [tuple(map(int, found.groups())) for line in lines if (found := SAID.search(line))]
    assert len(counts) == 1, lines
    return counts[0], [line for line in lines if "compile cache " in line and not SAID.search(line)]


def sealed(payload: bytes, key: bytes, written_on: str) -> bytes:
    """A compile cache as compile_cache writes one: `written_on` (its `here` line), the payload, signed with `key`."""
    body = compile_cache.MAGIC + written_on.encode() + b"\n" + payload
    return body + hmac.new(key, body, hashlib.sha256).digest()


def payload_of(cache: bytes) -> bytes:
    return cache[len(compile_cache.MAGIC) : -32].partition(b"\n")[2]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    """One compiled run of 10 steps: its project, the user (HOME) whose key signed its cache, the
    cache's bytes, the graphs it compiled, and its home."""
    folder = tmp_path_factory.mktemp("compiled")
    project, user = copy_project(folder), folder / "user"
    home = folder / "first"
    (fresh, cached), said = leg(project, user, "trainer.max_steps=10", f"checkpoint.dir={home}")
    assert fresh > 0 and cached == 0 and said == []
    return {
        "project": project,
        "user": user,
        "cache": (home / compile_cache.NAME).read_bytes(),
        "graphs": fresh,
        "home": home,
    }


def test_a_resumed_compiled_run_takes_every_graph_from_its_homes_cache_and_compiles_none(compiled, tmp_path):
    project, user, home = compiled["project"], compiled["user"], tmp_path / "run"
    (fresh, cached), said = leg(project, user, "trainer.max_steps=10", f"checkpoint.dir={home}")
    assert (fresh, cached) == (compiled["graphs"], 0)
    written = (home / compile_cache.NAME).stat()

    (fresh, cached), said = leg(project, user, "trainer.max_steps=20", f"checkpoint.dir={home}", "resume=last")
    assert (fresh, cached) == (0, compiled["graphs"])
    assert said == []
    assert (home / compile_cache.NAME).stat().st_mtime_ns == written.st_mtime_ns  # nothing new: not written again


@pytest.mark.parametrize("planted", ["damaged", "another key", "another torch", "a link"])
def test_a_cache_damaged_foreign_of_another_torch_or_a_link_is_refused_in_one_line_and_the_run_compiles(
    compiled, tmp_path, planted
):
    """Each planted cache holds the graphs of this very run: loaded, it would compile none."""
    project, user, home = compiled["project"], compiled["user"], tmp_path / "run"
    home.mkdir()
    genuine, path = compiled["cache"], home / compile_cache.NAME
    key = (user / ".cache" / "{{cookiecutter.package}}" / "compile-cache.key").read_bytes()
    if planted == "damaged":
        middle = len(genuine) // 2
        path.write_bytes(genuine[:middle] + bytes([genuine[middle] ^ 0xFF]) + genuine[middle + 1 :])
    elif planted == "another key":
        path.write_bytes(sealed(payload_of(genuine), secrets.token_bytes(32), compile_cache.here(CPU)))
    elif planted == "another torch":
        path.write_bytes(sealed(payload_of(genuine), key, compile_cache.here(CPU).replace(torch.__version__, "1.0.0")))
    else:
        (tmp_path / "elsewhere.bin").write_bytes(genuine)
        path.symlink_to(tmp_path / "elsewhere.bin")

    (fresh, cached), said = leg(project, user, "trainer.max_steps=10", f"checkpoint.dir={home}")
    assert (fresh, cached) == (compiled["graphs"], 0)
    reason = {
        "damaged": "is damaged, or was not written by this user's runs",
        "another key": "is damaged, or was not written by this user's runs",
        "another torch": f"was written by torch 1.0.0, Python 3.{sys.version_info[1]}",
        "a link": "is a symbolic link",
    }[planted]
    assert len(said) == 1 and f"compile cache {path} {reason}" in said[0] and said[0].endswith(": compiling afresh")
    assert not path.is_symlink() and path.read_bytes().startswith(compile_cache.MAGIC)  # replaced by this run's own
    if planted == "a link":
        assert (tmp_path / "elsewhere.bin").read_bytes() == genuine


def test_a_resume_from_another_runs_checkpoint_never_reads_that_runs_compile_cache(compiled, tmp_path):
    project, user, home = compiled["project"], compiled["user"], tmp_path / "run"
    source = compiled["home"] / "step_00000010.pt"
    (fresh, cached), said = leg(project, user, "trainer.max_steps=20", f"checkpoint.dir={home}", f"resume={source}")
    assert (fresh, cached) == (compiled["graphs"], 0) and said == []


# The module alone, in this process: what `load` hands torch, and what `save` writes.


@pytest.fixture
def user(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setattr(compile_cache, "_written", 0)
    return tmp_path / "user"


@pytest.fixture
def loaded(monkeypatch) -> list[bytes]:
    """What `load` hands torch."""
    handed = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", handed.append)
    return handed


def written_by(monkeypatch, home: Path, payload: bytes, misses: int) -> None:
    """`save`, after `misses` graphs compiled afresh, of a torch whose artifacts are `payload`."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, None))
    monkeypatch.setitem(torch._dynamo.utils.counters, "inductor", collections.Counter(fxgraph_cache_miss=misses))
    compile_cache.save(home, CPU, main=True)


def said(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == compile_cache.__name__]


def test_a_saved_cache_loads_its_payload_and_the_key_is_made_once_for_this_user_alone(
    user, loaded, monkeypatch, tmp_path, caplog
):
    home = tmp_path / "home"
    home.mkdir()
    written_by(monkeypatch, home, b"graphs", misses=3)
    key = compile_cache.key_path()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    made = key.read_bytes()
    compile_cache.load(home, CPU)
    assert loaded == [b"graphs"] and key.read_bytes() == made and said(caplog) == []


def test_save_writes_only_when_graphs_were_compiled_since_and_only_on_rank_0(user, monkeypatch, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    written_by(monkeypatch, home, b"graphs", misses=0)  # nothing compiled
    assert not (home / compile_cache.NAME).exists()
    monkeypatch.setitem(torch._dynamo.utils.counters, "inductor", collections.Counter(fxgraph_cache_miss=2))
    compile_cache.save(home, CPU, main=False)
    assert not (home / compile_cache.NAME).exists()
    written_by(monkeypatch, home, b"graphs", misses=2)
    before = (home / compile_cache.NAME).read_bytes()
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: pytest.fail("serialized for no new graph"))
    compile_cache.save(home, CPU, main=True)
    written_by(monkeypatch, home, b"more graphs", misses=3)
    assert payload_of((home / compile_cache.NAME).read_bytes()) == b"more graphs" != payload_of(before)


def test_save_replaces_a_link_instead_of_writing_through_it_and_a_failed_write_is_one_warning(
    user, monkeypatch, tmp_path, caplog
):
    home, target = tmp_path / "home", tmp_path / "thesis.txt"
    home.mkdir()
    target.write_text("mine")
    (home / compile_cache.NAME).symlink_to(target)
    written_by(monkeypatch, home, b"graphs", misses=1)
    assert target.read_text() == "mine" and not (home / compile_cache.NAME).is_symlink()

    written_by(monkeypatch, tmp_path / "gone", b"graphs", misses=2)  # a home that is not there
    assert said(caplog) == [
        f"compile cache {tmp_path / 'gone' / compile_cache.NAME} could not be written (No such file or directory): "
        "a restart compiles afresh"
    ]


REFUSED = {
    "not ours": "is not a compile cache this project wrote",
    "another key": "is damaged, or was not written by this user's runs",
    "damaged": "is damaged, or was not written by this user's runs",
    "another device": "was written by torch",
    "a link": "is a symbolic link",
    "a FIFO": "is a FIFO",
    "over the bound": "is over 512 MiB",
    "no key": "needs the key",
    "a key of 7 bytes": "it holds 7 bytes, not a key: delete it, and a new one is made",
}


@pytest.mark.parametrize("planted", REFUSED)
def test_load_refuses_in_one_line_and_hands_torch_nothing(user, loaded, tmp_path, caplog, planted):
    home = tmp_path / "home"
    home.mkdir()
    path = home / compile_cache.NAME
    key = compile_cache.key_path()
    key.parent.mkdir(parents=True)
    key.write_bytes(secrets.token_bytes(32))
    here = compile_cache.here(CPU)
    path.write_bytes(sealed(b"graphs", key.read_bytes(), here))
    if planted == "not ours":
        path.write_bytes(b"\x80\x04 a pickle")
    elif planted == "another key":
        path.write_bytes(sealed(b"graphs", secrets.token_bytes(32), here))
    elif planted == "damaged":
        path.write_bytes(path.read_bytes().replace(b"graphs", b"graphz"))
    elif planted == "another device":
        path.write_bytes(sealed(b"graphs", key.read_bytes(), here.replace("cpu (", "cuda (NVIDIA H100, ")))
    elif planted == "a link":
        path.rename(tmp_path / "genuine.bin")
        path.symlink_to(tmp_path / "genuine.bin")
    elif planted == "a FIFO":
        path.unlink()
        os.mkfifo(path)
    elif planted == "over the bound":
        os.truncate(path, compile_cache.MOST + 1)  # sparse: no disk spent
    elif planted == "no key":
        shutil.rmtree(key.parent)
        key.parent.write_text("a file where the key's folder goes")
    else:
        key.write_bytes(b"7 bytes")

    with caplog.at_level(logging.INFO):
        compile_cache.load(home, CPU)
    assert loaded == []
    assert len(said(caplog)) == 1 and said(caplog)[0].startswith(f"compile cache {path} ")
    assert REFUSED[planted] in said(caplog)[0] and said(caplog)[0].endswith(": compiling afresh")
    level = logging.INFO if planted == "another device" else logging.WARNING  # a resume on a new device: expected
    assert [record.levelno for record in caplog.records if record.name == compile_cache.__name__] == [level]


def test_a_cache_torch_cannot_load_is_one_warning_and_the_run_goes_on(user, monkeypatch, tmp_path, caplog):
    home = tmp_path / "home"
    home.mkdir()
    written_by(monkeypatch, home, b"graphs", misses=1)

    def fails(payload: bytes) -> None:
        raise AssertionError("Encoding version mismatch")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", fails)
    compile_cache.load(home, CPU)
    assert said(caplog) == [
        f"compile cache {home / compile_cache.NAME} could not be loaded (AssertionError: Encoding version mismatch): "
        "compiling afresh"
    ]


def test_a_home_without_a_cache_loads_nothing_says_nothing_and_makes_no_key(user, loaded, tmp_path, caplog):
    compile_cache.load(tmp_path, CPU)
    assert loaded == [] and said(caplog) == [] and not compile_cache.key_path().exists()


def test_the_counts_need_no_compiler_loaded():
    """A run without trainer.compile never imports torch._dynamo for the account."""
    code = (
        "import sys; from {{cookiecutter.package}}.engine import compile_cache as c; "
        "print(c.compiled(), c.said(), 'torch._dynamo' in sys.modules, sep='\\n')"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert shown.splitlines() == [
        "{'compiled': 0, 'cached': 0}",
        "torch.compile: 0 graphs compiled, 0 from the compile cache (0.0 s)",
        "False",
    ]
