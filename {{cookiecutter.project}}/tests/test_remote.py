"""checkpoint.remote: the run's home mirrored to an object store or a mounted folder, and continued
from there on a new machine (docs/preemptible-machines.md). The S3 tests run against a real S3 API
server on localhost (moto's), which s3fs and boto3 speak to as to a cloud store; they are skipped
where s3fs (the `remote` extra) or moto is not installed (`pip install -e '.[remote,s3-server]'`)."""

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import SECRET, goodput_of, hold, losses, run_cli, runs_named, start, wait_for_a_save
from mlflow import MlflowClient
from omegaconf import OmegaConf

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import home as homes
from {{cookiecutter.package}}.engine.checkpoint import onefile
from {{cookiecutter.package}}.engine.checkpoint.remote import manifest
from {{cookiecutter.package}}.engine.checkpoint.remote import run_folder as remote_run
from {{cookiecutter.package}}.engine.checkpoint.remote.claim import Lost, RemoteClaim, pid_space
from {{cookiecutter.package}}.engine.checkpoint.remote.fetch import fetch
from {{cookiecutter.package}}.engine.checkpoint.remote.mirror import MOST_PAUSE_S, Mirror
from {{cookiecutter.package}}.engine.checkpoint.remote.store import Conflict, Store, StoreError
from {{cookiecutter.package}}.engine.checkpoint.remote.url import checked
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.errors import RunError, SaveError

RUN = "demo"


@pytest.fixture(autouse=True)
def no_claim_left_renewing():
    """A claim a test leaves held renews on through later tests and logs its news into theirs."""
    before = set(threading.enumerate())
    yield
    for thread in set(threading.enumerate()) - before:
        if thread.name == "checkpoint-claim":
            thread.join(10)  # released: it ends at once
            assert not thread.is_alive(), "the test left a claim held: release it"


def keys(s3, url: str) -> set[str]:
    """The objects under the run's folder, as boto3 lists them, relative to it."""
    bucket_name, prefix = url.removeprefix("s3://").split("/", 1)
    prefix = f"{prefix}/{RUN}/"
    found = s3.list_objects_v2(Bucket=bucket_name, Prefix=prefix).get("Contents", [])
    return {entry["Key"].removeprefix(prefix) for entry in found}


def state(step: int) -> dict:
    """A complete checkpoint of format 3, small."""
    return {
        "format_version": 3, "step": step, "config": {"name": RUN}, "device": {"type": "cpu"}, "amp": {},
        "versions": {},
        "model": {"w": torch.full((64,), float(step))}, "optimizer": {"state": {}, "param_groups": []},
        "scheduler": {"last_epoch": step}, "scaler": {}, "position": {"epoch": 0, "sample": 0},
        "probe": {"indices": [], "loss": 0.0}, "tracker": {"run_id": None}, "monitor": {"waited": 0},
        "rng": {"ranks": []},
    }  # fmt: skip


def save(mirror: Mirror, home: Path, step: int, keep_last: int) -> Path:
    """What the Checkpointer does at a save: the file in its home, retention, then the mirror told."""
    path = onefile.save(state(step), home, keep_last)
    mirror.landed(path)
    return path


def store_of(remote: str) -> Store:
    """A store whose calls wait as long as a busy two-core machine may take: a test of the deadline
    makes a Store of its own."""
    return Store(remote, deadline_s=60)


# --- the URL ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"s3://AKIAEXAMPLE:{SECRET}@bkt/runs",
        f"s3://AKIAEXAMPLE:x/{SECRET}@bkt/runs",  # an AWS secret key holds '/': no parser finds where it ends
        f"s3://{SECRET}@bkt/runs",
        f"s3:AKIAEXAMPLE:{SECRET}@bkt/runs",  # no '//': no host part told from the path
        f"s3://bkt/runs?X-Amz-Signature={SECRET}",
        f"az://container/runs?sv=2024&sig={SECRET}",
        f"az://container:{SECRET}@account/runs",
        f"gs://bkt/runs#{SECRET}",
        f"simplecache::{SECRET}::s3://bkt/runs",
        f"simplecache::s3://bkt/runs::AKIAEXAMPLE:{SECRET}",  # the part after the last '::'
        f"AKIAEXAMPLE:{SECRET}@bkt/runs",  # s3:// left out
        f"file:///tmp/runs?{SECRET}",
        f"file://me:{SECRET}@host/runs",
    ],
)
def test_a_url_that_carries_a_credential_is_refused_in_one_line_that_does_not_repeat_it(url, monkeypatch):
    import fsspec

    monkeypatch.setattr(fsspec, "filesystem", lambda *a, **k: pytest.fail("fsspec was called"))
    with pytest.raises(RunError) as refused:
        Store(url)
    said = str(refused.value)
    assert SECRET not in said and "AKIAEXAMPLE" not in said and "\n" not in said
    assert said.startswith("checkpoint.remote=") and "credentials come from the store's own environment" in said


@pytest.mark.parametrize(
    "url",
    [
        "s3://bkt/runs",
        "gs://bkt/runs",
        "az://container@account/runs",
        "s3://bkt/runs/2024-06-01T12:00",  # ':' and '@' in the path are a folder's name, no credential
        "s3://bkt/team@example.com/runs",
        "az://container@account/team@example.com/runs",
        "/mnt/shared/runs",
        "/mnt/shared/v1:runs@2024",
        "file:///mnt/runs",
        "file://localhost/mnt/runs",
        "C:\\runs",
    ],
)
def test_a_stores_folder_without_credentials_is_accepted(url):
    assert checked(url) == url


def test_a_store_whose_package_is_missing_is_refused_naming_what_to_install(monkeypatch):
    import fsspec

    def absent(protocol, **options):
        raise ImportError(f"Install s3fs to access {protocol}")

    monkeypatch.setattr(fsspec, "filesystem", absent)
    with pytest.raises(RunError) as refused:
        Store("s3://bkt/runs")
    assert str(refused.value) == (
        "checkpoint.remote=s3://bkt/runs needs the package s3fs: pip install s3fs (or the project's extra: pip install "
        "-e '.[remote]')"
    )


@pytest.mark.parametrize(
    "url, said",
    [
        ("http://host/runs", "checkpoint.remote=http://... is not a store's folder"),
        # Each of these was a folder on this machine's disk, the one a preemption takes away: `ｓ3:/bkt/runs`
        # under the working folder (a fullwidth s, a fullwidth colon, a scheme with '_'), `/runs` (the host dropped).
        ("ｓ3://bkt/runs", "checkpoint.remote=... has a scheme that is no store's (a look-alike letter"),
        ("s3：//bkt/runs", "checkpoint.remote=... has a scheme that is no store's (a look-alike letter"),
        ("my_store://bkt/runs", "checkpoint.remote=... has a scheme that is no store's (a look-alike letter"),
        ("ｓ3:/bkt/runs", "checkpoint.remote=... has a scheme that is no store's (a look-alike letter"),  # one '/'
        ("file://shared/runs", "checkpoint.remote=file://... names a host, which a path or a file:// URL cannot reach"),
        # A share's `//host/...` (Linux reads it as `/...`), as a file: URL or a path, and a file: URL's relative path.
        ("file:////shared/runs", "checkpoint.remote=file://... names a host, which a path or a file:// URL cannot"),
        ("//shared/runs", "checkpoint.remote=... names a host, which a path or a file:// URL cannot reach"),
        ("\\\\shared\\runs", "checkpoint.remote=... names a host, which a path or a file:// URL cannot reach"),
        ("file:runs", "checkpoint.remote=... names no absolute path (file:///<path> is a mounted folder's)"),
    ],
)
def test_a_url_of_no_store_is_refused_in_one_line_and_never_becomes_a_local_folder(url, said, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError) as refused:
        Store(url)
    assert str(refused.value).startswith(f"{said}") and "; give s3://<bucket>/<folder>, " in str(refused.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "url", ["ｓ3://bkt/runs", "ｓ3:/bkt/runs", "file:runs", "//{here}/runs", "file:////{here}/runs"]
)
def test_a_run_given_a_url_that_would_be_a_folder_on_its_own_disk_is_refused_in_one_line(bare_project, url):
    """Each was a folder the run mirrored into without a word: `./ｓ3:/bkt/runs`, `./runs`, and
    `<project>/runs` for a share's `//<host>/...` (here the project's path, which Linux reads so)."""
    project = bare_project  # a refused run writes nothing, a store neither
    url = url.format(here=str(project).lstrip("/"))
    refused = run_cli(project, "device=cpu", "trainer.max_steps=2", f"checkpoint.remote={url}")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: checkpoint.remote=") and "; give s3://<bucket>/" in refused.stderr
    assert sorted(path.name for path in project.iterdir()) == ["configs", "eval.py", "export.py", "run.py"]


@pytest.mark.parametrize(
    "command",
    [
        ["run.py", f"checkpoint.remote=s3://AKIAEXAMPLE:{SECRET}@bkt/runs"],
        ["eval.py", "checkpoint=last", f"checkpoint.remote='s3://bkt/runs?X-Amz-Signature={SECRET}'"],
        ["export.py", "checkpoint=last", f"checkpoint.remote=s3://{SECRET}@bkt/runs"],
        ["run.py", "-m", f"checkpoint.remote=s3://bkt/a,s3://AKIAEXAMPLE:{SECRET}@bkt/b"],  # one of a sweep's
        ["run.py", f"checkpoint.remote=s3://bkt/runs#{SECRET}"],  # unquoted: Hydra's parser would print it whole
        ["run.py", "-m", f"checkpoint.remote=s3://bkt/a,s3://bkt/b#{SECRET}"],
        ["run.py", f"checkpoint.remote=simplecache::s3://bkt/runs::AKIAEXAMPLE:{SECRET}"],
        ["run.py", f"checkpoint.remote=s3://AKIAEXAMPLE:{SECRET}@bkt/runs", "--cfg", "job"],  # Hydra would print it
        # The key as Hydra may also read it: each of these, not refused, reached Hydra and was printed whole.
        ["run.py", f"checkpoint.remote@_global_=s3://AKIAEXAMPLE:{SECRET}@bkt/runs"],
        ["run.py", f"checkpoint/remote=s3://AKIAEXAMPLE:{SECRET}@bkt/runs"],
        ["eval.py", "checkpoint=last", f"++checkpoint/remote=s3://AKIAEXAMPLE:{SECRET}@bkt/runs"],
        ["export.py", "checkpoint=last", f"+checkpoint.remote@pkg=s3://AKIAEXAMPLE:{SECRET}@bkt/runs"],
        ["run.py", f"~checkpoint/remote=s3://AKIAEXAMPLE:{SECRET}@bkt/runs"],
        ["run.py", "-m", f"hydra.sweeper.params.checkpoint.remote=s3://bkt/a,s3://AKIAEXAMPLE:{SECRET}@bkt/b"],
        ["run.py", "-m", "hydra.sweeper.params={checkpoint.remote:'s3://AKIAEXAMPLE:" + SECRET + "@bkt/b'}"],
    ],
    ids=["run", "eval", "export", "sweep", "fragment", "sweep-fragment", "chain", "cfg"]
    + ["package", "slash", "plus-slash", "plus-package", "tilde-slash", "sweeper-param", "sweeper-params"],
)
def test_a_typed_url_with_a_credential_is_refused_before_hydra_prints_or_writes_the_command_line(bare_project, command):
    script, *overrides = command
    refused = run_cli(bare_project, *overrides, script=script)
    assert_refused_without_a_trace(refused, bare_project)


def assert_refused_without_a_trace(refused: subprocess.CompletedProcess, project: Path) -> None:
    """Refused in one line that repeats none of the URL, before Hydra prints anything or writes a file
    (the launcher's `#0 : ...` lines, multirun.yaml, a job's .hydra/)."""
    assert refused.returncode == 2, refused.stderr
    said = refused.stdout + refused.stderr
    assert said.startswith("error: checkpoint.remote=") and said.count("\n") == 1, said
    assert SECRET not in said and "AKIAEXAMPLE" not in said
    assert sorted(path.name for path in project.iterdir()) == ["configs", "eval.py", "export.py", "run.py"]
    assert [path for path in project.rglob("*") if path.is_file() and SECRET.encode() in path.read_bytes()] in (
        [],
        [project / "configs" / "config.yaml"],
        [project / "configs" / "experiment" / "keyed.yaml"],
        [project / "configs" / "checkpoint" / "keyed.yaml"],
    )  # the test's own


KEYED = f"s3://bkt/a,s3://AKIAEXAMPLE:{SECRET}@bkt/b"


@pytest.mark.parametrize("where", ["experiment", "config.yaml", "config.yaml, not a sweep"])
def test_a_keyed_url_a_config_lists_for_a_sweep_is_refused_before_hydra_prints_or_writes_it(bare_project, where):
    """`hydra.sweeper.params`, in an experiment or the project's config.yaml: the launcher prints each
    job's overrides and writes them to multirun.yaml and the job's .hydra/; a run that is no sweep
    writes them to .hydra/hydra.yaml."""
    project = bare_project  # a refused run writes nothing, a store neither
    params = f"  sweeper:\n    params:\n      checkpoint.remote: {KEYED}\n"
    if where == "experiment":
        (project / "configs" / "experiment" / "keyed.yaml").write_text(f"# @package _global_\nhydra:\n{params}")
        overrides = ["-m", "experiment=keyed"]
    else:
        config = project / "configs" / "config.yaml"
        config.write_text(config.read_text().replace("hydra:\n", f"hydra:\n{params}"))
        overrides = [] if where.endswith("not a sweep") else ["-m"]
    assert_refused_without_a_trace(run_cli(project, *overrides, "trainer.max_steps=2"), project)


@pytest.mark.parametrize(
    "where, swept",
    [
        ("checkpoint/keyed.yaml", ["checkpoint=unset,keyed"]),  # an option whose URL does not resolve first
        ("experiment/keyed.yaml", ["experiment=cnn_digits,keyed"]),
        ("checkpoint/keyed.yaml", []),  # config.yaml's hydra.sweeper.params choose the options
    ],
    ids=["typed-group", "typed-experiment", "sweeper-params-group"],
)
def test_a_keyed_url_in_an_option_a_sweep_chooses_is_refused_before_any_job_writes_its_config(
    bare_project, where, swept
):
    """A sweep over a config group composes each job's config in the job, which writes it whole to
    its .hydra/ (config.yaml, hydra.yaml) before it starts: the job refused the URL, the file held it."""
    project = bare_project  # a refused run writes nothing, a store neither
    option = project / "configs" / where
    option.parent.mkdir(exist_ok=True)
    if where.startswith("experiment"):
        option.write_text(f"# @package _global_\nhydra:\n  sweeper:\n    params:\n      checkpoint.remote: {KEYED}\n")
    else:
        option.write_text(f"defaults:\n  - default\nremote: {KEYED.partition(',')[2]}\n")
        option.with_name("unset.yaml").write_text("defaults:\n  - default\nremote: ${oc.env:T_REMOTE_UNSET}\n")
    if not swept:
        config = project / "configs" / "config.yaml"
        params = "  sweeper:\n    params:\n      checkpoint: default,keyed\n"
        config.write_text(config.read_text().replace("hydra:\n", f"hydra:\n{params}"))
    assert_refused_without_a_trace(run_cli(project, "-m", *swept, "trainer.max_steps=2"), project)


# --- the store ----------------------------------------------------------------------------------


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_call_to_a_server_that_stopped_answering_fails_within_its_deadline_and_works_once_it_answers(
    bucket, s3_server
):
    remote, s3 = bucket
    store = Store(remote, deadline_s=2)
    with s3_server.paused():
        began = time.monotonic()
        with pytest.raises(StoreError) as failed:
            store.put_bytes("demo/x", b"1")  # s3fs alone waits for ever on a PUT to a stopped server
        took = time.monotonic() - began
    assert failed.value.transient and "no answer within 2 s" in str(failed.value)
    assert took < 20, took  # unbounded, it waits for good: 20 s leaves a busy machine its slowness
    store.put_bytes("demo/x", b"2", within=60)  # its own deadline: the server answers the held PUT first
    assert keys(s3, remote) == {"x"}


def test_conditional_writes_make_an_object_once_and_replace_only_the_version_read(bucket):
    remote, s3 = bucket
    store = store_of(remote)
    first = store.put_bytes("demo/claim.json", b"1", create=True)
    with pytest.raises(Conflict):
        store.put_bytes("demo/claim.json", b"2", create=True)
    second = store.put_bytes("demo/claim.json", b"3", if_match=first)
    with pytest.raises(Conflict):
        store.put_bytes("demo/claim.json", b"4", if_match=first)
    read = store.read("demo/claim.json")
    assert (read.data, read.etag) == (b"3", second) and 0 <= read.age_s < 60


def test_a_missing_bucket_is_a_store_error_that_names_it_and_no_retry_will_fix(s3_env):
    with pytest.raises(StoreError, match=r"^s3://t-nobucket-here/runs/demo/x: the bucket does not exist$") as failed:
        store_of("s3://t-nobucket-here/runs").put_bytes("demo/x", b"1")
    assert not failed.value.transient


def test_a_copy_into_a_mounted_folder_that_fails_midway_leaves_nothing_under_its_name(tmp_path, monkeypatch):
    source = tmp_path / "big.bin"
    source.write_bytes(bytes(1000))
    store = Store(str(tmp_path / "remote"))
    real = __import__("shutil").copyfileobj

    def half_then_fail(reader, writer, length=0):
        writer.write(reader.read(500))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("shutil.copyfileobj", half_then_fail)
    with pytest.raises(StoreError, match="No space left on device"):
        store.put_file(source, "demo/big.bin")
    assert sorted(p.name for p in (tmp_path / "remote" / "demo").iterdir()) == []
    monkeypatch.setattr("shutil.copyfileobj", real)
    store.put_file(source, "demo/big.bin")
    assert store.list("demo") == {"big.bin": 1000}


# --- the mirror ---------------------------------------------------------------------------------


# The S3 case in the all tier: the daily loop runs each test's logic on a mounted folder.
@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.slow), "folder"])
def remote(request, tmp_path) -> str:
    """The remote folder: a bucket's, or a mounted folder's path."""
    if request.param == "folder":
        return str(tmp_path / "mounted")
    return request.getfixturevalue("bucket")[0]


def listed(remote: str) -> set[str]:
    return set(store_of(remote).list(RUN))


def test_each_checkpoint_is_uploaded_with_its_manifest_last_and_the_home_beside_it(remote, tmp_path):
    home, store = tmp_path / "home", store_of(remote)
    order = []
    real_put_file, real_put_bytes = store.put_file, store.put_bytes
    store.put_file = lambda local, key: (order.append(key), real_put_file(local, key))[1]
    store.put_bytes = lambda key, data, **conditions: (order.append(key), real_put_bytes(key, data, **conditions))[1]
    mirror = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20):
        save(mirror, home, step, keep_last=3)
        assert mirror.wait_for(step, 30)
    (home / "goodput.json").write_text('{"legs": []}')
    said = mirror.settle(30)
    assert said.startswith(f"remote: step_00000020.pt is in {store.url}/{RUN} (uploaded ")
    assert listed(remote) >= {
        "step_00000010.pt", "step_00000020.pt", "committed/step_00000010.json", "committed/step_00000020.json",
        "latest", "goodput.json",
    }  # fmt: skip
    for step in (10, 20):  # each checkpoint's objects, then its manifest
        name = f"step_{step:08d}.pt"
        assert order.index(f"{RUN}/{name}") < order.index(f"{RUN}/committed/step_{step:08d}.json")
        described = json.loads(store.get_bytes(f"{RUN}/committed/step_{step:08d}.json"))
        assert described["seal"] == onefile.seal(home / name)
        assert described["files"] == {name: (home / name).stat().st_size}
    assert store.get_bytes(f"{RUN}/latest") == b"step_00000020.pt"
    assert store.get_bytes(f"{RUN}/goodput.json") == b'{"legs": []}'


def test_retention_prunes_the_remote_copies_of_what_it_pruned_and_nothing_it_did_not_write(remote, tmp_path):
    home, store = tmp_path / "home", store_of(remote)
    store.put_bytes(f"{RUN}/notes.txt", b"mine")
    stray = tmp_path / "stray.pt"
    onefile.write(state(5), stray)
    store.put_file(stray, f"{RUN}/step_00000005.pt")  # a checkpoint without a manifest: not this run's to delete
    mirror = Mirror(store, RUN, home, keep_last=2, leg="leg-1", known={})
    for step in range(10, 60, 10):
        save(mirror, home, step, keep_last=2)
        assert mirror.wait_for(step, 30)
    mirror.settle(30)
    assert sorted(path.name for _, path in homes.steps(home)) == ["step_00000040.pt", "step_00000050.pt"]
    checkpoints = {key for key in listed(remote) if key.startswith(("step_", "committed/"))}
    assert checkpoints == {
        "step_00000005.pt", "step_00000040.pt", "step_00000050.pt",
        "committed/step_00000040.json", "committed/step_00000050.json",
    }  # fmt: skip
    assert store.get_bytes(f"{RUN}/notes.txt") == b"mine"


def test_retention_of_folder_checkpoints_in_a_mounted_folder_leaves_no_empty_folder_but_keeps_foreign_files(tmp_path):
    home, mounted = tmp_path / "home", tmp_path / "mounted"
    mirror = Mirror(Store(str(mounted)), RUN, home, keep_last=1, leg="leg-1", known={})
    for step in (10, 20, 30):
        folder = homes.path_of(home, step, folder=True)
        folder.mkdir(parents=True)
        onefile.write(state(step), folder / "state.pt")
        (folder / "__0_0.distcp").write_bytes(bytes(step))
        homes.completed(folder, keep_last=1)
        mirror.landed(folder)
        assert mirror.wait_for(step, 30)
        if step == 10:
            (mounted / RUN / "step_00000010" / "notes.txt").write_text("mine")
    mirror.settle(30)
    assert sorted(path.name for path in (mounted / RUN).iterdir() if path.name.startswith("step_")) == [
        "step_00000010", "step_00000030"
    ]  # fmt: skip
    assert [path.name for path in (mounted / RUN / "step_00000010").iterdir()] == ["notes.txt"]
    assert sorted(path.name for path in (mounted / RUN / "step_00000030").iterdir()) == ["__0_0.distcp", "state.pt"]


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_while_the_store_is_down_training_saves_on_local_copies_wait_and_the_uploads_arrive_after(
    bucket, s3_server, tmp_path, caplog
):
    remote, s3 = bucket
    home, store = tmp_path / "home", Store(remote, deadline_s=1)
    mirror = Mirror(store, RUN, home, keep_last=1, leg="leg-1", known={})
    outlasts_a_pause = 2 * MOST_PAUSE_S + 30  # a call slower than 1 s on a busy machine doubles the mirror's pause
    save(mirror, home, 10, keep_last=1)
    assert mirror.wait_for(10, outlasts_a_pause)
    with s3_server.paused():
        for step in (20, 30, 40):
            save(mirror, home, step, keep_last=1)  # each returns at once: no save waits for the store
        # keep_last=1, yet none goes before a copy remote covers it (step 10's is remote: it went)
        assert sorted(step for step, _ in homes.steps(home)) == [20, 30, 40]
        assert not mirror.wait_for(40, 1.5)
    assert mirror.wait_for(40, outlasts_a_pause)
    said = mirror.settle(30)
    assert said.startswith("remote: step_00000040.pt is in ")
    assert sorted(step for step, _ in homes.steps(home)) == [40], "released once the newest is remote"
    assert {key for key in keys(s3, remote) if key.startswith("committed/")} == {"committed/step_00000040.json"}
    # From two threads: the disk's warning once; the store's once an outage (a call slower than its
    # deadline on a loaded machine, before the pause, is one more).
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    crowded = (
        f"2 checkpoints wait for {store.url}/{RUN}, more than checkpoint.keep_last=1: the home keeps each until a "
        "newer one is remote"
    )
    outages = [line for line in warned if line.endswith("training goes on, and uploads are retried")]
    assert warned.count(crowded) == 1 and outages and len(warned) == 1 + len(outages), warned


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_stop_with_the_store_down_waits_only_its_bound_and_says_what_is_not_remote(bucket, s3_server, tmp_path):
    remote, _ = bucket
    home, store = tmp_path / "home", Store(remote, deadline_s=30)
    mirror = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    save(mirror, home, 10, keep_last=3)
    assert mirror.wait_for(10, 30)
    with s3_server.paused():
        save(mirror, home, 20, keep_last=3)
        began = time.monotonic()
        said = mirror.settle(1.5)
        took = time.monotonic() - began
    assert 1.4 < took < 15, took  # the store's own deadline (30 s) would take twice the upper bound
    assert said == (
        f"remote: step_00000020.pt is not in {store.url}/{RUN} within checkpoint.remote_wait_s=1.5 (still uploading); "
        f"the newest checkpoint there is step_00000010.pt, and step_00000020.pt stays in {home}"
    )


# --- a new machine ------------------------------------------------------------------------------


def test_a_new_machine_fetches_the_newest_checkpoint_that_checks_and_the_runs_account(remote, tmp_path, caplog):
    home, store = tmp_path / "home", store_of(remote)
    mirror = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20, 30):
        save(mirror, home, step, keep_last=3)
        assert mirror.wait_for(step, 30)
    (home / "goodput.json").write_text('{"legs": []}')
    mirror.settle(30)
    damaged = tmp_path / "damaged.pt"
    data = bytearray((home / "step_00000030.pt").read_bytes())
    data[len(data) // 2] ^= 1  # a flipped bit, the same size
    damaged.write_bytes(bytes(data))
    store.put_file(damaged, f"{RUN}/step_00000030.pt")
    store.delete(f"{RUN}/step_00000020.pt")  # gone: its manifest names an object that is not there

    elsewhere = tmp_path / "new-machine"
    elsewhere.mkdir()
    fetched = fetch(store, RUN, elsewhere, manifest.committed(store, RUN))
    assert fetched == elsewhere / "step_00000010.pt"
    assert newest_valid(elsewhere).state["step"] == 10
    assert (elsewhere / "goodput.json").read_text() == '{"legs": []}'
    assert (elsewhere / "latest").read_text() == "step_00000010.pt"
    assert sorted(path.name for path in elsewhere.iterdir()) == ["goodput.json", "latest", "step_00000010.pt"]
    warned = " | ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert (
        f"skipping {store.url}/{RUN}/step_00000030.pt: step_00000030.pt is damaged: its content no longer matches the "
        "checksum written at save; falling back to an older one"
    ) in warned
    assert "its object step_00000020.pt is missing or of another size" in warned


def held(home: Path, remote: str, resume: str | None, wait_s: float = 5, lease_s: float = 60):
    """remote_run.held, as the recipe enters it, for a run of `home` and `remote`."""
    settings = {"dir": str(home), "remote": remote, "remote_wait_s": wait_s, "remote_lease_s": lease_s}
    return remote_run.held(OmegaConf.create({"name": RUN, "resume": resume, "checkpoint": settings}), swept=False)


def test_a_machine_back_with_a_home_older_than_the_remote_continues_from_the_remote(remote, tmp_path):
    home, store = tmp_path / "home", store_of(remote)
    mirror = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20, 30):
        save(mirror, home, step, keep_last=3)
    mirror.settle(30)
    back = tmp_path / "back"
    onefile.save(state(10), back, keep_last=3)  # what its disk held when it was preempted
    with held(back, remote, "auto"):
        assert sorted(step for step, _ in homes.steps(back)) == [10, 30]
    assert newest_valid(back).step == 30


def test_the_multipart_uploads_an_earlier_leg_left_incomplete_are_aborted_and_no_others(bucket, tmp_path):
    remote, s3 = bucket
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    for key in (f"{prefix}/{RUN}/step_00000020.pt", f"{prefix}/other/step_00000020.pt"):
        upload = s3.create_multipart_upload(Bucket=bucket_name, Key=key)
        s3.upload_part(Bucket=bucket_name, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1000)
    with held(tmp_path / "home", remote, "auto"):
        pass
    left = s3.list_multipart_uploads(Bucket=bucket_name).get("Uploads", [])
    assert [upload["Key"] for upload in left] == [f"{prefix}/other/step_00000020.pt"]


@pytest.mark.parametrize("kind", ["s3", "folder"])
def test_a_run_aborts_its_own_incomplete_uploads_and_none_of_a_run_named_under_it(kind, request, tmp_path, caplog):
    """`name=demo/b` lives under `demo/`: while it uploads, `demo` starting aborts none of its uploads."""
    caplog.set_level(logging.INFO)
    own = ["step_00000030/__0_0.distcp", "committed/step_00000030.json", "set-aside-20260101-000000-after-step-10/x.pt"]
    nested = ["b/step_00000020.pt", "b/step_00000030/__0_0.distcp", "b/c/step_00000020.pt"]
    if kind == "folder":
        remote = str(tmp_path / "mounted")
        for key in own + nested:  # a copy in flight: files.temporary's name beside the object's
            (path := tmp_path / "mounted" / RUN / f"{key}.4711-0a1b2c3d.tmp").parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x")
    else:
        remote, s3 = request.getfixturevalue("bucket")
        bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
        for key in own + nested:
            upload = s3.create_multipart_upload(Bucket=bucket_name, Key=f"{prefix}/{RUN}/{key}")
            s3.upload_part(
                Bucket=bucket_name, Key=f"{prefix}/{RUN}/{key}", UploadId=upload["UploadId"], PartNumber=1, Body=b"x"
            )
    with held(tmp_path / "home", remote, "auto"):
        pass
    if kind == "folder":
        left = sorted(
            path.relative_to(tmp_path / "mounted" / RUN).as_posix()
            for path in (tmp_path / "mounted" / RUN).rglob("*.tmp")
        )
        assert left == sorted(f"{key}.4711-0a1b2c3d.tmp" for key in nested)
    else:
        uploads = s3.list_multipart_uploads(Bucket=bucket_name).get("Uploads", [])
        assert sorted(upload["Key"] for upload in uploads) == sorted(f"{prefix}/{RUN}/{key}" for key in nested)
    assert f"aborted 3 upload(s) to {store_of(remote).url}/{RUN} that an earlier leg left incomplete" in caplog.text


@pytest.mark.parametrize(
    "name",
    [
        "demo/committed", "demo/step_00000030", "demo/set-aside-x/b",  # its folders: their objects taken for its own
        "demo/latest", "demo/goodput.json", "demo/run.lock",  # its files: in a mounted folder, never both
    ],
)  # fmt: skip
def test_a_run_named_like_a_folder_or_file_of_the_run_above_it_is_refused_before_the_store_is_asked(name, tmp_path):
    settings = {"dir": str(tmp_path / "home"), "remote": str(tmp_path / "m"), "remote_wait_s": 5, "remote_lease_s": 60}
    config = OmegaConf.create({"name": name, "resume": "auto", "checkpoint": settings})
    with pytest.raises(RunError) as refused, remote_run.held(config, swept=False):
        pass
    part = name.split("/")[1]
    assert str(refused.value) == (
        f"name={name}: {part} is a name that the run demo uses in its remote folder (its folders step_<N>/, "
        "committed/, set-aside-*/ and its files latest, best, scores.json, goodput.json, claim.json, run.lock), "
        "which would mix the two runs' objects; give the run another name"
    )
    assert not (tmp_path / "m").exists()


def test_a_resume_from_an_earlier_step_sets_the_newer_remote_checkpoints_aside_before_uploading(remote, tmp_path):
    home, store = tmp_path / "home", store_of(remote)
    first = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20, 30):
        save(first, home, step, keep_last=3)
    first.settle(30)
    second = Mirror(store, RUN, home, keep_last=3, leg="leg-2", known=manifest.committed(store, RUN))
    homes.set_aside_newer(home, 10)  # what a resume from step 10 does to the home
    save(second, home, 20, keep_last=3)  # the new line's step 20: not the abandoned one
    second.settle(30)
    assert sorted(manifest.committed(store, RUN)) == [10, 20]
    assert json.loads(store.get_bytes(f"{RUN}/committed/step_00000020.json"))["leg"] == "leg-2"
    aside = {key for key in store.list(RUN) if key.startswith("set-aside-")}
    folder = next(iter(aside)).split("/")[0]
    assert re.fullmatch(r"set-aside-\d{8}-\d{6}-after-step-10", folder)
    assert aside == {
        f"{folder}/{key}"
        for key in (
            "step_00000020.pt",
            "step_00000030.pt",
            "committed/step_00000020.json",
            "committed/step_00000030.json",
        )
    }
    moved = json.loads(store.get_bytes(f"{RUN}/{folder}/committed/step_00000030.json"))
    assert (
        moved["leg"] == "leg-1"
        and store.list(f"{RUN}/{folder}")["step_00000030.pt"] == moved["files"]["step_00000030.pt"]
    )


def test_a_newer_remote_checkpoint_whose_objects_are_gone_is_set_aside_once_and_the_uploads_go_on(
    remote, tmp_path, caplog
):
    home, store = tmp_path / "home", store_of(remote)
    first = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20):
        save(first, home, step, keep_last=3)
    first.settle(30)
    store.delete(f"{RUN}/step_00000020.pt")  # by hand, or a lifecycle rule
    forged = json.loads(store.get_bytes(f"{RUN}/committed/step_00000020.json"))
    forged |= {"step": 30, "files": {"step_00000030.pt": 1000}}  # a manifest naming an object never there
    store.put_bytes(f"{RUN}/committed/step_00000030.json", json.dumps(forged).encode())
    second = Mirror(store, RUN, home, keep_last=3, leg="leg-2", known=manifest.committed(store, RUN))
    homes.set_aside_newer(home, 10)  # what a resume from step 10 (the newest whole one) does to the home
    save(second, home, 20, keep_last=3)
    said = second.settle(30)
    assert said.startswith(f"remote: step_00000020.pt is in {store.url}/{RUN} (uploaded "), said
    assert sorted(manifest.committed(store, RUN)) == [10, 20]
    assert json.loads(store.get_bytes(f"{RUN}/committed/step_00000020.json"))["leg"] == "leg-2"
    aside = {key for key in store.list(RUN) if key.startswith("set-aside-")}
    folder = next(iter(aside)).split("/")[0]
    assert aside == {f"{folder}/committed/step_00000020.json", f"{folder}/committed/step_00000030.json"}
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"resuming from step 10: the newer checkpoints of {store.url}/{RUN} are moved to {folder}/ "
        "(step_00000020.pt, step_00000030.pt missing from the store: not moved)"
    ]


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_newer_remote_checkpoint_the_store_will_not_copy_is_set_aside_once_without_it_and_the_uploads_go_on(
    bucket, tmp_path, caplog
):
    """A lifecycle rule archived step 30's object (GLACIER: S3 refuses to copy it until restored):
    the set-aside's copy failed for good and was retried for the life of the run, so that no later
    checkpoint reached the store."""
    remote, s3 = bucket
    home, store = tmp_path / "home", store_of(remote)
    first = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20, 30):
        save(first, home, step, keep_last=3)
    first.settle(30)
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    archived = {"Bucket": bucket_name, "Key": f"{prefix}/{RUN}/step_00000030.pt"}
    s3.copy_object(**archived, CopySource=archived, StorageClass="GLACIER")  # what the lifecycle rule does
    second = Mirror(store, RUN, home, keep_last=3, leg="leg-2", known=manifest.committed(store, RUN))
    homes.set_aside_newer(home, 10)  # what a resume from step 10 does to the home
    second.resumed_at(10)
    save(second, home, 20, keep_last=3)
    said = second.settle(30)
    assert said.startswith(f"remote: step_00000020.pt is in {store.url}/{RUN} (uploaded "), said
    assert sorted(manifest.committed(store, RUN)) == [10, 20]
    aside = {key for key in store.list(RUN) if key.startswith("set-aside-")}
    folder = next(iter(aside)).split("/")[0]
    assert aside == {
        f"{folder}/{key}"
        for key in ("step_00000020.pt", "committed/step_00000020.json", "committed/step_00000030.json")
    }
    assert s3.head_object(**archived)["StorageClass"] == "GLACIER"  # left where it is, not deleted
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"resuming from step 10: the newer checkpoints of {store.url}/{RUN} are moved to {folder}/ "
        "(step_00000030.pt (ObjectNotInActiveTierError) refused by the store: not moved, left where it is)"
    ]


def test_a_resume_uploads_the_checkpoint_it_restored_where_the_leg_before_died_before_uploading_it(remote, tmp_path):
    home, store = tmp_path / "home", store_of(remote)
    first = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    save(first, home, 10, keep_last=3)
    first.settle(30)
    onefile.save(state(20), home, keep_last=3)  # saved; killed before its upload began
    second = Mirror(store, RUN, home, keep_last=3, leg="leg-2", known=manifest.committed(store, RUN))
    homes.set_aside_newer(home, 20)  # what a resume from step 20 does
    second.settle(30)
    assert sorted(manifest.committed(store, RUN)) == [10, 20]


def test_a_reader_of_a_run_by_name_fetches_its_newest_checkpoint_into_an_empty_home_only(remote, tmp_path):
    home, store = tmp_path / "home", store_of(remote)
    mirror = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20):
        save(mirror, home, step, keep_last=3)
    mirror.settle(30)
    cfg = OmegaConf.create({"checkpoint": {"remote": remote}})
    elsewhere = tmp_path / "elsewhere" / RUN
    assert remote_run.fetched_to_read(cfg, RUN, elsewhere) == elsewhere / "step_00000020.pt"
    assert remote_run.fetched_to_read(cfg, RUN, elsewhere) is None  # a home with checkpoints is read as it is
    assert remote_run.fetched_to_read(OmegaConf.create({"checkpoint": {"remote": None}}), RUN, tmp_path / "x") is None
    assert remote_run.fetched_to_read(cfg, "no-such-run", tmp_path / "y") is None  # a name no run has
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A filesystem of 512 KiB of its own (a tmpfs mounted for the test), to fill for real; the test is
    skipped where this user may not mount one (mounting needs root, or CAP_SYS_ADMIN)."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(folder)], capture_output=True)
    except FileNotFoundError:
        pytest.skip("no mount command here to make a small filesystem with")
    if mounted.returncode != 0:
        pytest.skip(f"this user may not mount a small filesystem to fill ({mounted.stderr.decode().strip()})")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def mirrored(remote: str, home: Path, floats: int) -> str:
    """Checkpoints of steps 10, 20 and 30 of a model of `floats` float32s, uploaded; its store's URL."""
    store = store_of(remote)
    mirror = Mirror(store, RUN, home, keep_last=3, leg="leg-1", known={})
    for step in (10, 20, 30):
        path = onefile.save({**state(step), "model": {"w": torch.full((floats,), float(step))}}, home, keep_last=3)
        mirror.landed(path)
    mirror.settle(30)
    return store.url


def test_a_reader_given_a_sweep_jobs_home_fetches_the_jobs_checkpoints_not_the_runs(remote, tmp_path):
    """A job's home (`checkpoints/<name>/<its overrides>`) mirrors to `<name>/<its overrides>`; read
    with `name=<name>`, the plain run's folder `<name>` would fill it with another model."""
    store, key = store_of(remote), "optimizer.lr=1e-3"
    for run, step in ((RUN, 10), (f"{RUN}/{key}", 20)):
        mirror = Mirror(store, run, tmp_path / run, keep_last=3, leg="leg-1", known={})
        save(mirror, tmp_path / run, step, keep_last=3)
        mirror.settle(30)
    cfg, elsewhere = OmegaConf.create({"checkpoint": {"remote": remote}}), tmp_path / "elsewhere"
    assert remote_run.fetched_to_read(cfg, RUN, elsewhere / RUN / key) == elsewhere / RUN / key / "step_00000020.pt"
    assert sorted(path.name for path in (elsewhere / RUN).glob("step_*")) == []  # the run's own: not fetched
    # A plain run's home of another name (checkpoint.dir=<a folder>) reads the run's.
    assert remote_run.fetched_to_read(cfg, RUN, elsewhere / "mine") == elsewhere / "mine" / "step_00000010.pt"


def test_a_fetch_into_a_disk_with_too_little_room_names_the_folder_and_the_room_not_the_store(
    remote, tmp_path, small_disk
):
    """The store's call failed on its write (`OSError: [Errno 28] No space left on device`), and the
    line blamed the store and its credentials."""
    url = mirrored(remote, tmp_path / "home", floats=2**18)  # 1 MiB a checkpoint, on a disk of 512 KiB
    home = small_disk / RUN
    with pytest.raises(SaveError) as refused, held(home, remote, "auto"):
        pass
    said = str(refused.value)
    assert re.fullmatch(
        rf"cannot fetch {re.escape(f'{url}/{RUN}/step_00000030.pt')} into {re.escape(str(home))}: it takes 1\.0\d* MiB, "
        r"and the disk there has 5\d\d KiB free; free space there, or choose a folder with room with "
        r"checkpoint\.dir=<path>, then run again",
        said,
    ), said
    assert list(small_disk.iterdir()) == []  # nothing fetched, nothing half-made, the home the claim made gone


@pytest.mark.parametrize("for_a_moment", [False, True], ids=["filled", "full-for-a-moment"])
def test_a_disk_that_fills_while_a_fetch_writes_is_named_with_the_room_and_nothing_half_made_stays(
    remote, tmp_path, small_disk, monkeypatch, for_a_moment
):
    """Another writer fills the disk once the fetch has found room: its write fails midway. Its file
    stays, or is gone once the write failed (a temporary one): either way the line says the disk's
    room (judged by the write's ENOSPC), not the store's failure."""
    url = mirrored(remote, tmp_path / "home", floats=2**16)  # 256 KiB a checkpoint
    home, other = small_disk / RUN, small_disk / "another-writers-file"
    real_get_file = Store.get_file

    def filled(store, key, local, size):
        with open(other, "wb") as file:
            file.write(bytes(shutil.disk_usage(small_disk).free - 64 * 1024))  # 64 KiB left
        try:
            real_get_file(store, key, local, size)
        finally:
            if for_a_moment:
                other.unlink()

    monkeypatch.setattr(Store, "get_file", filled)
    with pytest.raises(SaveError) as refused, held(home, remote, "auto"):
        pass
    said = str(refused.value)
    room = r"\d+ KiB" if for_a_moment else r"6\d KiB"  # what is free once the write failed
    assert re.fullmatch(
        rf"cannot fetch {re.escape(f'{url}/{RUN}/step_00000030.pt')} into {re.escape(str(home))}: it takes 25\d KiB, "
        rf"and the disk there has {room} free; free space there, or choose a folder with room with "
        r"checkpoint\.dir=<path>, then run again",
        said,
    ), said
    assert list(small_disk.iterdir()) == ([] if for_a_moment else [other])


def mirrored_with_the_rest(remote: str, home: Path, best: str) -> str:
    """`mirrored`'s three checkpoints of 256 KiB, with the run's goodput account and `best` naming `best`."""
    home.mkdir(parents=True)
    (home / "goodput.json").write_text('{"legs": []}')
    (home / "best").write_text(best)
    return mirrored(remote, home, floats=2**16)


def assert_fetched_whole(home: Path, remote: str, names: list[str]) -> None:
    """Once the disk has room, the same start fetches the checkpoints `names` and the rest of the home."""
    with held(home, remote, "auto"):
        pass
    assert sorted(path.name for _, path in homes.steps(home)) == names
    assert (home / "goodput.json").read_text() == '{"legs": []}' and (home / "latest").read_text() == names[-1]


def test_a_disk_that_fills_once_a_fetch_has_its_checkpoint_keeps_none_of_it_and_says_the_room(
    remote, tmp_path, small_disk, monkeypatch
):
    """The account and pointer that follow the checkpoint found no room: the write's OSError was a
    traceback, and the checkpoint stayed, so that the next start fetched no more: no account."""
    url = mirrored_with_the_rest(remote, tmp_path / "home", best="step_00000030.pt")
    home, other = small_disk / RUN, small_disk / "another-writers-file"
    real_get_file = Store.get_file

    def then_filled(store, key, local, size):
        real_get_file(store, key, local, size)
        other.write_bytes(bytes(shutil.disk_usage(small_disk).free))

    monkeypatch.setattr(Store, "get_file", then_filled)
    with pytest.raises(SaveError) as refused, held(home, remote, "auto"):
        pass
    assert re.fullmatch(
        rf"cannot fetch {re.escape(f'{url}/{RUN}/step_00000030.pt')} and the rest of the run's home into "
        rf"{re.escape(str(home))}: it takes 25\d KiB, and the disk there has 2\d\d KiB free; free space there, or "
        r"choose a folder with room with checkpoint\.dir=<path>, then run again",
        str(refused.value),
    ), refused.value
    assert list(small_disk.iterdir()) == [other]  # the home the claim made gone with the checkpoint
    other.unlink()
    monkeypatch.setattr(Store, "get_file", real_get_file)
    assert_fetched_whole(home, remote, ["step_00000030.pt"])


def test_a_disk_with_room_for_the_newest_checkpoint_but_not_best_keeps_neither_and_says_the_room_of_both(
    remote, tmp_path, small_disk
):
    """The newest checkpoint stayed, `best`'s was refused: the next start, the disk grown, fetched no
    more, and the remote's retention, going by the home, later deleted the run's best checkpoint."""
    url = mirrored_with_the_rest(remote, tmp_path / "home", best="step_00000010.pt")
    home = small_disk / RUN
    with pytest.raises(SaveError) as refused, held(home, remote, "auto"):
        pass
    assert re.fullmatch(
        rf"cannot fetch {re.escape(f'{url}/{RUN}/step_00000030.pt')} and the rest of the run's home into "
        rf"{re.escape(str(home))}: it takes 51\d KiB, and the disk there has 5\d\d KiB free; free space there, or "
        r"choose a folder with room with checkpoint\.dir=<path>, then run again",
        str(refused.value),
    ), refused.value
    assert list(small_disk.iterdir()) == []
    subprocess.run(["mount", "-o", "remount,size=1m", str(small_disk)], check=True)
    assert_fetched_whole(home, remote, ["step_00000010.pt", "step_00000030.pt"])


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_store_that_stops_answering_once_a_fetch_has_its_checkpoint_leaves_none_of_it(
    bucket, s3_server, tmp_path, monkeypatch
):
    """The checkpoint stayed without the account that follows it: the next start, the store back,
    found the newest checkpoint in its home and fetched no more."""
    remote, _ = bucket
    mirrored_with_the_rest(remote, tmp_path / "home", best="step_00000030.pt")
    home, store = tmp_path / "new-machine", Store(remote, deadline_s=2)
    real_get_file, outage = Store.get_file, contextlib.ExitStack()

    def then_down(store, key, local, size):
        real_get_file(store, key, local, size)
        outage.enter_context(s3_server.paused())

    monkeypatch.setattr(Store, "get_file", then_down)
    home.mkdir()
    with outage, pytest.raises(StoreError, match="no answer within 2 s"):
        fetch(store, RUN, home, manifest.committed(store_of(remote), RUN))
    assert list(home.iterdir()) == []
    monkeypatch.setattr(Store, "get_file", real_get_file)
    assert_fetched_whole(home, remote, ["step_00000030.pt"])


def test_the_copies_a_kill_left_half_made_in_a_mounted_folder_are_removed_and_nothing_else(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    run = tmp_path / "mounted" / RUN
    (run / "step_00000020").mkdir(parents=True)
    left = [run / "step_00000020" / "__0_0.distcp.4711-0a1b2c3d.tmp", run / "committed.4711-0a1b2c3d.tmp"]
    kept = [run / "step_00000020" / "notes.tmp", run / "step_00000010.pt"]
    for path in left + kept:
        path.write_bytes(b"x")
    with held(tmp_path / "home", str(tmp_path / "mounted"), "auto"):
        pass
    assert [path.exists() for path in left + kept] == [False, False, True, True]
    assert f"aborted 2 upload(s) to {run} that an earlier leg left incomplete" in caplog.text


def test_resume_last_with_no_checkpoint_here_or_there_is_refused_naming_both(remote, tmp_path):
    home = tmp_path / "home"
    with pytest.raises(RunError) as refused, held(home, remote, "last"):
        pass
    assert str(refused.value) == (
        f"resume=last found no valid checkpoint in {home} nor in {store_of(remote).url}/{RUN}; train without resume "
        "first, or pass resume=auto to start fresh when there is none"
    )


@pytest.mark.parametrize(
    "wait_s, lease_s, said",
    [
        (-1, 60, "checkpoint.remote_wait_s=-1 must be 0 or more: the seconds a run's end waits for its newest "
         "checkpoint to be remote"),
        *[(25, lease_s, f"checkpoint.remote_lease_s={lease_s} must be more than 0 and at most 3600 (seconds): no "
           "machine reads a claim of a longer lease") for lease_s in (0, 3601, 7200)],
    ],
)  # fmt: skip
def test_a_wait_or_lease_out_of_range_is_refused_in_one_line_before_the_store_is_asked(tmp_path, wait_s, lease_s, said):
    with pytest.raises(RunError) as refused, held(tmp_path / "home", str(tmp_path / "m"), "auto", wait_s, lease_s):
        pass
    assert str(refused.value) == said
    assert not (tmp_path / "m").exists()


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_mounted_folder_is_held_by_its_lock_and_is_never_the_home_itself(tmp_path):
    mounted = tmp_path / "mounted"
    holder = hold(mounted / RUN)
    try:
        with (
            pytest.raises(RunError, match=rf"^{mounted / RUN} is in use by PID {holder.pid} on "),
            held(tmp_path / "home", str(mounted), "auto"),
        ):
            pass
    finally:
        holder.kill()
        holder.wait()
    with (
        pytest.raises(RunError, match=r"holds the run's home .*, or lies in it: give a folder elsewhere"),
        held(mounted / RUN, str(mounted), "auto"),
    ):
        pass


def test_a_manifest_from_elsewhere_is_read_as_data():
    good = {
        "format": 1, "run": RUN, "step": 10, "kind": "file", "seal": "crc32c:0123abcd",
        "files": {"step_00000010.pt": 5}, "leg": "x", "written": "now",
    }  # fmt: skip
    assert manifest.parse(json.dumps(good).encode(), RUN, 10) == good
    assert manifest.parse(json.dumps(good).encode(), "other", 10) == f"is not the manifest of step 10 of {'other'!r}"
    escape = {**good, "kind": "folder", "files": {"../../etc/passwd": 5, "state.pt": 1}}
    assert manifest.parse(json.dumps(escape).encode(), RUN, 10) == "names files outside its checkpoint"
    assert manifest.parse(b"[" * 100_000, RUN, 10) == "is not JSON"
    assert manifest.parse(bytes(2**20 + 1), RUN, 10) == f"is larger than {2**20} bytes"


# --- one machine at a time ----------------------------------------------------------------------


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_second_machine_is_refused_naming_the_first_and_takes_over_once_its_lease_ran_out(bucket, tmp_path, caplog):
    remote, _ = bucket
    store = store_of(remote)
    first = RemoteClaim(store, RUN, tmp_path / "a", lease_s=3)  # the store's clock says whole seconds
    first.take()
    first._ended.set()  # its renewals stop, as a machine taken away stops renewing
    second = RemoteClaim(store, RUN, tmp_path / "b", lease_s=60)
    with pytest.raises(RunError) as refused:
        second.take()
    assert re.fullmatch(
        rf"{store.url}/{RUN} is in use by PID {os.getpid()} on \S+ \(home {tmp_path / 'a'}\) \(lease renewed \d+ s "
        rf"ago, runs out in -?\d+ s\); wait for that run to end \(or stop it\), or train separately with "
        rf"name=<another name>",
        str(refused.value),
    ), refused.value
    deadline = time.monotonic() + 30
    while store.read(f"{RUN}/claim.json").age_s <= 3:  # the lease runs out by the store's clock
        assert time.monotonic() < deadline
        time.sleep(0.1)
    second.take()
    assert any("took over" in r.getMessage() and "whose lease ran out" in r.getMessage() for r in caplog.records)
    with pytest.raises(Lost, match=rf"^lost the claim on {re.escape(store.url)}/{RUN} to PID \d+ on \S+ \(home "):
        first.renew()
    second.release()
    third = RemoteClaim(store, RUN, tmp_path / "c", lease_s=60)
    third.take()  # released: taken at once
    third.release()


def test_a_claim_whose_holder_was_a_process_of_this_machine_that_ended_is_taken_over_at_once(bucket, tmp_path, caplog):
    remote, s3 = bucket
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(ended.stdout)
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    left = {"holder": f"PID {pid} on {os.uname().nodename}", "pid": pid, "host": os.uname().nodename, "home": "/a"}
    left |= {"pid_space": pid_space(), "leg": "a", "started": "", "lease_s": 3600, "released": False}
    s3.put_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json", Body=json.dumps(left).encode())
    claimed = RemoteClaim(store_of(remote), RUN, tmp_path / "home", lease_s=60)
    claimed.take()
    claimed.release()
    assert any(
        r.getMessage().endswith(f"from PID {pid} on {os.uname().nodename} (home /a), which ended")
        for r in caplog.records
    )


@pytest.mark.parametrize("other", ["another boot", "another PID namespace"])
def test_a_holder_of_this_host_name_on_another_machine_or_container_is_not_taken_for_one_that_ended(
    bucket, tmp_path, other
):
    """VMs made from one image share a host name; containers with the host's network take the
    host's: the holder's PID, not found here, says nothing of whether it lives."""
    remote, s3 = bucket
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    boot, namespace = pid_space().split(" ")
    elsewhere = f"{boot} pid:[1]" if other == "another PID namespace" else f"{uuid.uuid4()} {namespace}"
    put_claim(s3, remote, lease_s=3600, host=socket.gethostname(), pid=int(ended.stdout), pid_space=elsewhere)
    with pytest.raises(RunError, match=rf"^{re.escape(Store(remote).url)}/{RUN} is in use by PID 1 on "):
        RemoteClaim(store_of(remote), RUN, tmp_path / "home", lease_s=60).take()
    assert claim_of(s3, remote)["leg"] == "b"


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_renewal_that_landed_though_its_answer_never_came_is_no_lost_claim(bucket, tmp_path):
    remote, s3 = bucket
    claimed = RemoteClaim(store_of(remote), RUN, tmp_path / "home", lease_s=600)
    claimed.take()
    # A renewal the store applied, whose answer (its new ETag) a timeout kept from this machine.
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    found = s3.get_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json")["Body"].read()
    s3.put_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json", Body=found + b" ")
    claimed.renew()
    assert claimed.lost is None
    claimed.renew()  # with the version it learned
    claimed.release()


def test_a_release_after_a_takeover_leaves_the_new_holders_claim_and_says_it_was_lost(bucket, tmp_path, caplog):
    remote, s3 = bucket
    store = store_of(remote)
    claimed = RemoteClaim(store, RUN, tmp_path / "home", lease_s=600)
    claimed.take()
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    found = s3.get_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json")["Body"].read()
    s3.put_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json", Body=found + b" ")  # a renewal unanswered
    claimed.release()
    assert claim_of(s3, remote)["released"], "this machine's own, at a version it never heard of"
    claimed = RemoteClaim(store, RUN, tmp_path / "home", lease_s=600)
    claimed.take()
    put_claim(s3, remote, lease_s=60)  # taken over since the last renewal (its lease ran out in an outage)
    claimed.release()
    assert claim_of(s3, remote)["leg"] == "b" and not claim_of(s3, remote)["released"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"lost the claim on {store.url}/{RUN} to PID 1 on host-b (home /b) before this run's end"
    ]


def test_a_machine_whose_claim_another_took_publishes_no_manifest(bucket, tmp_path):
    remote, s3 = bucket
    store, home = store_of(remote), tmp_path / "home"
    claimed = RemoteClaim(store, RUN, home, lease_s=60)
    claimed.take()
    mirror = Mirror(store, RUN, home, keep_last=3, leg=claimed.leg, known={}, fence=claimed.renew)
    save(mirror, home, 10, keep_last=3)
    assert mirror.wait_for(10, 30)
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    other = {"holder": "PID 1 on host-b", "home": "/b", "leg": "b", "started": "", "lease_s": 60, "released": False}
    s3.put_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json", Body=json.dumps(other).encode())
    save(mirror, home, 20, keep_last=3)
    said = mirror.settle(30)
    assert "lost the claim on" in said and "PID 1 on host-b (home /b)" in said
    assert claimed.lost.startswith(f"lost the claim on {store.url}/{RUN} to PID 1 on host-b")
    assert {key for key in keys(s3, remote) if key.startswith("committed/")} == {"committed/step_00000010.json"}
    claimed.release()  # its renewals end: a later test's log would hear of this loss again


def claim_of(s3, remote: str) -> dict:
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    return json.loads(s3.get_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json")["Body"].read())


def delete_claim(s3, remote: str) -> None:
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    s3.delete_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json")


def test_a_claim_deleted_under_a_live_run_is_made_again_by_its_holder_and_never_held_twice(bucket, tmp_path, caplog):
    remote, s3 = bucket
    store, home = store_of(remote), tmp_path / "home"
    claimed = RemoteClaim(store, RUN, home, lease_s=60)
    claimed.take()
    mirror = Mirror(store, RUN, home, keep_last=3, leg=claimed.leg, known={}, fence=claimed.renew)
    save(mirror, home, 10, keep_last=3)
    assert mirror.wait_for(10, 30)
    delete_claim(s3, remote)  # a clean-up, or a lifecycle rule
    save(mirror, home, 20, keep_last=3)
    assert mirror.wait_for(20, 30), "the fence before step 20's manifest made the claim again"
    assert claim_of(s3, remote)["leg"] == claimed.leg
    with pytest.raises(RunError, match=rf"^{re.escape(store.url)}/{RUN} is in use by PID {os.getpid()} "):
        RemoteClaim(store, RUN, tmp_path / "b", lease_s=60).take()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said == [
        f"the claim on {store.url}/{RUN} was gone from the store (deleted, or the store emptied): this machine holds "
        "it again"
    ]
    # Deleted again, and another machine claims the run before this one renews: this one lost it.
    with claimed._lock:  # between two renewals: none in flight
        delete_claim(s3, remote)
        other = RemoteClaim(store, RUN, tmp_path / "b", lease_s=60)
        other.take()
    with pytest.raises(Lost, match=rf"^lost the claim on {re.escape(store.url)}/{RUN} to PID {os.getpid()} on "):
        claimed.renew()
    save(mirror, home, 30, keep_last=3)
    assert "lost the claim on" in mirror.settle(30)
    assert sorted(manifest.committed(store, RUN)) == [10, 20]
    claimed.release()  # lost: leaves the other's claim alone
    assert claim_of(s3, remote)["leg"] == other.leg and not claim_of(s3, remote)["released"]
    delete_claim(s3, remote)
    other.release()  # gone already: nothing to release, and no error


def until(happened, what: str, bound_s: float = 30) -> None:
    """Returns once `happened()`; fails after `bound_s` seconds, saying `what` did not happen."""
    deadline = time.monotonic() + bound_s
    while not happened():
        assert time.monotonic() < deadline, f"{what}: not within {bound_s:g} s"
        time.sleep(0.02)


def test_the_renewal_thread_makes_a_deleted_claim_again_or_stops_as_lost_and_never_dies(
    bucket, tmp_path, caplog, monkeypatch
):
    remote, s3 = bucket
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    store = store_of(remote)
    claimed = RemoteClaim(store, RUN, tmp_path / "home", lease_s=0.6)  # its thread renews every 0.2 s
    claimed.take()
    with claimed._lock:  # between two renewals: none in flight
        delete_claim(s3, remote)
    remade = f"the claim on {store.url}/{RUN} was gone from the store (deleted, or the store emptied): this machine "
    until(lambda: died or any(r.getMessage().startswith(remade) for r in caplog.records), "the claim made again")
    assert not died, died[0].exc_value
    assert claim_of(s3, remote)["leg"] == claimed.leg and claimed.lost is None
    with claimed._lock:  # deleted, then another machine's before this one renews
        delete_claim(s3, remote)
        put_claim(s3, remote, lease_s=60)
    stops = "; this machine stops at its next logging step"
    until(lambda: died or any(said.endswith(stops) for said in caplog.messages), "the claim lost")
    assert not died, died[0].exc_value
    assert claimed.lost.startswith(f"lost the claim on {store.url}/{RUN} to PID 1 on host-b (home /b)")
    assert f"{claimed.lost}{stops}" in caplog.messages
    claimed.release()
    assert claim_of(s3, remote)["leg"] == "b" and not claim_of(s3, remote)["released"]


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_store_emptied_mid_run_gets_back_its_claim_and_every_checkpoint_the_home_still_has(bucket, tmp_path, caplog):
    remote, s3 = bucket
    bucket_name, _ = remote.removeprefix("s3://").split("/", 1)
    home = tmp_path / "home"
    with held(home, remote, None, lease_s=1.5) as run:  # renewed every 0.5 s
        mirror = run.mirroring(home, keep_last=3)
        for step in (10, 20):
            save(mirror, home, step, keep_last=3)
            assert mirror.wait_for(step, 30)
        with run.claimed._lock:  # the bucket deleted and made again, empty, between two renewals
            for found in s3.list_objects_v2(Bucket=bucket_name).get("Contents", []):
                s3.delete_object(Bucket=bucket_name, Key=found["Key"])
            s3.delete_bucket(Bucket=bucket_name)
            s3.create_bucket(Bucket=bucket_name)
        deadline = time.monotonic() + 30
        while manifests(s3, remote) != {"committed/step_00000010.json", "committed/step_00000020.json"}:
            assert time.monotonic() < deadline, f"not uploaded again within 30 s: {keys(s3, remote)}"
            time.sleep(0.05)
        save(mirror, home, 30, keep_last=3)
        assert mirror.wait_for(30, 30)
        holder = claim_of(s3, remote)
    assert holder["leg"] == run.claimed.leg and claim_of(s3, remote)["released"]
    assert {"step_00000010.pt", "step_00000020.pt", "step_00000030.pt", "latest"} <= keys(s3, remote)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    at = f"{Store(remote).url}/{RUN}"
    assert said == [
        f"the claim on {at} was gone from the store (deleted, or the store emptied): this machine holds it again; "
        f"{at} lost 2 checkpoint(s) with its claim: uploading again those of {home} it lacks (step_00000010.pt, "
        "step_00000020.pt)"
    ]


def put_claim(s3, remote: str, lease_s: float, host: str = "host-b", **changes) -> None:
    """A claim of another machine's, written as this project writes one."""
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    other = {"holder": f"PID 1 on {host}", "pid": 1, "host": host, "home": "/b", "leg": "b", "started": ""}
    other |= {"lease_s": lease_s, "released": False, "renewals": 0, **changes}
    s3.put_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json", Body=json.dumps(other).encode())


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_store_emptied_before_the_mirror_starts_gets_back_every_checkpoint_the_home_has(bucket, tmp_path, caplog):
    """Emptied while the claim is held and the mirror not yet built (a fetch, the run's set-up): the
    mirror, built with the old list, hears of the claim's remake when it starts."""
    remote, s3 = bucket
    bucket_name, _ = remote.removeprefix("s3://").split("/", 1)
    home = tmp_path / "home"
    with held(home, remote, None) as run:
        mirror = run.mirroring(home, keep_last=3)
        for step in (10, 20):
            save(mirror, home, step, keep_last=3)
        mirror.settle(30)
    with held(home, remote, "auto", lease_s=1.5) as run:  # renewed every 0.5 s
        with run.claimed._lock:
            for found in s3.list_objects_v2(Bucket=bucket_name).get("Contents", []):
                s3.delete_object(Bucket=bucket_name, Key=found["Key"])
        deadline = time.monotonic() + 30
        while "claim.json" not in keys(s3, remote):  # made again by a renewal, before anyone listens
            assert time.monotonic() < deadline, "the claim was not made again within 30 s"
            time.sleep(0.05)
        run.mirroring(home, keep_last=3)
        while manifests(s3, remote) != {"committed/step_00000010.json", "committed/step_00000020.json"}:
            assert time.monotonic() < deadline, f"not uploaded again within 30 s: {keys(s3, remote)}"
            time.sleep(0.05)
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    at = f"{Store(remote).url}/{RUN}"
    assert said == [  # the claim's line once, when it was made again; what else was lost, once the mirror knew
        f"the claim on {at} was gone from the store (deleted, or the store emptied): this machine holds it again",
        f"{at} lost 2 checkpoint(s) with its claim: uploading again those of {home} it lacks (step_00000010.pt, "
        "step_00000020.pt)",
    ]


@pytest.mark.parametrize("lease_s", [7200, "60"])
def test_a_claim_this_project_cannot_read_is_held_for_the_longest_lease_and_never_taken_over_silently(
    bucket, tmp_path, lease_s
):
    remote, s3 = bucket
    put_claim(s3, remote, lease_s)  # a live machine's, of a lease out of range, or another program's
    with pytest.raises(RunError) as refused:
        RemoteClaim(store_of(remote), RUN, tmp_path / "home", lease_s=60).take()
    assert re.fullmatch(
        rf"{re.escape(Store(remote).url)}/{RUN} is in use by a claim this project did not write \(lease renewed \d+ s "
        rf"ago, runs out in 3[56]\d\d s\); wait for that run to end \(or stop it\), or train separately with "
        rf"name=<another name>",
        str(refused.value),
    ), refused.value
    assert claim_of(s3, remote)["leg"] == "b"


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_new_machine_waits_for_a_lost_holder_on_another_host_to_run_out_and_takes_over(bucket, tmp_path, caplog):
    remote, s3 = bucket
    caplog.set_level(logging.INFO)
    store = store_of(remote)
    store.list(RUN)  # its client made first (seconds, on a busy machine): the claim below is read at once
    put_claim(s3, remote, lease_s=4)  # a machine taken away a moment ago: its lease runs 4 s yet
    claimed = RemoteClaim(store, RUN, tmp_path / "home", lease_s=60)
    claimed.take()
    claimed.release()
    said = [r.getMessage() for r in caplog.records if "host-b" in r.getMessage()]
    assert re.fullmatch(
        rf"{re.escape(store.url)}/{RUN} is held by PID 1 on host-b \(home /b\), whose lease runs out in \d s unless "
        r"renewed: waiting to see which \(up to [2-6] s\)",
        said[0],
    ), said
    assert re.fullmatch(
        rf"took over {re.escape(store.url)}/{RUN} from PID 1 on host-b \(home /b\), whose lease ran out "
        r"\d s ago",
        said[1],
    ), said
    assert len(said) == 2


@pytest.mark.slow  # a second or more: out of the daily loop, which keeps this contract's quicker tests
def test_a_new_machine_that_waits_for_a_holder_on_another_host_is_refused_once_it_renews(bucket, tmp_path, monkeypatch):
    remote, _ = bucket
    store = store_of(remote)
    with monkeypatch.context() as elsewhere:
        elsewhere.setattr(socket, "gethostname", lambda: "host-b")
        alive = RemoteClaim(store, RUN, tmp_path / "a", lease_s=3)  # renewed every second
    alive.take()
    try:
        with pytest.raises(RunError) as refused:
            RemoteClaim(store, RUN, tmp_path / "b", lease_s=60).take()
        assert re.fullmatch(
            rf"{re.escape(store.url)}/{RUN} is in use by PID {os.getpid()} on host-b \(home {tmp_path / 'a'}\) \(lease "
            r"renewed \d s ago, runs out in -?\d s; renewed while this machine waited: it lives\); wait for that run to "
            r"end \(or stop it\), or train separately with name=<another name>",
            str(refused.value),
        ), refused.value
        assert alive.lost is None
    finally:
        alive.release()


# --- runs ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_stopped_on_one_machine_continues_on_another_from_the_remote_bit_for_bit(
    make_cfg, client, bucket, tmp_path, monkeypatch, sigterm_at
):
    remote, s3 = bucket
    common = [f"name={RUN}", "trainer.max_steps=40", "checkpoint.every_n_steps=10", f"checkpoint.remote={remote}"]
    reference = recipe.train(make_cfg(*common[:3], f"name={RUN}-reference", f"checkpoint.dir={tmp_path / 'ref'}"))
    step = recipe.train_step
    sigterm_at(25)
    with pytest.raises(SystemExit):
        recipe.train(make_cfg(*common, f"checkpoint.dir={tmp_path / 'machine-a'}"))
    monkeypatch.setattr(recipe, "train_step", step)  # the store's environment stays
    assert "committed/step_00000025.json" in keys(s3, remote)

    resumed = recipe.train(make_cfg(*common, f"checkpoint.dir={tmp_path / 'machine-b'}", "resume=auto"))
    assert resumed["step"] == 40
    first_leg = newest_valid(tmp_path / "machine-a").state["tracker"]["run_id"]
    assert resumed["run_id"] == first_leg, "the same MLflow run"
    assert losses(client, resumed["run_id"]) == losses(client, reference["run_id"])
    recorded = client.get_run(resumed["run_id"]).data
    assert SECRET not in json.dumps([recorded.params, recorded.tags]), "the store's secret, in MLflow"
    assert recorded.tags["checkpoint.remote"] == remote and "checkpoint.remote" not in recorded.params  # a where
    account = json.loads((tmp_path / "machine-b" / "goodput.json").read_text())
    assert len(account["legs"]) == 2
    assert json.loads(store_of(remote).get_bytes(f"{RUN}/goodput.json"))["legs"] == account["legs"]


@pytest.mark.slow
def test_a_sharded_checkpoint_is_mirrored_as_a_folder_and_a_new_machine_continues_from_the_same_bytes(
    make_cfg, bucket, tmp_path
):
    remote, s3 = bucket
    common = [f"name={RUN}", "mlflow.enabled=false", "strategy=fsdp", "checkpoint.every_n_steps=10"]
    common += [f"checkpoint.remote={remote}"]
    recipe.train(make_cfg(*common, "trainer.max_steps=20", f"checkpoint.dir={tmp_path / 'a'}"))
    saved = tmp_path / "a" / "step_00000020"
    assert {f"step_00000020/{path.name}" for path in saved.iterdir()} | {"committed/step_00000020.json"} <= keys(
        s3, remote
    )
    result = recipe.train(make_cfg(*common, "trainer.max_steps=30", "resume=auto", f"checkpoint.dir={tmp_path / 'b'}"))
    assert result["step"] == 30
    fetched = tmp_path / "b" / "step_00000020"
    assert {path.name: path.read_bytes() for path in fetched.iterdir()} == {
        path.name: path.read_bytes() for path in saved.iterdir()
    }


@pytest.mark.slow
def test_a_run_whose_claim_another_machine_took_stops_at_its_next_logging_step_saying_so(
    make_cfg, bucket, tmp_path, monkeypatch, caplog
):
    remote, s3 = bucket
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    other = {"holder": "PID 1 on host-b", "home": "/b", "leg": "b", "started": "", "lease_s": 60, "released": False}
    real_step, steps_taken = recipe.train_step, []

    def step_then_take_over(*arguments):
        steps_taken.append(1)
        if len(steps_taken) == 12:  # once the save at step 10 is remote
            until(lambda: "committed/step_00000010.json" in manifests(s3, remote), "step 10's upload", bound_s=60)
            s3.put_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/claim.json", Body=json.dumps(other).encode())
            lost = f"lost the claim on {Store(remote).url}/{RUN} to PID 1 on host-b"
            until(lambda: any(said.startswith(lost) for said in caplog.messages), "the claim's loss", bound_s=60)
        assert len(steps_taken) <= 20, "the claim's loss was known before step 12, yet the run trained past step 20"
        return real_step(*arguments)

    monkeypatch.setattr(recipe, "train_step", step_then_take_over)
    settings = [f"name={RUN}", "mlflow.enabled=false", "trainer.max_steps=100000", "trainer.log_every_n_steps=10"]
    settings.append("checkpoint.every_n_steps=10")
    with pytest.raises(RunError) as stopped:
        recipe.train(make_cfg(*settings, f"checkpoint.remote={remote}", "checkpoint.remote_lease_s=0.3"))
    assert re.fullmatch(
        rf"lost the claim on {re.escape(Store(remote).url)}/{RUN} to PID 1 on host-b \(home /b\); this machine stops "
        rf"at step \d+ and uploads nothing more",
        str(stopped.value),
    ), stopped.value
    assert manifests(s3, remote) == {"committed/step_00000010.json"}


@pytest.mark.slow
def test_a_new_machine_started_while_a_lost_machines_lease_runs_waits_for_it_and_trains(make_cfg, bucket, caplog):
    remote, s3 = bucket
    caplog.set_level(logging.INFO)
    common = [f"name={RUN}", "mlflow.enabled=false", "trainer.max_steps=10", f"checkpoint.remote={remote}"]
    cfg = make_cfg(*common, "resume=auto")  # composed first: the claim below is read a moment after it is written
    put_claim(s3, remote, lease_s=6)  # a machine on another host, killed a moment ago: no exit 2 for its lease
    assert recipe.train(cfg)["step"] == 10
    at = re.escape(f"{Store(remote).url}/{RUN}")
    waited = rf"{at} is held by PID 1 on host-b \(home /b\), whose lease runs out in \d s unless renewed: waiting .*"
    assert [said for said in caplog.messages if re.fullmatch(waited, said)], caplog.messages
    assert [said for said in caplog.messages if re.fullmatch(rf"took over {at} from PID 1 on host-b .*", said)]
    assert "committed/step_00000010.json" in manifests(s3, remote)


@pytest.mark.slow
def test_a_fresh_run_over_the_remote_checkpoints_of_its_name_is_refused(make_cfg, remote, tmp_path):
    common = [f"name={RUN}", "mlflow.enabled=false", "trainer.max_steps=10", f"checkpoint.remote={remote}"]
    recipe.train(make_cfg(*common, f"checkpoint.dir={tmp_path / 'a'}"))
    with pytest.raises(RunError, match=rf"^{re.escape(Store(remote).url)}/{RUN} already holds checkpoints of 'demo'"):
        recipe.train(make_cfg(*common, f"checkpoint.dir={tmp_path / 'b'}"))
    assert not (tmp_path / "b").exists()


# --- runs, as a person types them ----------------------------------------------------------------

QUIET = ["device.cpu_threads=1", "mlflow.enabled=false", "checkpoint.every_n_steps=10"]


def wait_until(happened, process: subprocess.Popen, what: str) -> None:
    """Returns once `happened()`; fails, with the process's output, if it ends first."""
    deadline = time.monotonic() + 120
    while not happened():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{what}: not within 120 s"
        time.sleep(0.02)


def manifests(s3, remote: str) -> set[str]:
    return {key for key in keys(s3, remote) if key.startswith("committed/")}


@pytest.mark.slow
def test_a_kill_9_mid_upload_leaves_nothing_a_new_machine_picks_and_it_continues_from_the_last_whole_one(
    project, bucket, s3_server, save_gate
):
    remote, s3 = bucket
    settings = [f"name={RUN}", *QUIET, f"checkpoint.remote={remote}"]
    home = project / "checkpoints" / RUN
    gate = save_gate(match="step_00000020")
    machine_a = start(project, *settings, "trainer.max_steps=1000000", env=gate.env)
    gate.wait(machine_a)  # step 20 is in its home, and its upload not yet begun
    wait_until(lambda: "committed/step_00000010.json" in manifests(s3, remote), machine_a, "step 10 uploaded")
    with s3_server.paused():
        gate.release()
        # At 20 or past it: the save of 30 waits only for 20's write, so `latest` may be at 20 briefly.
        latest = home / "latest"
        wait_until(lambda: homes.step_of(home / latest.read_text()) >= 20, machine_a, "step 20 handed over")
        machine_a.kill()
        machine_a.communicate()
    assert manifests(s3, remote) == {"committed/step_00000010.json"}
    # Step 20 whole in the bucket, but without its manifest (as a copy by hand would be): no run's.
    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
    s3.upload_file(str(home / "step_00000020.pt"), bucket_name, f"{prefix}/{RUN}/step_00000020.pt")
    new_machine = ["trainer.max_steps=15", "resume=auto", f"checkpoint.dir={project / 'machine-b'}"]
    continued = run_cli(project, *settings, *new_machine)
    said = continued.stdout + continued.stderr
    assert continued.returncode == 0, said
    # Its claim's lease runs for a minute yet, but its process, on this machine, is gone.
    assert "resumed at step 10 on cpu" in said and re.search(
        rf"took over \S+/{RUN} from PID {machine_a.pid} .*, which ended", said
    )
    assert manifests(s3, remote) == {"committed/step_00000010.json", "committed/step_00000015.json"}
    assert "step_00000020.pt" in keys(s3, remote), "an object without a manifest is not this run's to delete"
    assert SECRET not in said


@pytest.mark.slow
def test_the_steps_a_lost_machine_trained_past_its_remote_checkpoint_count_as_trained_again_on_the_next(
    project, bucket
):
    remote, s3 = bucket
    settings = [f"name={RUN}", "device.cpu_threads=1", f"checkpoint.remote={remote}"]
    assert run_cli(project, *settings, "trainer.max_steps=10").returncode == 0  # step 10, remote
    # Continued on the same machine with no save to come: each step it trains past 10 is lost with it.
    endless = ["trainer.max_steps=1000000", "checkpoint.every_n_steps=1000000", "checkpoint.every_s=null"]
    machine_a = start(project, *settings, *endless, "resume=auto")

    bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)

    def reached() -> int:
        """The step the bucket's goodput account says machine A trained to."""
        with contextlib.suppress(s3.exceptions.NoSuchKey):
            account = s3.get_object(Bucket=bucket_name, Key=f"{prefix}/{RUN}/goodput.json")["Body"].read()
            return json.loads(account)["legs"][-1]["step"]
        return 0

    wait_until(lambda: reached() >= 100, machine_a, "an account of steps past the remote checkpoint, uploaded")
    machine_a.kill()
    machine_a.communicate()
    lost = reached()
    assert manifests(s3, remote) == {"committed/step_00000010.json"}

    machine_b = project / "machine-b"
    new_machine = [f"trainer.max_steps={lost + 20}", "resume=auto", f"checkpoint.dir={machine_b}"]
    continued = run_cli(project, *settings, *new_machine)
    said = continued.stdout + continued.stderr
    assert continued.returncode == 0 and "resumed at step 10 on cpu" in said, said
    *_, killed, after = json.loads((machine_b / "goodput.json").read_text())["legs"]
    assert killed["step"] == lost and after["seconds"]["retrained"] > 0 and after["seconds"]["train"] > 0
    (run,) = runs_named(MlflowClient(f"sqlite:///{project / 'mlflow.db'}"), RUN)
    found = goodput_of(run)  # steps 11 to `lost`, trained again: their time on machine B
    assert found["legs"] == 3 and found["retrained_s"] == pytest.approx(after["seconds"]["retrained"])
    assert re.search(r"steps trained again [\d.]+ s", said), said


@pytest.mark.slow
def test_a_sweeps_jobs_mirror_each_its_own_home_and_a_new_machine_continues_each_from_its_own(project, bucket):
    remote, s3 = bucket
    sweep = ["-m", "optimizer.lr=1e-3,3e-3", f"name={RUN}", *QUIET, f"checkpoint.remote={remote}"]
    first = run_cli(project, *sweep, "trainer.max_steps=10", timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    jobs = {lr: f"optimizer.lr={lr}" for lr in (0.001, 0.003)}  # each job's home: checkpoints/demo/<its overrides>
    assert {f"{job}/committed/step_00000010.json" for job in jobs.values()} <= keys(s3, remote)
    shutil.rmtree(project / "checkpoints")  # a new machine
    second = run_cli(project, *sweep, "trainer.max_steps=20", "resume=auto", timeout=600)
    said = second.stdout + second.stderr
    assert second.returncode == 0, said
    for lr, job in jobs.items():
        assert f"fetched step_00000010.pt from {Store(remote).url}/{RUN}/{job} (" in said
        continued = newest_valid(project / "checkpoints" / RUN / job).state
        assert (continued["step"], continued["config"]["optimizer"]["lr"]) == (20, lr)
    assert said.count("resumed at step 10 on cpu") == 2


@pytest.mark.slow
def test_a_sigterm_waits_for_the_newest_upload_and_a_resume_without_the_remote_uploads_nothing(project, bucket):
    remote, s3 = bucket
    settings = [f"name={RUN}", *QUIET, f"checkpoint.remote={remote}"]
    home = project / "checkpoints" / RUN
    process = start(project, *settings, "trainer.max_steps=1000000")
    wait_for_a_save(home, process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    said = stdout + stderr
    assert process.returncode == 128 + signal.SIGTERM, said
    step = int(re.search(r"stopped at step (\d+) by SIGTERM", said)[1])
    at = f"{Store(remote).url}/{RUN}"
    assert re.search(rf"remote: step_{step:08d}.pt is in {re.escape(at)} \(uploaded \d+\.\d s after the save\)", said)
    assert f"committed/step_{step:08d}.json" in manifests(s3, remote)
    assert SECRET not in said and "credentials" not in said  # botocore's "Found credentials in ..." too
    assert f"continue with name={RUN} checkpoint.remote={remote} resume=last" in said  # the remote, typed again

    # The checkpoint holds checkpoint.remote; a resume that does not type it mirrors nowhere.
    before = manifests(s3, remote)
    resumed = run_cli(project, f"name={RUN}", *QUIET, "resume=last", f"trainer.max_steps={step + 10}")
    assert resumed.returncode == 0, resumed.stderr
    assert "remote:" not in resumed.stdout + resumed.stderr
    assert manifests(s3, remote) == before


@pytest.mark.slow
def test_a_sigterm_with_the_store_down_ends_within_remote_wait_s_and_says_what_is_not_remote(
    project, bucket, s3_server
):
    remote, _ = bucket
    settings = [f"name={RUN}", *QUIET, f"checkpoint.remote={remote}", "checkpoint.remote_wait_s=2"]
    home = project / "checkpoints" / RUN
    process = start(project, *settings, "trainer.max_steps=1000000")
    wait_for_a_save(home, process)
    with s3_server.paused():
        process.send_signal(signal.SIGTERM)
        began = time.monotonic()
        stdout, stderr = process.communicate(timeout=120)
        took = time.monotonic() - began
    said = stdout + stderr
    assert process.returncode == 128 + signal.SIGTERM, said
    # The bound (2 s), the release of the claim (5 s at most) and the exit; a run that waited on
    # the paused store would take a minute at least (botocore's read timeout), so 40 s leaves a
    # busy machine its slowness and still tells the two apart.
    assert took < 40, took
    step = int(re.search(r"stopped at step (\d+) by SIGTERM", said)[1])
    assert f"remote: step_{step:08d}.pt is not in {Store(remote).url}/{RUN} within checkpoint.remote_wait_s=2" in said
    assert f"step_{step:08d}.pt stays in {home}" in said
