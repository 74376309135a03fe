"""Photograph the MLflow UI of what `make demo` logged, for the README.

Serves demo/my-trainer's MLflow store and opens, in headless Chromium (Debian's `chromium`):
- the demo run's metric charts (train/loss through the resume, checkpoint/loss at each save,
  resume/loss at the resume): docs/mlflow-resumed-run.png;
- the project's runs list (one experiment), whose Dataset and Models columns show the data each
  run read and the model it logged, the evaluation nested under its run: docs/mlflow-runs.png;
- the demo run's best model, with the metrics of its step: docs/mlflow-best-model.png;
- the compare view of the optimizer sweep's two jobs: docs/mlflow-sweep-compare.png.
Run by `make screenshot`.
"""

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "demo" / "my-trainer"
DOCS = ROOT / "docs"
# Chromium renders a single-page app only once its scripts have run: this much virtual time.
RENDER_BUDGET_MS = 120_000
TRAINING = "workflowType=machine_learning"  # MLflow 3 opens in its GenAI view otherwise


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pages(store: str, base: str) -> dict[str, str]:
    """Each picture's name and the address of what it shows, from what `make demo` logged."""
    client = MlflowClient(tracking_uri=store)
    demo = client.get_experiment_by_name(PROJECT.name)  # the project's experiment: all of its runs
    if demo is None:
        sys.exit(f"error: no {PROJECT.name} experiment in {store}; run `make demo`")
    resumed = client.search_runs(
        [demo.experiment_id], "params.name = 'demo' and metrics.`resume/loss` > 0"
    )
    runs = client.search_runs([demo.experiment_id], "params.name = 'compare-optimizers'")
    jobs = [run.info.run_id for run in runs if "mlflow.parentRunId" in run.data.tags]
    if not resumed or len(jobs) != 2:
        sys.exit(f"error: no resumed run or no two sweep jobs in {store}; run `make demo` first")
    run = resumed[0].info.run_id
    newest = [{"field_name": "creation_timestamp", "ascending": False}]
    models = client.search_logged_models(
        experiment_ids=[demo.experiment_id],
        filter_string=f"source_run_id = '{run}'",
        order_by=newest,
    )
    if not models:
        sys.exit(f"error: the demo run logged no model to {store}; run `make demo` first")
    experiment = f"{base}/#/experiments/{demo.experiment_id}"
    return {
        "mlflow-resumed-run.png": f"{experiment}/runs/{run}/model-metrics?{TRAINING}",
        "mlflow-runs.png": f"{experiment}/runs?{TRAINING}",
        "mlflow-best-model.png": f"{experiment}/models/{models[0].model_id}?{TRAINING}",
        "mlflow-sweep-compare.png": (
            f"{base}/#/compare-runs?runs={json.dumps(jobs)}&experiments={json.dumps([demo.experiment_id])}"
        ),
    }


def wait_until_serving(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"error: mlflow ui exited with {server.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    sys.exit(f"error: mlflow ui did not answer at {url} within 60 s")


def photograph(chromium: str, url: str, picture: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:  # chromium's, away from the home folder
        subprocess.run(
            [
                chromium,
                "--headless",
                "--no-sandbox",  # root in a container has no user namespace for the sandbox
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1800,1300",
                f"--virtual-time-budget={RENDER_BUDGET_MS}",
                f"--user-data-dir={profile}",
                f"--screenshot={picture}",
                url,
            ],
            check=True,
            capture_output=True,
        )


def main() -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("error: no chromium on PATH; install it (Debian: apt-get install chromium)")
    store = f"sqlite:///{PROJECT / 'mlflow.db'}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    shown = pages(store, base)
    mlflow = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(
        [str(mlflow), "ui", "--backend-store-uri", store, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_serving(base, server)
        DOCS.mkdir(exist_ok=True)
        for name, url in shown.items():
            photograph(chromium, url, DOCS / name)
            print(f"wrote {(DOCS / name).relative_to(ROOT)}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
