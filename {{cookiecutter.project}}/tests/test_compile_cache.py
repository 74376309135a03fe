"""torch.compile's cache beside the checkpoints (engine/compile_cache.py): a compiled run resumed on a
machine whose Inductor cache is empty takes its graphs from its own home instead of compiling them;
a cache that is damaged, of another key, of another torch, or a link, and a key that is a link, another
user's or open to others, are refused in one line, and the run compiles afresh and goes on; a cache
refused is replaced at the next save, even where Inductor's own cache gave every graph, and the leg's
line tells the graphs the compile cache gave from those Inductor's gave. Each leg here gets an empty
TORCHINDUCTOR_CACHE_DIR, as a requeue on another machine does (unless it says otherwise), and a HOME
of the test's, where the user's key lives."""

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
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo.utils
from conftest import copy_project, start

from {{cookiecutter.package}}.engine import compile_cache

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

CPU = torch.device("cpu")
SAID = re.compile(
    r"torch\.compile: (\d+) graphs compiled, (\d+) from the compile cache"
    r"(?:, (\d+) from Inductor's cache on this machine)? \(\d+\.\d s\)"
)
SETTINGS = ("device=cpu", "mlflow.enabled=false", "trainer.compile=true", "checkpoint.every_n_steps=5")


def leg(
    project: Path, user: Path, *overrides: str, inductor: Path | None = None
) -> tuple[tuple[int, int, int], list[str]]:
    """`python run.py` with an empty Inductor cache of its own, or `inductor`; the graphs it compiled,
    took from the compile cache and from Inductor's, and the lines it printed about the home's
    compile cache. It must train to its end."""
    inductor = inductor or project / f"inductor-{secrets.token_hex(4)}"
    env = {**os.environ, "HOME": str(user), "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    process = start(project, *SETTINGS, *overrides, env=env)
    stdout, stderr = process.communicate(timeout=600)
    lines = (stdout + stderr).splitlines()
    assert process.returncode == 0, stderr
    assert any(line.startswith("finished at step") for line in lines), lines
    counts = [tuple(int(count or 0) for count in found.groups()) for line in lines if (found := SAID.search(line))]
    assert len(counts) == 1, lines
    return counts[0], [line for line in lines if "compile cache " in line and not SAID.search(line)]


def sealed(payload: bytes, key: bytes, written_on: str) -> bytes:
    """A compile cache as compile_cache writes one: `written_on` (its `here` line), the payload, signed with `key`."""
    body = compile_cache.MAGIC + written_on.encode() + b"\n" + payload
    return body + hmac.new(key, body, hashlib.sha256).digest()


def payload_of(cache: bytes) -> bytes:
    return cache[len(compile_cache.MAGIC) : -32].partition(b"\n")[2]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, blank_store) -> dict:
    """One compiled run of 10 steps: its project, the user (HOME) whose key signed its cache, the
    cache's bytes, the graphs it compiled, its home, and the Inductor cache it compiled into."""
    folder = tmp_path_factory.mktemp("compiled")
    project, user = copy_project(folder, blank_store), folder / "user"
    home, inductor = folder / "first", folder / "inductor"
    (fresh, *cached), said = leg(project, user, "trainer.max_steps=10", f"checkpoint.dir={home}", inductor=inductor)
    assert fresh > 0 and cached == [0, 0] and said == []
    return {
        "project": project,
        "user": user,
        "cache": (home / compile_cache.NAME).read_bytes(),
        "graphs": fresh,
        "home": home,
        "inductor": inductor,
    }


def test_a_resumed_compiled_run_takes_every_graph_from_its_homes_cache_and_compiles_none(compiled, tmp_path):
    """The first leg is the module's compiled run, its home copied (times kept): a leg of its own would
    compile the same graphs again."""
    project, user, home = compiled["project"], compiled["user"], tmp_path / "run"
    shutil.copytree(compiled["home"], home)
    written = (home / compile_cache.NAME).stat()

    counts, said = leg(project, user, "trainer.max_steps=20", f"checkpoint.dir={home}", "resume=last")
    assert counts == (0, compiled["graphs"], 0)
    assert said == []
    assert (home / compile_cache.NAME).stat().st_mtime_ns == written.st_mtime_ns  # nothing new: not written again


def test_a_damaged_cache_is_refused_in_one_line_and_the_run_compiles_and_replaces_it(compiled, tmp_path):
    """The damaged cache holds the graphs of this very run: loaded, it would compile none. Each other
    way a cache is refused (another key, another torch, a link, ...) is the same path from `load` on,
    shown in this process below."""
    project, user, home = compiled["project"], compiled["user"], tmp_path / "run"
    home.mkdir()
    genuine, path = compiled["cache"], home / compile_cache.NAME
    middle = len(genuine) // 2
    path.write_bytes(genuine[:middle] + bytes([genuine[middle] ^ 0xFF]) + genuine[middle + 1 :])

    counts, said = leg(project, user, "trainer.max_steps=10", f"checkpoint.dir={home}")
    assert counts == (compiled["graphs"], 0, 0)
    assert len(said) == 1 and f"compile cache {path} is damaged, or was not written by this user's runs" in said[0]
    assert said[0].endswith(": compiling afresh")
    assert path.read_bytes().startswith(compile_cache.MAGIC) and path.read_bytes() != genuine  # this run's own


def test_a_resume_from_another_runs_checkpoint_never_reads_that_runs_compile_cache(compiled, tmp_path):
    project, user, home = compiled["project"], compiled["user"], tmp_path / "run"
    source = compiled["home"] / "step_00000010.pt"
    counts, said = leg(project, user, "trainer.max_steps=20", f"checkpoint.dir={home}", f"resume={source}")
    assert counts == (compiled["graphs"], 0, 0) and said == []


def test_a_refused_cache_is_replaced_where_inductors_own_cache_gave_every_graph_and_the_line_says_whose(
    compiled, tmp_path
):
    """On the machine that compiled them, Inductor's cache holds every graph: the leg compiles none,
    and must still replace the damaged cache, which a requeue elsewhere would otherwise find."""
    project, user, home = compiled["project"], compiled["user"], tmp_path / "run"
    home.mkdir()
    path = home / compile_cache.NAME
    path.write_bytes(compiled["cache"][:-1] + bytes([compiled["cache"][-1] ^ 0xFF]))
    counts, said = leg(project, user, "trainer.max_steps=10", f"checkpoint.dir={home}", inductor=compiled["inductor"])
    assert counts == (0, 0, compiled["graphs"])
    assert len(said) == 1 and "is damaged, or was not written by this user's runs" in said[0]
    key = (user / ".cache" / "{{cookiecutter.package}}" / "compile-cache.key").read_bytes()
    assert sealed(payload_of(path.read_bytes()), key, compile_cache.here(CPU)) == path.read_bytes()  # its own, signed


# The module alone, in this process: what `load` hands torch, and what `save` writes.


@pytest.fixture
def user(tmp_path, monkeypatch) -> Path:
    """A user of their own, and a process that has neither loaded nor saved a compile cache."""
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    for name, value in {"_looked": 0, "_held": set(), "_loaded": set(), "_key_said": ""}.items():
        monkeypatch.setattr(compile_cache, name, value)
    return tmp_path / "user"


def graphs(count: int) -> SimpleNamespace:
    """torch's account of the artifacts it loaded or saved: `count` graphs by Inductor's keys."""
    return SimpleNamespace(inductor_artifacts=[f"graph-{number}" for number in range(count)])


@pytest.fixture
def loaded(monkeypatch) -> list[bytes]:
    """What `load` hands torch, which takes it as one graph."""
    handed = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda payload: handed.append(payload) or graphs(1))
    return handed


def written_by(monkeypatch, home: Path, payload: bytes, misses: int, hits: int = 0) -> None:
    """`save`, after `misses` graphs compiled afresh and `hits` found in Inductor's cache, of a torch
    whose artifacts are `payload`."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, graphs(misses + hits)))
    counted = collections.Counter(fxgraph_cache_miss=misses, fxgraph_cache_hit=hits)
    monkeypatch.setitem(torch._dynamo.utils.counters, "inductor", counted)
    compile_cache.save(home, CPU, main=True)


def a_key() -> bytes:
    """This user's key, as `save` makes it."""
    key = compile_cache.key_path()
    key.parent.mkdir(parents=True, mode=0o700)
    key.write_bytes(secrets.token_bytes(32))
    key.chmod(0o600)
    return key.read_bytes()


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
    "a key that is a link": "refuses the key {key}, which is a symbolic link: delete it (rm {key}), and a new one is made",
    "a key open to others": "refuses the key {key}, which is open to others (mode 0640, not 0600): delete it",
    "another user's key": "refuses the key {key}, which is another user's (uid",
    "another key": "is damaged, or was not written by this user's runs",
    "damaged": "is damaged, or was not written by this user's runs",
    "another device": "was written by torch",
    "another torch": f"was written by torch 1.0.0, Python 3.{sys.version_info[1]}",
    "a link": "is a symbolic link",
    "a FIFO": "is a FIFO",
    "over the bound": "is over 512 MiB",
    "no key": "needs the key",
    "a key of 7 bytes": "it holds 7 bytes, not a key: delete it, and a new one is made",
}


@pytest.mark.parametrize("planted", REFUSED)
def test_load_refuses_in_one_line_and_hands_torch_nothing(user, loaded, tmp_path, caplog, monkeypatch, planted):
    """A key that is a link, another user's or open to others could be one that signed a planted cache."""
    home = tmp_path / "home"
    home.mkdir()
    path = home / compile_cache.NAME
    key = compile_cache.key_path()
    a_key()
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
    elif planted == "another torch":
        path.write_bytes(sealed(b"graphs", key.read_bytes(), here.replace(torch.__version__, "1.0.0")))
    elif planted == "a link":
        path.rename(tmp_path / "genuine.bin")
        path.symlink_to(tmp_path / "genuine.bin")
    elif planted == "a FIFO":
        path.unlink()
        os.mkfifo(path)
    elif planted == "a key that is a link":  # to a key that signed the cache, which is all it takes
        key.rename(tmp_path / "known.key")
        key.symlink_to(tmp_path / "known.key")
    elif planted == "a key open to others":
        key.chmod(0o640)
    elif planted == "another user's key":
        monkeypatch.setattr(os, "getuid", lambda: key.stat().st_uid + 1)
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
    assert REFUSED[planted].format(key=key) in said(caplog)[0] and said(caplog)[0].endswith(": compiling afresh")
    expected = ("another device", "another torch")  # a resume on another machine: expected, not a warning
    level = logging.INFO if planted in expected else logging.WARNING
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


def test_a_signed_cache_torch_cannot_read_is_one_line_without_torchs_traceback(user, tmp_path, caplog, capfd):
    home = tmp_path / "home"
    home.mkdir()
    path = home / compile_cache.NAME
    path.write_bytes(sealed(b"graphs", a_key(), compile_cache.here(CPU)))  # this user's, but no payload of torch's
    compile_cache.load(home, CPU)
    assert len(said(caplog)) == 1 and said(caplog)[0].startswith(
        f"compile cache {path} could not be loaded (Failed to un-pickle cache artifacts: RuntimeError: "
    )
    assert said(caplog)[0].endswith("): compiling afresh")
    assert "Traceback" not in capfd.readouterr().err


def test_a_refused_key_is_said_once_a_leg_and_the_cache_is_left_as_it_is(user, monkeypatch, tmp_path, caplog):
    home = tmp_path / "home"
    home.mkdir()
    path = home / compile_cache.NAME
    path.write_bytes(planted := sealed(b"graphs", a_key(), compile_cache.here(CPU)))
    compile_cache.key_path().chmod(0o644)
    compile_cache.load(home, CPU)
    written_by(monkeypatch, home, b"graphs", misses=2)
    written_by(monkeypatch, home, b"more graphs", misses=3)
    assert said(caplog) == [
        f"compile cache {path} refuses the key {compile_cache.key_path()}, which is open to others (mode 0644, not "
        f"0600): delete it (rm {compile_cache.key_path()}), and a new one is made: compiling afresh"
    ]
    assert path.read_bytes() == planted


def test_a_refused_cache_is_replaced_at_the_next_save_though_every_graph_came_from_inductors_cache(
    user, monkeypatch, tmp_path, caplog
):
    home = tmp_path / "home"
    home.mkdir()
    path = home / compile_cache.NAME
    path.write_bytes(b"\x80\x04 a pickle")
    compile_cache.load(home, CPU)
    written_by(monkeypatch, home, b"graphs", misses=0, hits=2)
    assert payload_of(path.read_bytes()) == b"graphs"
    assert sealed(b"graphs", compile_cache.key_path().read_bytes(), compile_cache.here(CPU)) == path.read_bytes()
    assert len(said(caplog)) == 1  # the refusal, at the load


def test_the_legs_line_counts_from_the_compile_cache_only_the_graphs_it_gave(user, loaded, monkeypatch, tmp_path):
    """The home's cache held one graph; Inductor's cache on this machine gave two more."""
    home = tmp_path / "home"
    home.mkdir()
    written_by(monkeypatch, home, b"graphs", misses=1)
    compile_cache.load(home, CPU)
    written_by(monkeypatch, home, b"graphs", misses=0, hits=3)
    assert re.fullmatch(
        r"torch\.compile: 0 graphs compiled, 1 from the compile cache, 2 from Inductor's cache on this machine "
        r"\(\d+\.\d s\)",
        compile_cache.said(),
    )


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
