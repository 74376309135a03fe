"""MLflow: one run across resumes, the continuity evidence, and metrics and files that never wait
on, or die with, the tracking store."""

import contextlib
import json
import logging
import os
import queue
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow
import pytest
import torch
import yaml
from conftest import configured, losses, new_experiment, run_cli, runs_named, start, wait_for_a_save
from mlflow import MlflowClient
from omegaconf import OmegaConf
from PIL import Image

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.onefile import save
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.config import MlflowConfig
from {{cookiecutter.package}}.engine.distributed import World
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.provenance import record
from {{cookiecutter.package}}.engine.tracking import mlflow_run, mlflow_store
from {{cookiecutter.package}}.engine.tracking.mlflow_store import connect, experiment_id
from {{cookiecutter.package}}.engine.tracking.sender import _Sender, replay
from {{cookiecutter.package}}.engine.tracking.tracker import Tracker, check_tracking_uri
from {{cookiecutter.package}}.engine.tracking.unsent import STAGING, spill

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it


def test_a_fresh_run_records_params_tags_metrics_and_the_resolved_config(
    make_cfg, client, tmp_path, checkpoint_dir, tracking_uri
):
    cfg = make_cfg("trainer.max_steps=40", "trainer.log_every_n_steps=5", "optimizer=sgd")
    summary = recipe.train(cfg)
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer"] == "SGD" and run.data.params["trainer.max_steps"] == "40"
    assert run.data.params["model"] == "MLP"
    assert run.data.params["model.hidden_sizes"] == str(list(cfg.model.hidden_sizes))
    tags = run.data.tags
    # Where the run keeps things, and the components' whole names, are tags: the compare views show what trains.
    assert not [
        key for key in run.data.params if key.endswith("_target_") or key in ("checkpoint.dir", "mlflow.tracking_uri")
    ]
    assert tags["optimizer._target_"] == "torch.optim.SGD" and tags["checkpoint.dir"] == str(checkpoint_dir)
    assert tags["mlflow.tracking_uri"] == tracking_uri
    assert (tags["device"], tags["device.type"], tags["device.index"], tags["amp"]) == ("cpu", "cpu", "0", "off")
    assert tags["device.name"].startswith("cpu (") and tags["torch"].startswith("2.")
    for key in ("train/loss", "train/lr", "train/samples_per_s", "train/step_time_ms"):
        assert sorted(losses(client, run.info.run_id, key)) == [5, 10, 15, 20, 25, 30, 35, 40], key
    assert sorted(losses(client, run.info.run_id, "checkpoint/loss")) == [10, 20, 30, 40]
    # the rate over the whole run has a name of its own, logged once, at the end
    for key in ("train/mean_samples_per_s", "train/mean_steps_per_s"):
        assert losses(client, run.info.run_id, key) == {40: [summary[key]]}, key
    # validated every 20 steps, and at each save point for its checkpoint's score (checkpoint.keep_best)
    assert sorted(losses(client, run.info.run_id, "val/accuracy")) == [10, 20, 30, 40]
    config = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text())
    assert config["optimizer"]["_target_"] == "torch.optim.SGD" and config["trainer"]["max_steps"] == 40


def test_a_run_records_only_the_settings_of_the_components_it_chose(make_cfg, client):
    """Each option has its own settings: a CNN run has no MLP hidden sizes to show as `???`."""
    run = client.get_run(recipe.train(make_cfg("model=cnn", "trainer.max_steps=10"))["run_id"])
    models = {key: value for key, value in run.data.params.items() if key.startswith("model")}
    cnn = configured("model=cnn").model
    assert models == {"model": "CNN", "model.channels": str(list(cnn.channels)), "model.dropout": str(cnn.dropout)}


def test_a_null_setting_is_no_param_and_a_resume_that_nulls_or_sets_one_is_tagged(make_cfg, client):
    first = client.get_run(recipe.train(make_cfg("trainer.max_steps=10", "trainer.grad_clip=1.0"))["run_id"])
    assert first.data.params["trainer.grad_clip"] == "1.0"
    assert "None" not in first.data.params.values() and "init.checkpoint" not in first.data.params
    recipe.train(make_cfg("trainer.max_steps=20", "trainer.grad_clip=null", "resume=last"))
    recipe.train(make_cfg("trainer.max_steps=30", "trainer.grad_clip=2.0", "resume=last"))
    run = client.get_run(first.info.run_id)
    assert run.data.tags["resume.1.trainer.grad_clip"] == "None"
    assert run.data.tags["resume.2.trainer.grad_clip"] == "2.0"
    assert run.data.params["trainer.grad_clip"] == "1.0", "a param keeps its first value"
    assert not any(key.startswith("resume.2.") and value == "None" for key, value in run.data.tags.items())


def test_a_resume_continues_the_run_and_logs_the_loss_at_save_beside_the_loss_now(make_cfg, client, caplog):
    first = recipe.train(make_cfg("trainer.max_steps=20"))
    with caplog.at_level(logging.INFO):
        resumed = recipe.train(make_cfg("trainer.max_steps=30", "resume=last"))
    run_id = first["run_id"]
    assert resumed["run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["resumes"] == "1" and run.data.tags["continuity"] == "ok"
    assert run.data.tags["resume.1.checkpoint"].endswith("step_00000020.pt")
    assert run.data.tags["resume.1.trainer.max_steps"] == "30"
    at_save, now = losses(client, run_id, "checkpoint/loss")[20], losses(client, run_id, "resume/loss")[20]
    assert now == at_save  # same device and dtype: equal, not close
    assert losses(client, run_id, "resume/loss_delta")[20] == [0.0]
    assert f"resumed at step 20 on cpu: loss at save {at_save[0]:.4f}, loss now {now[0]:.4f} (ok)" in caplog.text
    assert sorted(losses(client, run_id)) == list(range(1, 31)), "one curve across the resume"


def test_a_checkpoint_whose_run_is_not_in_the_store_continues_in_a_new_tagged_run(
    make_cfg, client, checkpoint_dir, tmp_path, capfd
):
    first = recipe.train(make_cfg("trainer.max_steps=10"))
    other_store = f"sqlite:///{tmp_path / 'other.db'}"
    resumed = recipe.train(make_cfg("trainer.max_steps=20", "resume=last", f"mlflow.tracking_uri={other_store}"))
    assert resumed["run_id"] != first["run_id"]
    assert f"MLflow run {first['run_id']} is not in {other_store}; continuing in a new run" in capfd.readouterr().err
    new_run = type(client)(other_store).get_run(resumed["run_id"])
    assert new_run.data.tags["resumed_from_checkpoint"] == str(checkpoint_dir / "step_00000010.pt")
    assert new_run.info.status == "FINISHED"


def test_a_checkpoint_whose_run_was_deleted_in_the_ui_continues_in_a_new_run(make_cfg, client, capfd):
    first = recipe.train(make_cfg("trainer.max_steps=10"))
    client.delete_run(first["run_id"])
    resumed = recipe.train(make_cfg("trainer.max_steps=20", "resume=last"))
    assert resumed["run_id"] not in (None, first["run_id"])
    assert client.get_run(resumed["run_id"]).data.tags["resumed_from_checkpoint"].endswith("step_00000010.pt")
    assert (
        f"MLflow run {first['run_id']} is deleted; continuing in a new run (`MLFLOW_TRACKING_URI="
        f"{client.tracking_uri} mlflow runs restore --run-id {first['run_id']}` brings the old one back)"
    ) in capfd.readouterr().err


def test_a_checkpoint_whose_experiment_was_deleted_says_so_and_restoring_it_continues_the_run(make_cfg, client, capfd):
    settings = ["mlflow.experiment_name=deleted-then-restored", "trainer.max_steps=10"]
    first = recipe.train(make_cfg(*settings))
    experiment = client.get_run(first["run_id"]).info.experiment_id
    client.delete_experiment(experiment)
    untracked = recipe.train(make_cfg(*settings, "trainer.max_steps=20", "resume=last"))
    assert untracked["run_id"] is None
    restore = f"MLFLOW_TRACKING_URI={client.tracking_uri} mlflow experiments restore --experiment-id {experiment}"
    said = capfd.readouterr().err
    assert (
        f"failed (the MLflow experiment 'deleted-then-restored' is deleted, and run {first['run_id']} with it; "
        f"restore it with `{restore}`, or log to another with mlflow.experiment_name=<name>); training goes on "
        f"without tracking"
    ) in said
    assert "is not in" not in said

    client.restore_experiment(experiment)
    resumed = recipe.train(make_cfg(*settings, "trainer.max_steps=30", "resume=last"))
    assert resumed["run_id"] == first["run_id"], "the restored run goes on"


def test_a_store_that_fails_after_the_run_opened_ends_it_failed_and_training_goes_on(make_cfg, tmp_path):
    (tmp_path / "mlruns").write_text("")  # a file where the artifacts' folder goes: the config cannot be logged
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    summary = recipe.train(make_cfg("trainer.max_steps=10", f"mlflow.tracking_uri={store}"))
    assert summary["step"] == 10 and summary["run_id"] is None
    (run,) = runs_named(MlflowClient(store), configured().name)
    assert run.info.status == "FAILED"


def test_a_run_that_fails_is_marked_failed_not_left_running(make_cfg, client, checkpoint_dir):
    recipe.train(make_cfg("trainer.max_steps=10"))
    path, saved = newest_valid(checkpoint_dir)
    saved["probe"]["loss"] *= 2
    save(saved, checkpoint_dir, keep_last=3)
    with pytest.raises(recipe.RunError):
        recipe.train(make_cfg("trainer.max_steps=20", "resume=last", "checkpoint.continuity.on_mismatch=error"))
    assert client.get_run(saved["tracker"]["run_id"]).info.status == "FAILED"


def test_system_metrics_are_logged_when_asked(make_cfg, client, monkeypatch):
    pytest.importorskip("psutil")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    summary = recipe.train(make_cfg("trainer.max_steps=300", "mlflow.system_metrics=true"))
    assert "system/cpu_utilization_percentage" in client.get_run(summary["run_id"]).data.metrics


class Store:
    """A stand-in tracking store that can hang or fail on demand, recording what reaches it."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.failing = False
        self.failures = 0  # calls refused while failing
        self.batches: list[list] = []
        self.files: list[tuple] = []  # (artifact path, text) of each file logged, (key, step, size) of each image
        self.ended: list[tuple] = []
        self._called = threading.Condition()

    @contextlib.contextmanager
    def _reached(self):
        self.open.wait()
        with self._called:
            self._called.notify_all()
            if self.failing:
                self.failures += 1
                raise ConnectionError("server went away")
            yield

    def log_batch(self, run_id, metrics):
        with self._reached():
            self.batches.append(list(metrics))

    def log_artifact(self, run_id, local_path, artifact_path=None):
        with self._reached():
            self.files.append((f"{artifact_path}/{Path(local_path).name}", Path(local_path).read_text()))

    def log_image(self, run_id, image, key, step, timestamp):
        with self._reached():
            self.files.append((key, step, image.size))

    def set_terminated(self, run_id, status, end_time):
        if self.failing:
            raise ConnectionError("server went away")
        self.ended.append((run_id, status, end_time))

    def wait_for(self, condition) -> None:
        """Returns once `condition()` holds, checked at each call that reaches the store."""
        with self._called:
            self._called.wait_for(condition)


class SenderClock(queue.Queue):
    """The sender's queue and its clock (time.monotonic in sender.py), in one: time passes only
    when the test moves it, and only while the sender waits for it, so when the sender sends is the
    test's to decide, not this machine's speed. A get(timeout=...) waits for an item, or for the
    clock to pass the timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.sleeping = False  # the sender waits for the clock: all taken, a get with a timeout

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Moves the clock on once the sender waits for it (it has dealt with all it was given)."""
        with self.not_empty:
            self.not_full.wait_for(lambda: self.sleeping)
            self.now += seconds
            self.sleeping = False
            self.not_empty.notify_all()

    def _put(self, item) -> None:
        super()._put(item)
        self.sleeping = False

    def get(self, block: bool = True, timeout: float | None = None):
        with self.not_empty:
            end = None if timeout is None else self.now + timeout
            while not self._qsize():
                if end is not None and self.now >= end - 1e-9:  # end: now + (due - now), as floats
                    raise queue.Empty
                self.sleeping = end is not None
                self.not_full.notify_all()  # to a test waiting for that in advance()
                self.not_empty.wait()
            self.sleeping = False
            item = self._get()
            self.not_full.notify_all()
            return item


def sender_clock(monkeypatch) -> SenderClock:
    clock = SenderClock()

    class Time:  # the time module, but for its monotonic clock
        monotonic = staticmethod(clock.monotonic)

        def __getattr__(self, name):
            return getattr(time, name)

    monkeypatch.setattr("{{cookiecutter.package}}.engine.tracking.sender.time", Time())
    return clock


def drain(
    store,
    spill: Path,
    rows_by_step: dict[int, float],
    *,
    hold=None,
    end: dict | None = None,
    clock: SenderClock | None = None,
    pause: float = 0,
    files: tuple[dict, ...] = (),
) -> list[int | dict]:
    """Runs the sender loop in a thread over metrics handed over one step at a time, `pause`
    seconds apart on the sender's `clock` when given, then `files` (staged), then ends it, with
    the end of the run when given; `hold` runs before the end. Returns what the sender confirmed,
    in order."""
    incoming: queue.Queue = clock if clock is not None else queue.Queue()
    confirmed: list[int | dict] = []
    sender = threading.Thread(target=_Sender(store, "run", spill, incoming, confirm=confirmed.append).run)
    sender.start()
    for step, value in rows_by_step.items():
        incoming.put([["train/loss", value, 0, step]])
        if pause:
            clock.advance(pause)
    for number, what in enumerate(files):
        incoming.put({"file": what, "id": number})
    if hold is not None:
        hold()
    if end is not None:
        incoming.put({"end": end})
    incoming.put(None)
    sender.join()
    return confirmed


def sent_steps(store: Store) -> list[int]:
    return [metric.step for batch in store.batches for metric in batch]


def spilled_for(spill: Path, run_id: str) -> None:
    """Points a spill file written for the stand-in run "run" at a real run."""
    spill.write_text(spill.read_text().replace('"run_id": "run"', f'"run_id": "{run_id}"'))


def test_a_hanging_store_delays_delivery_but_every_metric_arrives_in_order_and_in_batches(tmp_path):
    store = Store()
    store.open.clear()  # the store hangs until released
    drain(store, tmp_path / "unsent.jsonl", {step: 1.0 / step for step in range(1, 501)}, hold=store.open.set)
    assert sent_steps(store) == list(range(1, 501))
    assert len(store.batches) < 50, "metrics go in batches, not one call each"
    assert not (tmp_path / "unsent.jsonl").exists()


def test_metrics_handed_over_step_by_step_reach_the_store_in_one_call_once_due(tmp_path, monkeypatch):
    monkeypatch.setattr("{{cookiecutter.package}}.engine.tracking.sender.SEND_EVERY_SECONDS", 2.0)
    clock, store = sender_clock(monkeypatch), Store()

    def first_call_arrives() -> None:  # due 2 s after the first metric: no end of the run needed
        clock.advance(2.0)
        store.wait_for(lambda: store.batches)

    steps = {step: 1.0 for step in range(1, 51)}
    drain(store, tmp_path / "unsent.jsonl", steps, hold=first_call_arrives, clock=clock, pause=0.002)
    assert [len(batch) for batch in store.batches] == [50], "one log_batch call for the 50 steps, not one each"


def test_metrics_kept_through_an_outage_are_sent_when_the_store_returns(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("{{cookiecutter.package}}.engine.tracking.sender.RETRY_SECONDS", 0.05)
    monkeypatch.setattr("{{cookiecutter.package}}.engine.tracking.sender.SEND_EVERY_SECONDS", 0.01)
    clock, store = sender_clock(monkeypatch), Store()
    store.failing = True

    def outage_ends() -> None:
        for tries in (1, 2, 3):  # a few failed tries
            clock.advance(0.1)  # past the send, then past each retry
            store.wait_for(lambda tries=tries: store.failures >= tries)
        store.failing = False
        clock.advance(0.1)
        store.wait_for(lambda: store.batches)  # a retry while nothing new arrives

    steps = {step: float(step) for step in range(1, 101)}
    with caplog.at_level(logging.WARNING):
        drain(store, tmp_path / "unsent.jsonl", steps, hold=outage_ends, clock=clock)
    assert sorted(sent_steps(store)) == list(range(1, 101))
    assert caplog.text.count("MLflow is not taking metrics (server went away)") == 1
    assert "MLflow is taking metrics again" in caplog.text


def test_metrics_that_never_got_through_go_to_a_file_that_replays_into_mlflow(tmp_path, client, caplog):
    store = Store()
    store.failing = True
    spill = tmp_path / "unsent.jsonl"
    with caplog.at_level(logging.WARNING):
        drain(store, spill, {step: step / 10 for step in range(1, 31)})
    rows = [json.loads(line) for line in spill.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 31))
    assert f"30 metrics could not reach MLflow; they are in {spill}" in caplog.text
    assert f"python -m {{cookiecutter.package}}.engine.tracking replay {spill}" in caplog.text
    run_id = client.create_run(new_experiment(client, "replay")).info.run_id
    spilled_for(spill, run_id)
    assert replay(spill, client.tracking_uri) == (30, 0, {})
    assert losses(client, run_id) == {step: [step / 10] for step in range(1, 31)}
    assert client.get_run(run_id).info.status == "RUNNING", "no end recorded: the run is left as it is"


def test_replay_ends_a_run_that_the_store_could_not_end(tmp_path, client, caplog):
    run = client.create_run(new_experiment(client, "replay-end"))
    end = {"status": "KILLED", "end_time": run.info.start_time + 5000, "resumes": 0}
    store = Store()
    store.failing = True
    spill = tmp_path / "unsent.jsonl"
    with caplog.at_level(logging.WARNING):
        drain(store, spill, {step: step / 10 for step in range(1, 4)}, end=end)
    rows = [json.loads(line) for line in spill.read_text().splitlines()]
    assert [row.get("step") for row in rows] == [1, 2, 3, None]
    assert rows[-1] == {"run_id": "run", **end}, "the end comes after the metrics it could not send"
    assert f"could not mark MLflow run run KILLED (server went away); that is recorded in {spill}" in caplog.text

    spilled_for(spill, run.info.run_id)
    assert replay(spill, client.tracking_uri) == (3, 0, {run.info.run_id: "ended KILLED"})
    ended = client.get_run(run.info.run_id).info
    assert (ended.status, ended.end_time) == ("KILLED", run.info.start_time + 5000)
    assert losses(client, run.info.run_id) == {1: [0.1], 2: [0.2], 3: [0.3]}


def test_an_end_the_store_refused_is_recorded_even_when_every_metric_arrived(tmp_path):
    store = Store()
    spill = tmp_path / "unsent.jsonl"

    def store_goes_away() -> None:
        store.wait_for(lambda: len(sent_steps(store)) >= 3)
        store.failing = True

    drain(
        store,
        spill,
        {1: 1.0, 2: 2.0, 3: 3.0},
        hold=store_goes_away,
        end={"status": "FINISHED", "end_time": 7, "resumes": 2},
    )
    assert sent_steps(store) == [1, 2, 3]
    assert [json.loads(line) for line in spill.read_text().splitlines()] == [
        {"run_id": "run", "status": "FINISHED", "end_time": 7, "resumes": 2}
    ]


def test_replay_ends_only_a_run_still_waiting_for_that_end(tmp_path, client):
    experiment = new_experiment(client, "replay-guard")
    resumed = client.create_run(experiment, tags={"resumes": "1"})  # resumed after the end was recorded
    ended = client.create_run(experiment)
    client.set_terminated(ended.info.run_id, status="FAILED")
    spill = tmp_path / "unsent.jsonl"
    spill.write_text(
        "".join(
            json.dumps({"run_id": run.info.run_id, "status": "KILLED", "end_time": 1, "resumes": 0}) + "\n"
            for run in (resumed, ended)
        )
    )
    assert replay(spill, client.tracking_uri) == (
        0,
        0,
        {
            resumed.info.run_id: "left RUNNING: it was resumed since",
            ended.info.run_id: "left FAILED: it was ended since",
        },
    )
    assert client.get_run(resumed.info.run_id).info.status == "RUNNING"
    assert client.get_run(ended.info.run_id).info.status == "FAILED"


def test_replay_into_a_store_without_the_run_says_so_in_one_line(tmp_path):
    spill = tmp_path / "unsent.jsonl"
    spill.write_text(
        json.dumps({"run_id": "0" * 32, "key": "train/loss", "value": 1.0, "timestamp": 0, "step": 1}) + "\n"
    )
    store = f"sqlite:///{tmp_path / 'other.db'}"
    replayed = subprocess.run(
        [sys.executable, "-m", "{{cookiecutter.package}}.engine.tracking", "replay", str(spill), "--tracking-uri", store],
        capture_output=True, text=True,
    )  # fmt: skip
    assert replayed.returncode == 1
    (said,) = replayed.stderr.splitlines()  # nothing of MLflow's own, the new store's tables included
    assert said.startswith(f"error: could not replay {spill} into {store} (Run with id={'0' * 32} not found); ")


def staged(folder: Path, name: str, text: str = "", image: tuple[int, int] | None = None) -> Path:
    """A file written in `folder`'s staging folder as a hook's would be: in a fresh folder of its
    own; a PNG of `image` (width, height) pixels when given."""
    path = folder / STAGING / f"{name}.d" / name
    path.parent.mkdir(parents=True)
    if image is None:
        path.write_text(text)
    else:
        Image.new("RGB", image, "red").save(path)
    return path


def artifacts_of(client: MlflowClient, run_id: str, folder: str | None = None) -> list[str]:
    found = []
    for entry in client.list_artifacts(run_id, folder):
        found += artifacts_of(client, run_id, entry.path) if entry.is_dir else [entry.path]
    return found


def test_files_and_images_handed_over_reach_the_run_and_leave_no_copy_behind(make_cfg, client, tmp_path, caplog):
    tracker = Tracker(make_cfg().mlflow, tmp_path)
    tracker.open({"seed": "0"}, {}, "seed: 0\n", checkpoint=None, datasets=[])
    tracker.log_artifact(staged(tmp_path, "notes.txt", "seen at step 3"), "texts")
    tracker.log_image(staged(tmp_path, "red.png", image=(6, 4)), "samples/red", 3)
    tracker.finish("FINISHED")
    run_id = tracker.run_id
    assert Path(client.download_artifacts(run_id, "texts/notes.txt")).read_text() == "seen at step 3"
    # MLflow's image slider: each image as a PNG and a smaller WebP named by key (/ as ~) and step.
    images = artifacts_of(client, run_id, "images")
    assert [re.sub(r"\+timestamp\+\d+\+[0-9a-f-]+", "", image) for image in images] == [
        "images/samples~red+step+3+compressed.webp",
        "images/samples~red+step+3.png",
    ]
    assert client.get_run(run_id).data.tags["mlflow.loggedImages"] == "True"
    assert not (tmp_path / STAGING).exists(), "delivered, then deleted, and their folder with them"

    late = staged(tmp_path, "late.txt", "after the end")
    with caplog.at_level(logging.WARNING):
        tracker.log_artifact(late)
    assert f"{late} was handed to MLflow after the end of the run, and is not logged" in caplog.text
    assert not late.exists() and "late.txt" not in artifacts_of(client, run_id)


def test_a_file_handed_over_where_nothing_logs_or_under_a_name_mlflow_refuses_is_deleted_and_refused_at_once(
    make_cfg, tmp_path
):
    untracked = Tracker(make_cfg("mlflow.enabled=false").mlflow, tmp_path)
    assert not untracked.logs
    untracked.log_artifact(path := staged(tmp_path, "notes.txt", "x"))
    assert not path.exists(), "the tracker owns it: nothing would delete it later"
    tracker = Tracker(make_cfg().mlflow, tmp_path)
    with pytest.raises(ValueError, match=r"^the image key 'a:b' is not one MLflow takes; use letters, digits, "):
        tracker.log_image(staged(tmp_path, "a.png", image=(2, 2)), "a:b", 1)
    with pytest.raises(ValueError, match=r"^artifact_path='../up' is no folder of the run's artifacts; give a "):
        tracker.log_artifact(staged(tmp_path, "up.txt"), "../up")
    assert list((tmp_path / STAGING).iterdir()) == [], "a refused file is deleted: nothing would send it later"
    outside = tmp_path / "thesis.txt"
    outside.write_text("mine")
    with pytest.raises(ValueError, match=r"thesis.txt is not a file in .*unsent-files$"):
        tracker.log_artifact(outside)
    assert outside.read_text() == "mine"


def test_files_kept_through_an_outage_are_delivered_when_the_store_returns(tmp_path, monkeypatch):
    monkeypatch.setattr("{{cookiecutter.package}}.engine.tracking.sender.RETRY_SECONDS", 0.05)
    monkeypatch.setattr("{{cookiecutter.package}}.engine.tracking.sender.SEND_EVERY_SECONDS", 0.01)
    clock, store = sender_clock(monkeypatch), Store()
    store.failing = True
    notes, image = staged(tmp_path, "notes.txt", "kept"), staged(tmp_path, "red.png", image=(5, 3))

    def outage_ends() -> None:
        clock.advance(0.1)  # past the send
        store.wait_for(lambda: store.failures >= 1)
        assert notes.exists() and image.exists()
        store.failing = False
        clock.advance(0.1)  # past the retry
        store.wait_for(lambda: len(store.files) == 2)

    files = (
        {"path": f"{STAGING}/notes.txt.d/notes.txt", "artifact_path": "texts"},
        {"path": f"{STAGING}/red.png.d/red.png", "key": "samples", "step": 7, "timestamp": 0},
    )
    confirmed = drain(store, tmp_path / "unsent.jsonl", {}, hold=outage_ends, clock=clock, files=files)
    assert store.files == [("texts/notes.txt", "kept"), ("samples", 7, (5, 3))]
    assert confirmed == [{"file": 0}, {"file": 1}]
    assert not notes.exists() and not image.exists() and not notes.parent.exists()
    assert not (tmp_path / "unsent.jsonl").exists()


def test_files_that_never_got_through_wait_on_disk_and_replay_sends_each_once(tmp_path, client, caplog):
    store = Store()
    store.failing = True
    spill = tmp_path / "unsent-metrics-run.jsonl"
    notes, image = staged(tmp_path, "notes.txt", "kept"), staged(tmp_path, "red.png", image=(5, 3))
    files = (
        {"path": f"{STAGING}/notes.txt.d/notes.txt", "artifact_path": "texts"},
        {"path": f"{STAGING}/red.png.d/red.png", "key": "samples", "step": 7, "timestamp": 1000},
    )
    with caplog.at_level(logging.WARNING):
        confirmed = drain(store, spill, {1: 0.5}, files=files)
    assert confirmed == [1, {"file": 0}, {"file": 1}], "spilled: the trainer has nothing left to keep"
    assert f"1 metrics and 2 files could not reach MLflow; they are in {spill}" in caplog.text
    assert notes.read_text() == "kept" and image.exists(), "a spilled file stays where it is, for replay"
    # A sender killed before it confirmed what it spilled leaves the trainer to spill it again.
    spill.write_text(spill.read_text() + spill.read_text().split("\n", 1)[1])
    run_id = client.create_run(new_experiment(client, "replay-files")).info.run_id
    spilled_for(spill, run_id)

    assert replay(spill, client.tracking_uri) == (1, 2, {})
    assert Path(client.download_artifacts(run_id, "texts/notes.txt")).read_text() == "kept"
    (png,) = [path for path in artifacts_of(client, run_id, "images") if path.endswith(".png")]
    assert png.startswith("images/samples+step+7+timestamp+1000+")
    assert not notes.exists() and not image.exists()
    assert replay(spill, client.tracking_uri) == (1, 0, {}), "running it twice is harmless"
    assert len(artifacts_of(client, run_id, "images")) == 2


def test_a_staged_file_that_became_a_link_or_lies_outside_is_neither_sent_nor_deleted(tmp_path, caplog):
    outside = tmp_path / "thesis.txt"
    outside.write_text("mine")
    link = staged(tmp_path, "notes.txt")
    link.unlink()
    link.symlink_to(outside)
    folder = staged(tmp_path, "thesis.txt").parent  # its folder, replaced by a link to the one outside
    shutil.rmtree(folder)
    folder.symlink_to(tmp_path)
    files = (
        {"path": f"{STAGING}/notes.txt.d/notes.txt", "artifact_path": None},
        {"path": f"{STAGING}/thesis.txt.d/thesis.txt", "artifact_path": None},
        {"path": "thesis.txt", "artifact_path": None},  # a spill file's row, edited
    )
    store = Store()
    with caplog.at_level(logging.WARNING):
        confirmed = drain(store, tmp_path / "unsent.jsonl", {}, files=files)
    assert store.files == [] and confirmed == [{"file": 0}, {"file": 1}, {"file": 2}]
    assert f"{link} is a symbolic link, not a regular file; not logged to MLflow" in caplog.text
    assert f"{folder / 'thesis.txt'} is not a file in {tmp_path / STAGING}; not logged to MLflow" in caplog.text
    assert f"{outside} is not a file in {tmp_path / STAGING}; not logged to MLflow" in caplog.text
    assert outside.read_text() == "mine" and link.is_symlink()


def test_a_sender_killed_before_it_confirmed_a_file_leaves_it_to_the_trainer_which_sends_it_once(
    make_cfg, client, tmp_path, caplog
):
    tracker = Tracker(make_cfg().mlflow, tmp_path)
    tracker.open({"seed": "0"}, {}, "seed: 0\n", checkpoint=None, datasets=[])
    run_id = tracker.run_id  # waits for the sender to open the run
    sender = tracker._sender
    os.kill(sender._child.pid, signal.SIGSTOP)  # it takes no more, and confirms nothing
    image = staged(tmp_path, "red.png", image=(4, 4))
    tracker.log_image(image, "samples", 5)
    while not sender._files:  # handed over: in the pipe, waiting for its confirmation
        time.sleep(0.01)
    sender._child.kill()
    with caplog.at_level(logging.WARNING):
        tracker.finish("FINISHED")
    spill = tmp_path / f"unsent-metrics-{run_id}.jsonl"
    assert f"the MLflow sender process died (exit code -9); the end of the run was kept in {spill}; sent now" in (
        caplog.text
    )
    (png,) = [path for path in artifacts_of(client, run_id, "images") if path.endswith(".png")]
    assert png.startswith("images/samples+step+5+")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert not image.exists() and not spill.exists()


def sender_of(process: subprocess.Popen) -> int:
    """The pid of the MLflow sender process that `process` (python run.py) started."""
    found = subprocess.run(["pgrep", "-P", str(process.pid), "-f", "tracking drain"], capture_output=True, text=True)
    (pid,) = found.stdout.split()
    return int(pid)


def test_a_sender_killed_mid_run_loses_no_metric_and_the_run_still_ends_as_it_did(project):
    home = project / "checkpoints" / configured().name
    process = start(
        project, "trainer.max_steps=100000", "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=50", cold=True
    )
    while not metrics_in(project / "mlflow.db"):  # the sender has opened the run and delivers
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    os.kill(sender_of(process), signal.SIGKILL)
    wait_for_a_save(home, process)  # metrics handed over after the sender died, checkpoint/loss among them
    process.send_signal(signal.SIGTERM)
    output = "".join(process.communicate(timeout=180))
    assert process.returncode == 128 + signal.SIGTERM, output
    saved = newest_valid(home)[1]
    run_id, last = saved["tracker"]["run_id"], saved["step"]
    spill = home / f"unsent-metrics-{run_id}.jsonl"
    said = r"the MLflow sender process died \(exit code -9\); the metrics from step \d+ on were kept in "
    assert re.search(said + re.escape(f"{spill}; sent now, with the end of the run"), output), output
    assert "Traceback" not in output

    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    assert losses(client, run_id).keys() == set(range(1, last + 1)), "every step, once"
    assert all(len(values) == 1 for values in losses(client, run_id).values())
    assert losses(client, run_id, "checkpoint/loss").keys() == {*range(50, last + 1, 50), last}  # the last at SIGTERM
    assert client.get_run(run_id).info.status == "KILLED"
    assert not spill.exists(), "delivered: nothing is left to replay"


def test_what_a_dead_sender_left_waits_in_the_spill_file_while_the_store_is_down(make_cfg, client, tmp_path, caplog):
    tracker = Tracker(make_cfg().mlflow, tmp_path)
    tracker.open({"seed": "0"}, {}, "seed: 0\n", checkpoint=None, datasets=[])
    run_id = tracker.run_id  # waits for the sender to open the run
    tracker.log_metrics({"train/loss": 0.5}, 1)
    tracker.flush()
    tracker._sender._child.kill()
    tracker.log_metrics({"train/loss": 0.25}, 2)
    tracker._cfg.tracking_uri = f"sqlite:///{tmp_path / 'gone' / 'mlflow.db'}"  # the store is down at the end
    with caplog.at_level(logging.WARNING):
        tracker.finish("FINISHED")
    spill = tmp_path / f"unsent-metrics-{run_id}.jsonl"
    rows = [json.loads(line) for line in spill.read_text().splitlines()]
    assert [(row.get("step"), row.get("status")) for row in rows][-1] == (None, "FINISHED")
    assert {row["step"] for row in rows if "step" in row} >= {2}, "what came after the death"
    replay_line = f"python -m {{cookiecutter.package}}.engine.tracking replay {spill}"
    assert f"the run shows RUNNING in MLflow until they are: {replay_line}" in caplog.text
    assert client.get_run(run_id).info.status == "RUNNING", "not FINISHED while its metrics are missing"

    replay(spill, client.tracking_uri)
    assert losses(client, run_id) == {1: [0.5], 2: [0.25]}
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_sender_whose_trainer_is_gone_still_delivers_everything_and_ends_the_run(make_cfg, client, tmp_path):
    """Killed, or done waiting for it (CLOSE_SECONDS), the trainer reads no more confirmations:
    the sender goes on without them."""
    sender = subprocess.Popen(
        [sys.executable, "-m", "{{cookiecutter.package}}.engine.tracking", "drain"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    asked = {
        "mlflow": OmegaConf.to_container(make_cfg().mlflow, resolve=True),
        "spill_dir": str(tmp_path), "params": {}, "tags": {}, "config_yaml": "", "checkpoint": None, "run_id": None,
        "datasets": [], "started": None,
    }  # fmt: skip
    sender.stdin.write(json.dumps({"open": asked}) + "\n")
    sender.stdin.flush()
    run_id = json.loads(sender.stdout.readline())["run_id"]
    sender.stdout.close()  # the trainer is gone
    rows = [["train/loss", float(step), 0, step] for step in range(1, 2501)]
    end = {"status": "KILLED", "end_time": 0, "resumes": 0}
    sender.stdin.write(json.dumps(rows) + "\n" + json.dumps({"end": end}) + "\n")
    sender.stdin.close()
    assert sender.wait(timeout=120) == 0
    assert sorted(losses(client, run_id)) == list(range(1, 2501))
    assert client.get_run(run_id).info.status == "KILLED"


def test_an_untracked_run_keeps_no_metric_waiting_for_a_confirmation(make_cfg, tmp_path):
    (tmp_path / "mlruns").write_text("")  # a file where the artifacts' folder goes: the run cannot open
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(make_cfg(f"mlflow.tracking_uri={store}").mlflow, tmp_path)
    tracker.open({"seed": "0"}, {}, "seed: 0\n", checkpoint=None, datasets=[])
    for step in range(1, 301):
        tracker.log_metrics({"train/loss": 1.0}, step)
    tracker.flush()
    assert tracker.run_id is None  # the sender has answered: untracked
    tracker.finish("FINISHED")  # everything handed over has been through the hand-over thread
    assert len(tracker._sender._unconfirmed) == 0


def test_a_run_of_a_deleted_experiment_continues_in_the_experiment_now_named(make_cfg, client, capfd):
    first = recipe.train(make_cfg("mlflow.experiment_name=deleted-for-good", "trainer.max_steps=10"))
    old = client.get_run(first["run_id"]).info.experiment_id
    client.delete_experiment(old)
    moved = recipe.train(make_cfg("mlflow.experiment_name=moved-on", "trainer.max_steps=20", "resume=last"))
    assert moved["run_id"] not in (None, first["run_id"])
    assert client.get_experiment_by_name("moved-on").experiment_id == client.get_run(moved["run_id"]).info.experiment_id
    assert f"mlflow experiments restore --experiment-id {old}` brings the old one back" in capfd.readouterr().err


def test_a_spill_file_that_is_a_link_is_not_written_through(tmp_path):
    outside, path = tmp_path / "outside.txt", tmp_path / "unsent-metrics-abc.jsonl"
    outside.write_text("mine")
    path.symlink_to(outside)
    row = {"run_id": "abc", "key": "train/loss", "value": 1.0, "timestamp": 0, "step": 1}
    written = spill(path, [row])
    assert outside.read_text() == "mine"
    assert written == tmp_path / f"unsent-metrics-abc.{os.getpid()}.jsonl"
    assert json.loads(written.read_text()) == row


def test_a_line_cut_short_by_a_killed_writer_costs_that_line_alone(tmp_path, client):
    run_id = client.create_run(new_experiment(client, "cut-short")).info.run_id
    path = tmp_path / f"unsent-metrics-{run_id}.jsonl"

    def row(step: int) -> dict:
        return {"run_id": run_id, "key": "train/loss", "value": float(step), "timestamp": 0, "step": step}

    path.write_text(json.dumps(row(1)) + "\n" + json.dumps(row(2))[:30])  # a writer killed mid-line
    spill(path, [row(3)])
    assert replay(path, client.tracking_uri) == (2, 0, {})
    assert losses(client, run_id) == {1: [1.0], 3: [3.0]}


def test_a_line_replay_cannot_send_is_skipped_and_named_and_the_rest_is_sent(tmp_path, client, caplog):
    run = client.create_run(new_experiment(client, "bad-lines"))
    run_id = run.info.run_id
    path = tmp_path / f"unsent-metrics-{run_id}.jsonl"
    end = {"run_id": run_id, "status": "KILLED", "end_time": run.info.start_time + 5, "resumes": 0}

    def row(step: int, **changed) -> str:
        return json.dumps(
            {"run_id": run_id, "key": "train/loss", "value": step / 10, "timestamp": 0, "step": step} | changed
        )

    lines = [
        row(1),
        json.dumps({"run_id": run_id, "key": "train/loss", "timestamp": 0, "step": 2}),  # edited: no value
        row(3, key="loss\x1b[2J!"),  # a key MLflow does not take
        "[4]",
        row(5),
        json.dumps(end | {"status": "DONE"}),
        json.dumps(end),
    ]
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        assert replay(path, client.tracking_uri) == (2, 0, {run_id: "ended KILLED"})
    assert losses(client, run_id) == {1: [0.1], 5: [0.5]}
    assert client.get_run(run_id).info.status == "KILLED"
    skipped = sorted(message for message in caplog.messages if message.startswith("skipping"))
    advice = "; the rest is sent. To send that line too, fix it and run replay again: what was sent is not stored twice"
    assert [message.split(": ", 1)[0] for message in skipped] == [
        f"skipping line {line} of {path}" for line in (2, 3, 4, 6)
    ]
    assert skipped[0] == f"skipping line 2 of {path}: no metric, file or end of a run ({lines[1][:60]}){advice}"
    assert skipped[1].startswith(f"skipping line 3 of {path}: MLflow refused it (") and skipped[1].endswith(advice)
    assert all(message.endswith(advice) for message in skipped) and "\x1b" not in caplog.text


def test_a_staged_hard_link_to_a_file_outside_is_neither_sent_nor_deleted_by_replay(tmp_path, client, caplog):
    outside = tmp_path / "thesis.txt"
    outside.write_text("mine")
    link = tmp_path / STAGING / "notes.txt.d" / "notes.txt"
    link.parent.mkdir(parents=True)
    os.link(outside, link)  # a link in the folder, the file it names elsewhere: what the run writes has one name
    run_id = client.create_run(new_experiment(client, "hard-link")).info.run_id
    path = tmp_path / f"unsent-metrics-{run_id}.jsonl"
    file = {"path": f"{STAGING}/notes.txt.d/notes.txt", "artifact_path": None}
    path.write_text(json.dumps({"run_id": run_id, "file": file}) + "\n")
    with caplog.at_level(logging.WARNING):
        assert replay(path, client.tracking_uri) == (0, 0, {})
    assert f"{link} is a hard link, not a file of the run's own; not logged to MLflow" in caplog.text
    assert artifacts_of(client, run_id) == []
    assert outside.read_text() == "mine" and link.exists() and outside.stat().st_nlink == 2


def test_the_sender_confirms_each_metric_once_delivered_or_spilled(tmp_path):
    store = Store()
    confirmed = drain(store, tmp_path / "unsent.jsonl", {step: 1.0 for step in range(1, 31)})
    assert confirmed and confirmed == sorted(confirmed) and confirmed[-1] == 30
    store.failing = True
    assert drain(store, tmp_path / "unsent.jsonl", {step: 1.0 for step in range(1, 11)})[-1] == 10, "spilled"


def test_a_sender_that_died_leaves_the_end_of_the_run_to_the_trainer(make_cfg, client, tmp_path):
    tracker = Tracker(make_cfg().mlflow, tmp_path)
    tracker.open({"seed": "0"}, {}, "seed: 0\n", checkpoint=None, datasets=[])
    run_id = tracker.run_id  # waits for the sender to open the run
    tracker._sender._child.kill()
    tracker._sender._child.wait()
    tracker.finish("KILLED")
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_moved_store_keeps_its_artifacts_and_new_runs_write_beside_it(make_cfg, tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    first = recipe.train(make_cfg("trainer.max_steps=10", f"mlflow.tracking_uri=sqlite:///{before / 'mlflow.db'}"))
    shutil.move(before, after)
    second = recipe.train(
        make_cfg(
            "trainer.max_steps=10",
            f"mlflow.tracking_uri=sqlite:///{after / 'mlflow.db'}",
            f"checkpoint.dir={tmp_path / 'second'}",
        )
    )
    client, artifacts = MlflowClient(f"sqlite:///{after / 'mlflow.db'}"), (after / "mlruns").as_uri()
    assert client.get_experiment(client.get_run(first["run_id"]).info.experiment_id).artifact_location == artifacts
    run_ids = (first["run_id"], second["run_id"])
    uris = {run_id: client.get_run(run_id).info.artifact_uri for run_id in run_ids}
    assert uris == {run_id: f"{artifacts}/{run_id}/artifacts" for run_id in run_ids}
    assert (after / "mlruns" / second["run_id"] / "artifacts" / "config.yaml").is_file()
    assert not before.exists(), "the old folder is not recreated"
    config = client.download_artifacts(first["run_id"], "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(config).read_text())["trainer"]["max_steps"] == 10


def test_moving_a_store_leaves_artifact_locations_a_user_chose_alone(tmp_path):
    before, after = tmp_path / "before", tmp_path / "after"
    cfg = OmegaConf.structured(
        MlflowConfig(enabled=True, tracking_uri=f"sqlite:///{before / 'mlflow.db'}", experiment_name="ours")
    )
    client = MlflowClient(cfg.tracking_uri)
    ours = experiment_id(client, cfg)
    chosen = {
        "shared": (tmp_path / "shared" / "mlruns").as_uri(),
        "bucket": "s3://bucket/mlruns",
        "ui": (before / "mlruns" / "7").as_uri(),  # what `mlflow ui` run in that folder would choose
    }
    ids = {name: client.create_experiment(name, artifact_location=location) for name, location in chosen.items()}
    run = client.create_run(ids["shared"])
    shutil.move(before, after)

    moved = connect(f"sqlite:///{after / 'mlflow.db'}")
    assert moved.get_experiment(ours).artifact_location == (after / "mlruns").as_uri()
    assert {name: moved.get_experiment(ids[name]).artifact_location for name in chosen} == chosen
    assert moved.get_run(run.info.run_id).info.artifact_uri == run.info.artifact_uri


# What the training process of a one-process run must not import: MLflow and its database layer
# (the sender's), scikit-learn for one data file, DCP for sharded checkpoints: 1 to 2 s each.
NOT_IMPORTED = ("mlflow", "sqlalchemy", "sklearn", "torch.distributed.checkpoint")


def test_the_training_process_leaves_mlflow_to_the_sender_and_imports_only_what_it_uses(project):
    trained = subprocess.run(
        [sys.executable, "-X", "importtime", "run.py", "trainer.max_steps=10", "trainer.log_every_n_steps=1"],
        cwd=project, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    imported = {line.split("|")[-1].strip() for line in trained.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported, "-X importtime lists this process's imports"
    unused = {name for name in imported for banned in NOT_IMPORTED if (name + ".").startswith(banned + ".")}
    assert unused == set()
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    run_id = newest_valid(project / "checkpoints" / configured().name)[1]["tracker"]["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert sorted(losses(client, run_id)) == list(range(1, 11)), "the sender delivered every step"


def test_deleting_the_store_mid_run_costs_one_line_warnings_not_a_traceback(project, save_gate):
    gate = save_gate()  # the run waits at its first save until the store is gone: mid-run, however fast
    process = start(project, "trainer.max_steps=300", "trainer.log_every_n_steps=1", env=gate.env)
    gate.wait(process)
    while not metrics_in(project / "mlflow.db"):  # the sender is connected: it keeps its connection
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    (project / "mlflow.db").unlink()
    assert process.poll() is None, "deleted mid-run"
    gate.release()
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "finished at step 300" in stdout + stderr
    assert "Traceback" not in stderr and "SQLAlchemy database error" not in stderr
    assert "MLflow is not taking metrics (attempt to write a readonly database); training goes on" in stderr
    run_id = newest_valid(project / "checkpoints" / configured().name)[1]["tracker"]["run_id"]
    assert f"could not mark MLflow run {run_id} FINISHED (attempt to write a readonly database)" in stderr


def metrics_in(database: Path) -> int:
    if not database.exists():
        return 0
    with contextlib.closing(sqlite3.connect(database)) as db:
        try:
            return db.execute("SELECT count(*) FROM metrics").fetchone()[0]
        except sqlite3.OperationalError:  # tables not made yet
            return 0


@pytest.mark.parametrize(
    ("uri", "found"),
    [
        ("foo://bar", "mlflow.tracking_uri=foo://bar: MLflow {version} knows no store at foo://"),
        ("not a uri", "mlflow.tracking_uri=not a uri is not a URI (MLflow would take it for a file store folder)"),
        (
            "file:///tmp/mlruns",
            "mlflow.tracking_uri=file:///tmp/mlruns is a file store, which MLflow {version} no longer opens",
        ),
        ("http://", "mlflow.tracking_uri=http:// names no server"),
    ],
)
def test_a_tracking_uri_mlflow_cannot_open_is_refused_in_one_line(uri, found):
    with pytest.raises(RunError) as refused:
        check_tracking_uri(MlflowConfig(enabled=True, tracking_uri=uri, experiment_name="demo"))
    message = str(refused.value)
    assert message.startswith(found.format(version=mlflow.__version__))
    assert "use mlflow.tracking_uri=sqlite:///<folder>/mlflow.db or http://<host>:<port>" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "uri",
    [
        "sqlite:///mlflow.db",
        "sqlite:////nowhere/yet/mlflow.db",
        "http://127.0.0.1:1",  # nothing listens there: that is the Tracker's warning, not a refusal
        "https://mlflow.example.com",
        "postgresql://user@db.example.com/mlflow",
        "postgresql+psycopg2://user@db.example.com/mlflow",
    ],
)
def test_a_tracking_uri_mlflow_can_open_passes_the_check_without_opening_it(uri):
    check_tracking_uri(MlflowConfig(enabled=True, tracking_uri=uri, experiment_name="demo"))


def test_a_file_store_passes_the_check_when_mlflow_is_told_to_allow_it(monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_tracking_uri(MlflowConfig(enabled=True, tracking_uri="file:///tmp/mlruns", experiment_name="demo"))


def test_a_store_mlflow_cannot_build_costs_one_warning_and_training_goes_on(make_cfg, capfd, monkeypatch):
    """Where the preflight cannot tell (an MLflow without its private table of store schemes),
    the store's own failure, met by the sender process, still costs only a warning."""
    monkeypatch.setattr(mlflow_store, "_tracking_store_registry", None)
    summary = recipe.train(make_cfg("trainer.max_steps=10", "mlflow.tracking_uri=foo://bar"))
    assert summary["step"] == 10 and summary["run_id"] is None
    (warning,) = [line for line in capfd.readouterr().err.splitlines() if "MLflow at foo://bar failed" in line]
    assert warning.endswith("training goes on without tracking")


def test_experiments_open_in_the_model_training_view_of_the_mlflow_ui(tmp_path):
    """Without mlflow.experimentKind, MLflow 3's UI opens an experiment on its GenAI traces page."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    older = client.create_experiment("made-before")  # by an earlier version, or by hand
    for name in ("fresh", "made-before"):
        experiment_id(client, MlflowConfig(enabled=True, tracking_uri=uri, experiment_name=name))
    kinds = {
        name: client.get_experiment_by_name(name).tags.get("mlflow.experimentKind") for name in ("fresh", "made-before")
    }
    assert kinds == {"fresh": "custom_model_development", "made-before": "custom_model_development"}
    client.set_experiment_tag(older, "mlflow.experimentKind", "forecasting")  # a kind someone chose stays
    experiment_id(client, MlflowConfig(enabled=True, tracking_uri=uri, experiment_name="made-before"))
    assert client.get_experiment(older).tags["mlflow.experimentKind"] == "forecasting"


@pytest.mark.parametrize(("amp", "tag", "dtype"), [("off", "off", None), ("bf16", "bfloat16", "bfloat16")])
def test_the_amp_settings_recorded_are_those_that_apply(make_cfg, amp, tag, dtype):
    params, tags, _ = record(make_cfg(f"amp={amp}"), World(torch.device("cpu")), {})
    assert tags["amp"] == tag and params.get("amp.dtype") == dtype
    assert params["amp.enabled"] == str(amp != "off")


def test_a_run_is_named_after_its_name_and_its_overrides_and_keeps_the_name_on_resume(project):
    first = run_cli(project, "optimizer=sgd", "trainer.max_steps=10", "device=cpu")
    assert first.returncode == 0, first.stderr
    again = run_cli(project, "optimizer=sgd", "trainer.max_steps=20", "device=cpu", "resume=last")
    assert again.returncode == 0, again.stderr
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    (run,) = runs_named(client, configured().name)
    # device and trainer.max_steps are left out of its name: they move
    assert run.info.run_name == f"{configured().name} optimizer=sgd"
    assert run.data.tags["resumes"] == "1" and "mlflow.run_name" not in run.data.params
    assert "changed settings: trainer.max_steps 10 -> 20, scheduler.total_steps 10 -> 20" in again.stdout + again.stderr


def inputs_of(client: MlflowClient, run_id: str) -> dict[str, tuple[str, str, int]]:
    """The run's dataset inputs by context: name, digest and number of samples."""
    found = {}
    for entry in client.get_run(run_id).inputs.dataset_inputs:
        context = {tag.key: tag.value for tag in entry.tags}["mlflow.data.context"]
        assert context not in found, f"{context} logged twice"
        found[context] = (entry.dataset.name, entry.dataset.digest, json.loads(entry.dataset.profile)["num_samples"])
    return found


def test_the_data_is_logged_as_dataset_inputs_by_split_and_another_split_has_another_digest(
    make_cfg, client, checkpoint_dir
):
    first = recipe.train(make_cfg("trainer.max_steps=20", "data.val_fraction=0.2"))  # the split it counts
    logged = inputs_of(client, first["run_id"])
    assert logged.keys() == {"training", "validation"}
    assert {name for name, _, _ in logged.values()} == {"digits"}
    assert logged["training"][2] + logged["validation"][2] == 1797 and logged["validation"][2] == 359
    resumed = recipe.train(
        make_cfg("trainer.max_steps=40", "resume=last", "data.batch_size=32", "data.val_fraction=0.2")
    )
    assert resumed["run_id"] == first["run_id"]
    assert inputs_of(client, first["run_id"]) == logged, (
        "a resume logs them again, once, and the loader's settings change no digest"
    )
    other = recipe.train(
        make_cfg(
            "name=other",
            f"checkpoint.dir={checkpoint_dir / 'other'}",
            "data.val_fraction=0.1",
            "data.test_fraction=0.1",
            "trainer.max_steps=10",
        )
    )
    split = inputs_of(client, other["run_id"])
    assert split.keys() == {"training", "validation"}, "the test split is eval.py's alone"
    assert split["validation"][1] != logged["validation"][1]


def git(repo: Path, *arguments: str) -> str:
    identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
    return subprocess.run(
        ["git", "-C", str(repo), *identity, *arguments], capture_output=True, text=True, check=True
    ).stdout


def provenance_of(client: MlflowClient, run_id: str, folder: Path) -> dict[str, str]:
    """The run's `provenance/` artifacts, by path under it."""
    found = Path(client.download_artifacts(run_id, "provenance", str(folder)))
    return {str(path.relative_to(found)): path.read_text() for path in sorted(found.rglob("*")) if path.is_file()}


def test_a_run_records_what_it_ran_from_the_diff_of_a_dirty_tree_and_none_of_a_clean_one(
    make_cfg, client, tmp_path, monkeypatch
):
    repo = tmp_path / "project"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "model.py").write_text("width = 1\n")
    (repo / ".gitignore").write_text("data.txt\n")
    (repo / ".cruft.json").write_text(json.dumps({"template": "gh:o/t", "commit": "c0ffee", "checkout": None}))
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    head = git(repo, "rev-parse", "HEAD").strip()
    (repo / "model.py").write_text("width = 2\n")  # tracked, changed
    (repo / "layers.py").write_text("depth = 3\n")  # untracked source
    (repo / "data.txt").write_text("ignored\n")
    monkeypatch.chdir(repo)  # the folder a run starts in: the sender's too
    real_run = subprocess.run

    def trainer_runs_no_git(command, *arguments, **options):
        assert command[0] != "git", "the sender runs git, not the trainer: nothing before step 1 waits on it"
        return real_run(command, *arguments, **options)

    with monkeypatch.context() as patched:
        patched.setattr(subprocess, "run", trainer_runs_no_git)
        settings = ["trainer.max_steps=10", "mlflow.untracked_content=true", f"checkpoint.dir={tmp_path / 'dirty'}"]
        dirty = recipe.train(make_cfg(*settings))["run_id"]
    tags = client.get_run(dirty).data.tags
    assert (tags["git.dirty"], tags["mlflow.source.git.commit"], tags["template.version"]) == ("true", head, "c0ffee")
    files = provenance_of(client, dirty, tmp_path / "dirty-artifacts")
    assert sorted(files) == ["git.diff", "requirements.txt"]
    diff = files["git.diff"]
    assert "-width = 1\n+width = 2\n" in diff and "+++ b/layers.py\n@@ -0,0 +1 @@\n+depth = 3\n" in diff
    assert "data.txt" not in diff
    (tmp_path / "git.diff").write_text(diff)
    git(repo, "apply", "--check", "-R", str(tmp_path / "git.diff"))  # exactly the changes: undone, it leaves HEAD
    installed = files["requirements.txt"].splitlines()
    assert f"torch=={torch.__version__}" in installed and f"mlflow=={mlflow.__version__}" in installed

    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "second")
    settings = ["trainer.max_steps=10", f"checkpoint.dir={tmp_path / 'clean'}"]
    clean = recipe.train(make_cfg(*settings))["run_id"]
    assert client.get_run(clean).data.tags["git.dirty"] == "false"
    (repo / "model.py").write_text("width = 3\n")
    assert recipe.train(make_cfg(*settings, "trainer.max_steps=20", "resume=last"))["run_id"] == clean
    tags = client.get_run(clean).data.tags
    assert (tags["git.dirty"], tags["resume.1.git.dirty"]) == ("false", "true")
    assert tags["resume.1.git.commit"] == tags["mlflow.source.git.commit"] == git(repo, "rev-parse", "HEAD").strip()
    files = provenance_of(client, clean, tmp_path / "clean-artifacts")
    # Each leg's own: the first's stays as it was, with no diff.
    assert sorted(files) == ["requirements.txt", "resume.1/git.diff", "resume.1/requirements.txt"]
    assert "+width = 3\n" in files["resume.1/git.diff"]


def test_a_run_outside_a_git_checkout_and_a_template_records_its_packages_and_an_unknown_template(
    make_cfg, client, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    run_id = recipe.train(make_cfg("trainer.max_steps=10"))["run_id"]
    tags = client.get_run(run_id).data.tags
    assert tags["template.version"] == "unknown" and "git.dirty" not in tags and "mlflow.source.git.commit" not in tags
    assert sorted(provenance_of(client, run_id, tmp_path / "artifacts")) == ["requirements.txt"]


def test_runs_of_every_name_share_the_projects_experiment_each_named_by_its_name(make_cfg, client, tmp_path):
    baseline = recipe.train(make_cfg("name=baseline", f"checkpoint.dir={tmp_path / 'baseline'}"))["run_id"]
    tuned = recipe.train(make_cfg("name=tuned", "optimizer.lr=0.01", f"checkpoint.dir={tmp_path / 'tuned'}"))["run_id"]
    runs = [client.get_run(run_id) for run_id in (baseline, tuned)]
    assert [run.info.run_name for run in runs] == ["baseline", "tuned"]
    (experiment,) = {run.info.experiment_id for run in runs}
    assert client.get_experiment(experiment).name == make_cfg().mlflow.experiment_name
    assert "mlflow.experiment_name" not in runs[0].data.params  # MLflow shows it; a resume may keep another


def test_a_run_of_the_older_grouping_resumes_in_its_own_experiment_and_its_nested_runs_join_it(
    make_cfg, client, tmp_path, capfd
):
    old = recipe.train(make_cfg("name=legacy", "mlflow.experiment_name=legacy", "trainer.max_steps=10"))["run_id"]
    resumed = recipe.train(make_cfg("name=legacy", "trainer.max_steps=20", "resume=last"))
    assert resumed["run_id"] == old
    run = client.get_run(old)
    assert client.get_experiment(run.info.experiment_id).name == "legacy" and "resume.1.mlflow.experiment_name" not in (
        run.data.tags
    )
    assert sorted(losses(client, old)) == list(range(1, 21))
    # An evaluation or a sweep job nests under its parent, in the parent's experiment, whatever its config says.
    cfg = MlflowConfig(enabled=True, tracking_uri=client.tracking_uri, experiment_name="elsewhere", parent_run_id=old)
    opener = mlflow_run.RunOpener(client, cfg)
    opener.create({}, {}, "", started=None)
    assert client.get_run(opener.run_id).info.experiment_id == run.info.experiment_id
    assert client.get_experiment_by_name("elsewhere") is None


@pytest.mark.slow
def test_a_sender_whose_trainer_died_mid_line_ends_instead_of_waiting_for_ever():
    """A kill -9 in the middle of a write larger than the pipe's atomic size leaves the sender a line
    cut short: it ends as at the pipe's end, rather than its reader dying and the sender waiting."""
    command = [sys.executable, "-m", "{{cookiecutter.package}}.engine.tracking", "drain"]
    sender = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, stderr = sender.communicate(b'{"open": {"tracking_uri": "sqlite:///x.db", "na', timeout=120)
    assert sender.returncode == 0, stderr.decode()
