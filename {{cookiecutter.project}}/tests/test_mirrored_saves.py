"""The Checkpointer owns the run's remote folder (checkpoint/manager.py): built where this process
holds that folder for its home (checkpoint/remote/run_folder.held), it mirrors each save from its
own save path and says when another machine took the folder over; the recipe hands it nothing."""

import json

import torch

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.remote import run_folder
from {{cookiecutter.package}}.engine.distributed import World


def test_a_checkpointer_whose_home_is_held_remotely_mirrors_its_saves_and_says_when_the_claim_is_lost(
    bucket, make_cfg, tmp_path
):
    remote, s3 = bucket
    home = tmp_path / "home"
    settings = [f"checkpoint.dir={home}", f"checkpoint.remote={remote}", "checkpoint.remote_wait_s=30"]
    cfg = make_cfg("mlflow.enabled=false", "name=mirrored", *settings)
    with run_folder.held(cfg, swept=False) as held:
        run, checkpoints, found = recipe.setup(cfg, World(torch.device("cpu")), home)
        assert found is None and checkpoints.remote is held and checkpoints.lost is None
        with checkpoints:
            checkpoints.final(1)
        assert held.mirror.wait_for(1, 30)
        bucket_name, prefix = remote.removeprefix("s3://").split("/", 1)
        other = {"holder": "PID 1 on host-b", "pid": 1, "host": "host-b", "home": "/b", "leg": "b", "started": ""}
        other |= {"lease_s": 60, "released": False, "renewals": 0}
        s3.put_object(Bucket=bucket_name, Key=f"{prefix}/mirrored/claim.json", Body=json.dumps(other).encode())
        with checkpoints:
            checkpoints.final(2)
        checkpoints.settle()
        assert checkpoints.lost.startswith(f"lost the claim on {remote}/mirrored to PID 1 on host-b")
    listed = s3.list_objects_v2(Bucket=bucket_name, Prefix=f"{prefix}/mirrored/committed/")["Contents"]
    assert [item["Key"].rpartition("/")[2] for item in listed] == ["step_00000001.json"]
    assert run_folder.held_for(home) is None  # the block's: a later run of this home holds its own
