"""MLflow: one run across resumes, the continuity evidence, and metrics that never wait on, or
die with, the tracking store."""

import json
import logging
import queue
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import losses

from {{cookiecutter.package}} import checkpoints
from {{cookiecutter.package}} import train as recipe
from {{cookiecutter.package}}.tracking import _Sender, replay


def test_a_fresh_run_records_params_tags_metrics_and_the_resolved_config(make_cfg, client, tmp_path):
    summary = recipe.train(make_cfg("trainer.max_steps=40", "trainer.log_every_n_steps=5", "optimizer=sgd"))
    run = client.get_run(summary["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.name"] == "sgd" and run.data.params["trainer.max_steps"] == "40"
    assert run.data.params["model.hidden_sizes"] == "[128, 64]"
    tags = run.data.tags
    assert (tags["device"], tags["device.type"], tags["device.index"], tags["amp"]) == ("cpu", "cpu", "0", "off")
    assert tags["device.name"].startswith("cpu (") and tags["torch"].startswith("2.")
    for key in ("train/loss", "train/lr", "train/samples_per_s", "train/step_time_ms"):
        assert sorted(losses(client, run.info.run_id, key)) == [5, 10, 15, 20, 25, 30, 35, 40], key
    assert sorted(losses(client, run.info.run_id, "checkpoint/loss")) == [10, 20, 30, 40]
    assert sorted(losses(client, run.info.run_id, "val/accuracy")) == [20, 40]
    config = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text())
    assert config["optimizer"]["name"] == "sgd" and config["trainer"]["max_steps"] == 40


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
    make_cfg, client, checkpoint_dir, tmp_path, caplog
):
    first = recipe.train(make_cfg("trainer.max_steps=10"))
    other_store = f"sqlite:///{tmp_path / 'other.db'}"
    with caplog.at_level(logging.INFO):
        resumed = recipe.train(make_cfg("trainer.max_steps=20", "resume=last", f"mlflow.tracking_uri={other_store}"))
    assert resumed["run_id"] != first["run_id"]
    assert f"MLflow run {first['run_id']} is not in {other_store}; continuing in a new run" in caplog.text
    new_run = type(client)(other_store).get_run(resumed["run_id"])
    assert new_run.data.tags["resumed_from_checkpoint"] == str(checkpoint_dir / "step_00000010.pt")
    assert new_run.info.status == "FINISHED"


def test_a_checkpoint_whose_run_was_deleted_in_the_ui_continues_in_a_new_run(make_cfg, client):
    first = recipe.train(make_cfg("trainer.max_steps=10"))
    client.delete_run(first["run_id"])
    resumed = recipe.train(make_cfg("trainer.max_steps=20", "resume=last"))
    assert resumed["run_id"] not in (None, first["run_id"])
    assert client.get_run(resumed["run_id"]).data.tags["resumed_from_checkpoint"].endswith("step_00000010.pt")


def test_a_store_that_fails_after_the_run_opened_ends_it_failed_and_training_goes_on(make_cfg, client, monkeypatch):
    def broken(self, run_id, text, path):
        raise ConnectionError("artifact store is down")

    monkeypatch.setattr(type(client), "log_text", broken)
    summary = recipe.train(make_cfg("trainer.max_steps=10"))
    assert summary["step"] == 10 and summary["run_id"] is None
    (run,) = client.search_runs(
        [client.get_experiment_by_name("demo").experiment_id], order_by=["start_time DESC"], max_results=1
    )
    assert run.info.status == "FAILED"


def test_a_run_that_fails_is_marked_failed_not_left_running(make_cfg, client, checkpoint_dir):
    recipe.train(make_cfg("trainer.max_steps=10"))
    path, saved = checkpoints.newest_valid(checkpoint_dir)
    saved["probe"]["loss"] *= 2
    checkpoints.save(saved, checkpoint_dir, saved["step"], keep_last=3)
    with pytest.raises(recipe.RunError):
        recipe.train(make_cfg("trainer.max_steps=20", "resume=last", "checkpoint.continuity.on_mismatch=error"))
    assert client.get_run(saved["mlflow_run_id"]).info.status == "FAILED"


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
        self.batches: list[list] = []

    def log_batch(self, run_id, metrics):
        self.open.wait()
        if self.failing:
            raise ConnectionError("server went away")
        self.batches.append(list(metrics))


def drain(store, spill: Path, rows_by_step: dict[int, float], *, hold=None) -> None:
    """Runs the sender loop in a thread over metrics handed over one step at a time, the way
    the training process hands them over, then ends it; `hold` runs before the end."""
    incoming: queue.Queue = queue.Queue()
    sender = threading.Thread(target=_Sender(store, "run", spill, incoming).run)
    sender.start()
    for step, value in rows_by_step.items():
        incoming.put([["train/loss", value, 0, step]])
    if hold is not None:
        hold()
    incoming.put(None)
    sender.join(timeout=60)
    assert not sender.is_alive()


def sent_steps(store: Store) -> list[int]:
    return [metric.step for batch in store.batches for metric in batch]


def test_a_hanging_store_delays_delivery_but_every_metric_arrives_in_order_and_in_batches(tmp_path):
    store = Store()
    store.open.clear()  # the store hangs until released
    drain(store, tmp_path / "unsent.jsonl", {step: 1.0 / step for step in range(1, 501)}, hold=store.open.set)
    assert sent_steps(store) == list(range(1, 501))
    assert len(store.batches) < 50, "metrics go in batches, not one call each"
    assert not (tmp_path / "unsent.jsonl").exists()


def test_metrics_kept_through_an_outage_are_sent_when_the_store_returns(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("{{cookiecutter.package}}.tracking.RETRY_SECONDS", 0.05)
    store = Store()
    store.failing = True

    def outage_ends() -> None:
        time.sleep(0.3)  # a few failed tries
        store.failing = False
        time.sleep(0.3)  # a retry while nothing new arrives

    with caplog.at_level(logging.WARNING):
        drain(store, tmp_path / "unsent.jsonl", {step: float(step) for step in range(1, 101)}, hold=outage_ends)
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
    assert f"python -m {{cookiecutter.package}}.tracking replay {spill}" in caplog.text
    run_id = client.create_run(client.create_experiment("replay")).info.run_id
    spill.write_text(spill.read_text().replace('"run_id": "run"', f'"run_id": "{run_id}"'))
    assert replay(spill, client.tracking_uri) == 30
    assert losses(client, run_id) == {step: [step / 10] for step in range(1, 31)}
