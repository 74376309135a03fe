"""Photograph the MLflow UI of the run `make demo` trained and resumed, for the README.

Serves demo/my-trainer's MLflow store, opens the run's metric charts (train/loss through the
resume, checkpoint/loss at each save, resume/loss at the resume) in headless Chromium (Debian's
`chromium` package) and writes docs/mlflow-resumed-run.png. Run by `make screenshot`.
"""

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "demo" / "my-trainer"
PICTURE = ROOT / "docs" / "mlflow-resumed-run.png"
# Chromium renders a single-page app only once its scripts have run: this much virtual time.
RENDER_BUDGET_MS = 120_000


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def resumed_run(store: str) -> tuple[str, str]:
    """The demo experiment's id and its run that holds a resume/loss."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("demo")
    if experiment is None:
        sys.exit(f"error: no experiment 'demo' in {store}; run `make demo` first")
    runs = client.search_runs([experiment.experiment_id], "metrics.`resume/loss` > 0")
    if not runs:
        sys.exit(f"error: no resumed run in {store}; run `make demo` first")
    return experiment.experiment_id, runs[0].info.run_id


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


def main() -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("error: no chromium on PATH; install it (Debian: apt-get install chromium)")
    store = f"sqlite:///{PROJECT / 'mlflow.db'}"
    experiment, run = resumed_run(store)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    mlflow = Path(sys.executable).with_name("mlflow")
    server = subprocess.Popen(
        [str(mlflow), "ui", "--backend-store-uri", store, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_serving(base, server)
        PICTURE.parent.mkdir(exist_ok=True)
        with tempfile.TemporaryDirectory() as profile:  # chromium's, away from the home folder
            subprocess.run(
                [
                    chromium,
                    "--headless",
                    "--no-sandbox",  # root in a container has no user namespace for the sandbox
                    "--disable-gpu",
                    "--hide-scrollbars",
                    "--window-size=1600,1500",
                    f"--virtual-time-budget={RENDER_BUDGET_MS}",
                    f"--user-data-dir={profile}",
                    f"--screenshot={PICTURE}",
                    f"{base}/#/experiments/{experiment}/runs/{run}/model-metrics?workflowType=machine_learning",
                ],
                check=True,
                capture_output=True,
            )
    finally:
        server.terminate()
        server.wait()
    print(f"wrote {PICTURE.relative_to(ROOT)} (run {run})")


if __name__ == "__main__":
    main()
