"""A real `mlflow server` on a loopback port: runs reach it over HTTP, and a server that goes
away mid-run costs a warning, not the run."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import losses, run_cli, start
from mlflow import MlflowClient

from {{cookiecutter.package}}.checkpoint.resume import newest_valid

pytestmark = pytest.mark.slow


class Server:
    """`mlflow server` with a sqlite backend in a temporary folder, started and stopped by tests."""

    def __init__(self, folder: Path) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.folder, self.uri, self.process = folder, f"http://127.0.0.1:{self.port}", None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.folder / 'server.db'}",
             "--artifacts-destination", str(self.folder / "artifacts"), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                assert self.process.poll() is None, "mlflow server exited"
                assert time.monotonic() < deadline, "mlflow server did not come up"
                time.sleep(0.5)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


@pytest.fixture
def server(tmp_path):
    server = Server(tmp_path)
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
    (run,) = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["optimizer.lr"] == "0.003" and run.data.tags["device"] == "cpu"
    assert sorted(losses(client, run.info.run_id)) == [5, 10, 15, 20, 25, 30]
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["config.yaml"]


def test_a_server_stopped_mid_run_costs_a_warning_and_replay_later_sends_its_metrics_and_ends_it(project, server):
    home = project / "checkpoints" / "demo"
    process = start(
        project, f"mlflow.tracking_uri={server.uri}", "trainer.max_steps=4000", "checkpoint.every_n_steps=50"
    )
    while not (home / "latest").exists():
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    server.stop()
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    output = stdout + stderr
    assert "MLflow is not taking metrics" in output and "finished at step 4000" in output
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
        [sys.executable, "-m", "{{cookiecutter.package}}.tracking", "replay", str(spill), "--tracking-uri", server.uri],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    *_, sent, ended_line = replayed.stdout.splitlines()  # before them, MLflow's link to the run it ended
    assert sent.startswith("sent ") and ended_line == f"run {run_id}: ended FINISHED"
    assert sorted(losses(client, run_id)) == list(range(10, 4001, 10))
    ended = client.get_run(run_id).info
    assert (ended.status, ended.end_time) == ("FINISHED", end["end_time"])
