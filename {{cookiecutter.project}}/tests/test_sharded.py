"""strategy=fsdp: sharded checkpoints written by torch.distributed.checkpoint, checked before they
load, and resumed on another number of processes. `python run.py strategy=fsdp` is a group of
one process; the torchrun tests use two, gloo on the CPU, no mocked process group. SIGTERM and
kill -9 under fsdp are in test_distributed.py, beside the same tests under ddp."""

import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import configured, losses, run_cli
from test_distributed import CPU, finished, only_run, store, torchrun
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from {{cookiecutter.package}}.engine.checkpoint import dcp_files, sharded
from {{cookiecutter.package}}.engine.checkpoint.home import NAME
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.checkpoint.schema import STATE
from {{cookiecutter.package}}.engine.errors import CheckpointError
from {{cookiecutter.package}}.models import MLP

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

ALONE = ["strategy=fsdp", *CPU, "trainer.log_every_n_steps=1"]


def train_alone(project: Path, *overrides: str):
    result = run_cli(project, *ALONE, *overrides)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


class Payload:
    """What a crafted pickle would run: it leaves a file behind if it ever does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def reseal(folder: Path, name: str) -> None:
    """Gives a changed shard file its new checksum in state.pt, as an attacker who rewrites both would."""
    state = torch.load(folder / STATE, weights_only=True)
    state["shards"][name] = [(folder / name).stat().st_size, dcp_files.file_checksum(folder / name)]
    torch.save(state, folder / STATE)


def test_a_crafted_metadata_is_refused_in_one_line_and_its_payload_never_runs(project, tmp_path):
    train_alone(project, "trainer.max_steps=10", "checkpoint.every_n_steps=5")
    home, marker = project / "checkpoints" / configured().name, tmp_path / "payload-ran"
    newest = home / "step_00000010"
    (newest / sharded.METADATA).write_bytes(pickle.dumps(Payload(marker)))
    reseal(newest, sharded.METADATA)

    named = run_cli(project, *ALONE, "trainer.max_steps=20", f"resume={newest}")
    assert named.returncode == 2 and "Traceback" not in named.stderr
    assert named.stderr.strip() == (
        f"error: {newest} was refused: its .metadata asks for pathlib.Path.touch, which is not DCP metadata and "
        f"could run code; load only checkpoints this project wrote"
    )
    last = run_cli(project, *ALONE, "trainer.max_steps=20", "resume=last")  # falls back to step 5
    assert last.returncode == 0, last.stderr
    assert (
        "skipping a checkpoint" in last.stderr + last.stdout and "resumed at step 5 on cpu" in last.stdout + last.stderr
    )
    assert not marker.exists()


def test_the_metadata_unpickler_admits_dcp_metadata_and_nothing_else(tmp_path):
    genuine = tmp_path / "genuine"
    model = MLP([1, 8, 8], 10, [16])
    dcp.save({"model": model.state_dict()}, checkpoint_id=genuine)  # one process, no group
    assert sharded.shapes(genuine) == {name: tuple(value.shape) for name, value in model.state_dict().items()}

    marker = tmp_path / "payload-ran"
    crafted = tmp_path / "crafted.metadata"
    crafted.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="asks for pathlib.Path.touch"):
        sharded.read_metadata(crafted)
    assert not marker.exists()


def test_values_stored_beside_the_tensors_load_as_plain_values_only(tmp_path):
    """DCP itself would load them with weights_only=False."""
    marker, value = tmp_path / "payload-ran", io.BytesIO()
    torch.save(Payload(marker), value)
    value.seek(0)
    with pytest.raises(CheckpointError, match="a value beside its shards was refused: it asks for "):
        sharded.SafePlanner().load_bytes(None, value)
    assert not marker.exists()


def test_a_damaged_shard_is_found_before_load_and_resume_last_falls_back(project):
    train_alone(project, "trainer.max_steps=10", "checkpoint.every_n_steps=5")
    newest = project / "checkpoints" / configured().name / "step_00000010"
    (shard,) = newest.glob("*.distcp")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    output = train_alone(project, "trainer.max_steps=20", "resume=last")
    assert f"its shard file {shard.name} no longer matches the checksum written at save" in output
    assert "resumed at step 5 on cpu" in output and "(ok)" in output


def test_2_then_1_then_2_processes_train_on_as_one_run_from_the_same_parameters(project, tmp_path):
    cfg = configured()  # the run's name, model and batch size as the project's configs set them
    home, batch = project / "checkpoints" / cfg.name, cfg.data.batch_size
    finished(torchrun(project, "trainer.max_steps=20", strategy="fsdp"))

    # What one process loads from the shards of two equals what torch's own converter reads from them.
    saved = home / "step_00000020"
    dcp_to_torch_save(saved, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)
    model = MLP([1, 8, 8], 10, list(cfg.model.hidden_sizes), dropout=cfg.model.dropout)
    optimizer = torch.optim.AdamW(model.parameters())
    sharded.load_into(model, optimizer, load(saved))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, whole["model"][name]), name
    moments = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moments, whole["optimizer"]["state"]["body.1.weight"]["exp_avg"])

    alone = train_alone(project, "trainer.max_steps=40", "resume=last")
    assert "resumed at step 20 on cpu" in alone and "(ok)" in alone
    assert "the checkpoint holds the random state of 2 process(es), this run has 1" in alone
    assert (
        f"(ok); the global batch changes from {2 * batch} to {batch} samples a step (2 -> 1 processes): resume with "
        f"data.batch_size={2 * batch} or trainer.grad_accum_steps=2 to keep it"
    ) in alone
    again = finished(torchrun(project, "trainer.max_steps=60", "resume=last", strategy="fsdp"))
    assert "resumed at step 40 on cpu" in again and "(ok)" in again
    assert (
        f"the global batch changes from {batch} to {2 * batch} samples a step (1 -> 2 processes): resume with "
        f"data.batch_size={batch // 2}" in again
    )

    run = only_run(store(project), cfg.name)
    assert run.data.tags["resumes"] == "2" and run.data.tags["continuity"] == "ok"
    assert run.data.tags["strategy"] == "fsdp" and run.data.tags["world_size"] == "2"
    assert run.data.params["global_batch"] == str(2 * batch) and run.data.tags["resume.1.global_batch"] == str(batch)
    assert sorted(losses(store(project), run.info.run_id)) == list(range(1, 61))  # each step once
    assert sorted(path.name for path in home.iterdir() if NAME.fullmatch(path.name))[-1] == "step_00000060"


def test_the_gradient_norm_of_a_sharded_model_is_that_of_all_its_gradients(project):
    """Each process holds a shard of the gradients; the logged norm is that of all of them, as one
    process training on the same global batch measures it."""
    same = ["model.dropout=0", "trainer.max_steps=5"]
    finished(torchrun(project, "name=sharded", *same, "data.batch_size=32", strategy="fsdp"))
    train_alone(project, "name=alone", *same, "data.batch_size=64")
    client = store(project)
    sharded_norms, alone_norms = (
        losses(client, only_run(client, name).info.run_id, "train/grad_norm") for name in ("sharded", "alone")
    )
    assert sorted(alone_norms) == list(range(1, 6))
    for step, (value,) in alone_norms.items():
        assert sharded_norms[step][0] == pytest.approx(value, rel=1e-4), step


def test_sharded_and_one_file_checkpoints_resume_each_other(project):
    train_alone(project, "trainer.max_steps=10")
    single = run_cli(project, *CPU, "trainer.max_steps=20", "resume=last")
    assert single.returncode == 0 and "resumed at step 10 on cpu" in single.stderr + single.stdout
    assert (project / "checkpoints" / configured().name / "step_00000020.pt").is_file()
    output = train_alone(project, "trainer.max_steps=30", "resume=last")
    assert "resumed at step 20 on cpu" in output and "(ok)" in output
    assert (project / "checkpoints" / configured().name / "step_00000030").is_dir()


def test_fp16_with_its_grad_scaler_round_trips_through_a_sharded_checkpoint(project):
    """A known failure elsewhere (accelerate issue 4289): the scaler's state lost on resume."""
    train_alone(project, "amp=fp16", "trainer.max_steps=10")
    output = train_alone(project, "amp=fp16", "trainer.max_steps=20", "resume=last")
    assert "resumed at step 10 on cpu" in output and "(ok)" in output
    saved = load(project / "checkpoints" / configured().name / "step_00000020").state
    assert saved["scaler"]["_growth_tracker"] == 20  # counted on from the saved 10, not restarted


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no cuda")
def test_fsdp_with_nccl_on_every_gpu_trains_in_bf16_and_resumes(project):
    gpus, settings = torch.cuda.device_count(), ["device=cuda", "amp=bf16"]
    first = finished(torchrun(project, "trainer.max_steps=20", processes=gpus, device=settings, strategy="fsdp"))
    assert f"{gpus} processes (nccl), this is rank 0" in first
    resumed = finished(
        torchrun(project, "trainer.max_steps=40", "resume=last", processes=gpus, device=settings, strategy="fsdp")
    )
    assert "resumed at step 20 on cuda:0" in resumed and "(ok)" in resumed
