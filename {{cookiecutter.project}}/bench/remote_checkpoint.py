"""What does checkpoint.remote cost training, and how soon after a stop is the newest checkpoint remote?

For the demo model and for a model of about 100M parameters (each with its AdamW state), prints the
median time of a training step while a checkpoint's upload is in flight (the mirror's thread, as a
run has it) against the same steps with nothing uploading (target: within 1.05x), and the time from
the start of a stop's save to its checkpoint being remote: the save, the upload and the manifest
(what a SIGTERM waits for, within checkpoint.remote_wait_s). Without `--remote`, the store is moto's
S3 server on localhost (pip install -e '.[remote,s3-server]'), which keeps what it
is sent in memory: about 65 MiB/s here, a cloud's bucket from a VM in its region is faster.

    python bench/remote_checkpoint.py [--remote s3://<bucket>/<folder> | <path>] [--steps 20]
"""

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from {{cookiecutter.package}}.engine.checkpoint import onefile
from {{cookiecutter.package}}.engine.checkpoint.remote.mirror import Mirror
from {{cookiecutter.package}}.engine.checkpoint.remote.store import Store
from {{cookiecutter.package}}.engine.checkpoint.schema import FORMAT_VERSION


def models() -> dict[str, tuple[nn.Module, int]]:
    """Each model, and the batch size of its steps."""
    return {
        "demo MLP": (
            nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)),
            64,
        ),
        "~100M parameters": (nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(24)]), 8),
    }


@contextlib.contextmanager
def moto_bucket() -> Iterator[str]:
    """A bucket of moto's S3 server on a free port of localhost, for the block; its URL."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"], stdout=log, stderr=subprocess.STDOUT
        )
        try:
            while (found := re.search(r"Running on (http://127\.0\.0\.1:\d+)", Path(log.name).read_text())) is None:
                if server.poll() is not None:
                    sys.exit(f"moto's server did not start: {Path(log.name).read_text()}")
                time.sleep(0.05)
            os.environ.update(
                AWS_ENDPOINT_URL=found[1], AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                AWS_DEFAULT_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
            )  # fmt: skip
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            boto3.client("s3").create_bucket(Bucket=bucket)
            yield f"s3://{bucket}/runs"
        finally:
            server.terminate()
            server.wait()


def measure(name: str, model: nn.Module, batch: int, remote: str, folder: Path, steps: int) -> str:
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters())
    inputs = torch.randn(batch, model[0].in_features)

    def step() -> float:
        started = time.perf_counter()
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - started

    step()  # AdamW's state exists after a step
    home = folder / "home"
    mirror = Mirror(Store(remote), name.replace(" ", "-").replace("~", ""), home, 1, "bench", {})

    def save(number: int) -> Path:
        state = {
            "format_version": FORMAT_VERSION, "step": number, "config": {}, "device": {"type": "cpu"}, "amp": {},
            "versions": {}, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        }  # fmt: skip
        return onefile.save(state, home, keep_last=1)

    alone = [step() for _ in range(steps)]
    path = save(1)
    size = path.stat().st_size
    mirror.landed(path)
    overlapping = []
    while not mirror.wait_for(1, 0) or len(overlapping) == 0:
        overlapping.append(step())
        if len(overlapping) >= steps and not mirror.wait_for(1, 0):
            mirror.wait_for(1, 3600)  # enough steps measured: the upload may finish alone
            break
    started = time.perf_counter()  # a stop: its save, then the wait for the upload
    mirror.landed(save(2))
    said = mirror.settle(3600)
    stop = time.perf_counter() - started
    busy, idle = statistics.median(overlapping), statistics.median(alone)
    return (
        f"{name} ({size / 2**20:,.1f} MiB): a step with an upload in flight {busy * 1000:,.1f} ms vs {idle * 1000:,.1f}"
        f" ms with none = {busy / idle:.2f}x (median of {len(overlapping)} and {len(alone)}); from a stop's save to "
        f"its checkpoint remote {stop:.1f} s ({said})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--remote", help="s3://<bucket>/<folder>, gs://..., az://... or a path; default: moto's server")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        remote = args.remote or stack.enter_context(moto_bucket())
        for name, (model, batch) in models().items():
            with tempfile.TemporaryDirectory() as folder:
                print(
                    f"on cpu, into {Store(remote).url}: {measure(name, model, batch, remote, Path(folder), args.steps)}"
                )


if __name__ == "__main__":
    main()
