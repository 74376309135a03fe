"""A real `mlflow server` on a loopback port: runs reach it over HTTP, and a server that goes
away mid-run costs a warning, not the run."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
from conftest import configured, losses, run_cli, runs_named, start
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid

pytestmark = pytest.mark.slow


LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


class Server:
    """`mlflow server` with a sqlite backend in a temporary folder, started and stopped by tests.
    It listens on a port of the kernel's choosing (port 0: no clash with anything else running)
    and is taken to be up once it says where; each start may get another port, so `uri` changes.
    Its store starts as a copy of `blank`, whose tables are made; and it starts without MLflow's job
    runner, whose seven consumer processes each import MLflow (some 20 CPU-s a start on two cores)
    for jobs that no test here runs, and outlive the server they belong to."""

    def __init__(self, folder: Path, blank: Path) -> None:
        self.folder, self.uri, self.process = folder, None, None
        shutil.copyfile(blank, folder / "server.db")

    def start(self) -> None:
        self.uri = None
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", "0",
             "--backend-store-uri", f"sqlite:///{self.folder / 'server.db'}",
             "--artifacts-destination", str(self.folder / "artifacts"), "--workers", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )  # fmt: skip
        said: list[str] = []
        for line in self.process.stdout:  # until it says where it listens, or ends
            said.append(line)
            if found := LISTENING.search(line):
                self.uri = found[1]
                break
        assert self.uri is not None, "mlflow server exited:\n" + "".join(said)
        # Read on, so that its output never fills the pipe and stalls it.
        threading.Thread(target=self.process.stdout.read, daemon=True).start()
        with urllib.request.urlopen(f"{self.uri}/health") as response:
            assert response.status == 200

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


@pytest.fixture
def server(tmp_path, blank_store):
    server = Server(tmp_path, blank_store)
    server.start()
    yield server
    if server.process.poll() is None:
        server.stop()


def test_a_run_logs_to_a_real_server_over_http(project, server):
    result = run_cli(
        project, f"mlflow.tracking_uri={server.uri}", "trainer.max_steps=30", "trainer.log_every_n_steps=5"
    )
    assert result.returncode == 0, result.stderr
    client = MlflowClient(server.uri)
    (run,) = runs_named(client, configured().name)
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == str(configured().optimizer.lr) and run.data.tags["device"] == "cpu"
    assert sorted(losses(client, run.info.run_id)) == [5, 10, 15, 20, 25, 30]
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["config.yaml", "provenance"]


def test_a_server_stopped_mid_run_costs_a_warning_and_replay_later_sends_its_metrics_and_ends_it(
    project, server, save_gate
):
    home = project / "checkpoints" / configured().name
    gate = save_gate()  # the run waits at its first save while the server stops: it is mid-run, however fast
    process = start(
        project, f"mlflow.tracking_uri={server.uri}", "trainer.max_steps=400", "checkpoint.every_n_steps=50",
        "trainer.log_every_n_steps=10", env=gate.env,
    )  # fmt: skip
    gate.wait(process)
    server.stop()
    gate.release()
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    output = stdout + stderr
    assert "MLflow is not taking metrics" in output and "finished at step 400" in output
    run_id = newest_valid(home)[1]["tracker"]["run_id"]
    spill = home / f"unsent-metrics-{run_id}.jsonl"
    assert f"they are in {spill}" in output
    assert f"could not mark MLflow run {run_id} FINISHED (" in output
    end = json.loads(spill.read_text().splitlines()[-1])
    assert (end["run_id"], end["status"], end["resumes"]) == (run_id, "FINISHED", 0)

    server.start()  # the same store comes back; what the run kept goes in now, and the run ends
    client = MlflowClient(server.uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    replayed = subprocess.run(
        [sys.executable, "-m", "{{cookiecutter.package}}.engine.tracking", "replay", str(spill), "--tracking-uri", server.uri],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    *_, sent, ended_line = replayed.stdout.splitlines()  # before them, MLflow's link to the run it ended
    assert sent.startswith("sent ") and ended_line == f"run {run_id}: ended FINISHED"
    assert sorted(losses(client, run_id)) == list(range(10, 401, 10))
    ended = client.get_run(run_id).info
    assert (ended.status, ended.end_time) == ("FINISHED", end["end_time"])
