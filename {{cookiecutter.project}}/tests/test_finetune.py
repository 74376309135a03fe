"""Fine-tuning: a new run from another run's model weights (`init.checkpoint`), with layers kept as
built (`init.ignore`), frozen (`init.freeze`) or slower (`optimizer.lr_multipliers`), its lineage
in MLflow, and resumed from its own checkpoints without the source."""

import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import losses, run_cli, runs_named
from mlflow import MlflowClient
from test_distributed import CPU, finished, torchrun
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from {{cookiecutter.package}}.engine import param_groups
from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import sharded
from {{cookiecutter.package}}.engine.checkpoint.onefile import seal
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.checkpoint.schema import Checkpoint
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.models import MLP

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

QUIET = "mlflow.enabled=false"
NEW_HEAD = ["init.checkpoint=demo", "init.ignore=[head.*]", "optimizer.lr_multipliers={body.*: 0.1}"]
# The models whose layers the tests below name (body.1, body.4, head), whatever sizes the configs give them.
TWO_LAYERS, TWO_BLOCKS = "model.hidden_sizes=[128,64]", "model.channels=[16,32]"


@pytest.fixture
def homes(tmp_path):
    """Each run's checkpoints in a home of its name, as by default: a run's name finds them."""
    return tmp_path / "checkpoints"


@pytest.fixture
def train(make_cfg, homes):
    def run(*overrides: str) -> dict:
        return recipe.train(make_cfg(f"checkpoint.dir={homes}/" + "${name}", *overrides))

    return run


def model_of(home) -> dict[str, torch.Tensor]:
    return newest_valid(home).state["model"]


def test_a_new_head_starts_as_built_the_rest_as_the_source_and_a_stop_resumes_without_the_source(
    train, homes, client, monkeypatch, sigterm_at
):
    source = train("name=demo", "trainer.max_steps=20")
    source_checkpoint = homes / "demo" / "step_00000020.pt"
    built = train("name=built", "trainer.max_steps=0")
    started = train("name=ft-started", *NEW_HEAD, "trainer.max_steps=0")
    weights, fresh, start = model_of(homes / "demo"), model_of(homes / "built"), model_of(homes / "ft-started")
    assert start.keys() == weights.keys()
    for key, tensor in start.items():
        expected = fresh[key] if key.startswith("head.") else weights[key]
        assert torch.equal(tensor, expected), key
    assert not torch.equal(start["head.weight"], weights["head.weight"])

    reference = train("name=ft-whole", *NEW_HEAD, "trainer.max_steps=40")
    sigterm_at(25)
    with pytest.raises(SystemExit):
        train("name=ft-stopped", *NEW_HEAD, "trainer.max_steps=40")
    monkeypatch.undo()
    checksum = seal(source_checkpoint)
    shutil.rmtree(homes / "demo")  # a fine-tune's resume never needs its source again
    resumed = train("name=ft-stopped", *NEW_HEAD, "trainer.max_steps=40", "resume=last")
    assert losses(client, resumed["run_id"]) == losses(client, reference["run_id"])
    assert sorted(losses(client, resumed["run_id"])) == list(range(1, 41))
    assert resumed["continuity"] == "ok"

    # The body at a tenth of the head's lr at every step, as the schedule moves both.
    rest, body, lr = (losses(client, resumed["run_id"], f"train/lr{group}") for group in ("/rest", "/body", ""))
    assert rest == lr
    for step in range(1, 41):
        assert body[step][0] == pytest.approx(0.1 * rest[step][0], rel=1e-12), step
    assert rest[40][0] < rest[1][0]

    lineage = {
        "init.source_run_id": source["run_id"],
        "init.source_run_name": "demo",
        "init.source_checkpoint": str(source_checkpoint),
        "init.source_step": "20",
        "init.source_checksum": checksum,
        "init.ignored": "2",
        "init.frozen": "0",
    }
    tags = client.get_run(resumed["run_id"]).data.tags
    assert {key: tags.get(key) for key in lineage} == lineage
    assert newest_valid(homes / "ft-stopped").state["source"]["run_id"] == source["run_id"]
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    fine_tunes = client.search_runs(experiments, f"tags.`init.source_run_id` = '{source['run_id']}'")
    assert {run.info.run_id for run in fine_tunes} == {started["run_id"], reference["run_id"], resumed["run_id"]}
    assert built["run_id"] not in {run.info.run_id for run in fine_tunes}
    assert not any(key.startswith("init.") for key in client.get_run(built["run_id"]).data.tags)


def test_frozen_layers_keep_the_source_weights_and_hold_no_optimizer_state_across_a_resume(
    train, homes, client, monkeypatch, sigterm_at
):
    train("name=demo", "trainer.max_steps=20", QUIET)
    frozen = ["name=ft-frozen", f"init.checkpoint={homes / 'demo' / 'latest'}", "init.freeze=[body.*]"]
    sigterm_at(10)
    with pytest.raises(SystemExit):
        train(*frozen, "trainer.max_steps=20")
    monkeypatch.undo()
    result = train(*frozen, "trainer.max_steps=20", "resume=last")
    weights, saved = model_of(homes / "demo"), newest_valid(homes / "ft-frozen").state
    assert saved["step"] == 20
    for key, tensor in saved["model"].items():
        assert torch.equal(tensor, weights[key]) == key.startswith("body."), key
    # The optimizer knows the head's weight and bias only (numbered 0 and 1 in its one group).
    assert [group["params"] for group in saved["optimizer"]["param_groups"]] == [[0, 1]]
    assert sorted(saved["optimizer"]["state"]) == [0, 1]
    frozen_tensors = [key for key in saved["model"] if key.startswith("body.")]  # as many as the model's layers
    assert client.get_run(result["run_id"]).data.tags["init.frozen"] == str(len(frozen_tensors))


def test_a_source_of_another_model_is_refused_naming_every_mismatch_and_nothing_is_written(train, homes, client):
    train("name=demo", "model=cnn", TWO_BLOCKS, "trainer.max_steps=10", QUIET)
    with pytest.raises(RunError) as raised:
        train("name=ft-wrong-source", "init.checkpoint=demo", TWO_LAYERS, "trainer.max_steps=10")
    assert str(raised.value) == (
        f"{homes / 'demo' / 'step_00000010.pt'} does not fit this model (missing from the checkpoint: body.1.bias, "
        "body.1.weight, body.4.bias, body.4.weight, head.bias, head.weight | not in this model: body.0.bias, "
        "body.0.weight, body.3.bias, body.3.weight, head.2.bias, head.2.weight); if those layers are new, keep "
        "them as built with 'init.ignore=[body.0.*, body.1.*, body.3.*, body.4.*, head.*, head.2.*]'; else "
        "init.checkpoint names a checkpoint of another model"
    )
    assert newest_valid(homes / "ft-wrong-source") is None
    assert runs_named(client, "ft-wrong-source") == []


@pytest.mark.parametrize(
    "setting, said",
    [
        ("init.ignore=[haed.*]", "init.ignore: haed.* matches no key of the model or of "),
        ("init.freeze=[bdy.*]", "init.freeze: bdy.* matches no parameter of the model (it has body.1.weight, "),
        (
            "optimizer.lr_multipliers={bdy.*: 0.1}",
            "optimizer.lr_multipliers: bdy.* matches no parameter that trains and no earlier glob took",
        ),
        (
            "optimizer.lr_multipliers={body.*: 0}",
            "optimizer.lr_multipliers: body.*: 0 must be a positive number; to stop parameters from training, use "
            "init.freeze=[body.*]",
        ),
        ("init.freeze=[*]", "every parameter of the model is frozen (init.freeze): nothing would train"),
        (
            "optimizer.lr_multipliers={body.1.*: 0.1, body.1*: 0.2, head*: 1}",
            "optimizer.lr_multipliers: body.1* matches no parameter that trains and no earlier glob took",
        ),
        (
            "optimizer.lr_multipliers={body.1*: 0.1, body.1.*: 0.2, head*: 1}",
            "optimizer.lr_multipliers: body.1.* matches no parameter that trains and no earlier glob took",
        ),
        ("init.checkpoint=nobody", "init.checkpoint=nobody: no such file or folder; pass the name of a run with"),
        ("init.ignore=[*]", "init.ignore keeps every key of the model as built: nothing of "),
    ],
)
def test_a_glob_or_a_source_that_names_nothing_is_refused_before_anything_is_written(train, homes, setting, said):
    train("name=demo", "trainer.max_steps=10", QUIET)
    with pytest.raises(RunError, match="^" + re.escape(said)):
        train("name=ft-glob", "init.checkpoint=demo", setting, QUIET)
    assert newest_valid(homes / "ft-glob") is None


def test_two_globs_that_would_log_their_lr_under_one_name_are_refused(train):
    layers = "model.hidden_sizes=[8,8,8,8]"  # body.1, body.4, body.7 and body.10
    with pytest.raises(RunError, match=r"two groups would both be logged as train/lr/body\._; give the globs"):
        train("name=ft-names", layers, "optimizer.lr_multipliers={body.?.*: 0.1, body.??.*: 0.2}", QUIET)


def test_a_resume_that_regroups_the_optimizer_is_refused_and_one_with_new_multiples_applies_them(train, client):
    first = train("name=grouped", "optimizer.lr_multipliers={body.*: 0.1}", "trainer.max_steps=10")
    with pytest.raises(RunError, match=r"trained with the optimizer.lr_multipliers globs \['body.\*'\], this run asks"):
        train("name=grouped", "trainer.max_steps=20", "resume=last", QUIET)
    train("name=grouped", "optimizer.lr_multipliers={body.*: 0.5}", "trainer.max_steps=20", "resume=last")
    rest, body = (losses(client, first["run_id"], f"train/lr/{group}") for group in ("rest", "body"))
    for step in range(1, 21):
        multiple = 0.1 if step <= 10 else 0.5  # the new multiple of the same schedule, not compounded
        assert body[step][0] == pytest.approx(multiple * rest[step][0], rel=1e-12), step


def test_a_single_group_at_its_own_multiple_logs_its_lr(train, client):
    result = train(
        "name=head-only", "init.freeze=[body.*]", "optimizer.lr_multipliers={head.*: 2}", "trainer.max_steps=5"
    )
    head, lr = losses(client, result["run_id"], "train/lr/head"), losses(client, result["run_id"], "train/lr")
    assert sorted(head) == list(range(1, 6))
    assert all(head[step][0] == pytest.approx(2 * lr[step][0], rel=1e-12) for step in head)


def test_a_source_among_this_runs_own_checkpoints_is_refused(train, homes):
    train("name=base", "trainer.max_steps=10", QUIET)
    before = sorted(path.name for path in (homes / "base").iterdir())
    for source in ("base", str(homes / "base" / "latest"), str(homes / "base" / "step_00000010.pt")):
        with pytest.raises(RunError, match=r"names this run's own checkpoints .*; a fine-tune is a run of its own"):
            train("name=base", f"init.checkpoint={source}", "resume=auto", "trainer.max_steps=20", QUIET)
    assert sorted(path.name for path in (homes / "base").iterdir()) == before


def test_a_plain_name_is_a_runs_before_it_is_a_folder_of_the_working_directory(train, homes, tmp_path, monkeypatch):
    train("name=src", "trainer.max_steps=10", QUIET)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()  # as in a project: its package folder
    tuned = train("name=from-src", "init.checkpoint=src", "trainer.max_steps=10", QUIET)
    assert tuned["step"] == 10
    assert newest_valid(homes / "from-src").state["source"]["checkpoint"] == str(homes / "src" / "step_00000010.pt")


def test_an_optimizer_in_groups_loads_a_sharded_checkpoint_of_groups_without_their_names(tmp_path, make_cfg):
    """A folder written before the groups had names and multiples (or by a plain optimizer) still loads:
    the config, not the checkpoint, gives the hyperparameters."""
    model = MLP([1, 8, 8], 10, [16])
    plain = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1, 8, 8)).sum().backward()
    plain.step()
    dcp.save(sharded.shards_of(model, plain), checkpoint_id=tmp_path / "old")
    model.zero_grad(set_to_none=True)  # as a run restores: before any backward
    grouped = param_groups.build_optimizer(make_cfg().optimizer, model)
    sharded.load_into(model, grouped, Checkpoint(tmp_path / "old", {"shards": {}}))
    assert torch.equal(grouped.state[model.head.weight]["exp_avg"], plain.state[model.head.weight]["exp_avg"])


class GrowsALayer(MLP):
    """Adds a layer in its first training forward, on a device that is not the run's: what a layer
    built lazily, after the model moved, looks like (the meta device stands for the CPU under cuda)."""

    def forward(self, inputs):
        if self.training and not hasattr(self, "late"):
            self.late = nn.Linear(1, 1, device="meta")
        return super().forward(inputs)


def test_a_layer_built_during_the_first_step_is_caught_by_the_audit_after_it(train, homes):
    with pytest.raises(RunError, match=r"^2 tensor\(s\) not on cpu: model.late.weight is on meta; model.late.bias"):
        train("name=grows", f"model._target_={__name__}.GrowsALayer", "trainer.max_steps=10", QUIET)
    assert newest_valid(homes / "grows") is None


def whole(folder: Path, scratch: Path) -> dict:
    """A sharded checkpoint's model and optimizer as one dict, by torch's own converter."""
    dcp_to_torch_save(folder, scratch / f"{folder.parent.name}.pt")
    return torch.load(scratch / f"{folder.parent.name}.pt", weights_only=False)


def test_a_sharded_checkpoint_of_two_processes_starts_one_process_and_two_under_ddp_and_back_under_fsdp(
    project, tmp_path
):
    homes = project / "checkpoints"
    finished(torchrun(project, "name=big", "trainer.max_steps=10", strategy="fsdp"))
    weights = whole(homes / "big" / "step_00000010", tmp_path)["model"]
    for name, source in (("alone", "big"), ("built", "null")):
        alone = run_cli(project, *CPU, f"name={name}", f"init.checkpoint={source}", "trainer.max_steps=0")
        assert alone.returncode == 0, alone.stderr
    finished(torchrun(project, "name=pair", "init.checkpoint=checkpoints/big/latest", "trainer.max_steps=0"))
    # and a one-file checkpoint into shards, its new head as a fresh run builds it
    new_head = ["name=sharded", "init.checkpoint=pair", "init.ignore=[head.*]", "trainer.max_steps=0"]
    finished(torchrun(project, *new_head, strategy="fsdp"))
    built = torch.load(homes / "built" / "step_00000000.pt", weights_only=True)["model"]
    for name, started in (
        ("alone", torch.load(homes / "alone" / "step_00000000.pt", weights_only=True)["model"]),
        ("pair", torch.load(homes / "pair" / "step_00000000.pt", weights_only=True)["model"]),
        ("sharded", whole(homes / "sharded" / "step_00000000", tmp_path)["model"]),
    ):
        assert started.keys() == weights.keys()
        for key, tensor in started.items():
            expected = built[key] if name == "sharded" and key.startswith("head.") else weights[key]
            assert torch.equal(tensor, expected), (name, key)


def test_an_optimizer_in_groups_resumes_from_one_file_under_fsdp_with_each_state_on_its_parameter(
    project, tmp_path, tmp_path_factory
):
    """The one file numbers the optimizer's parameters in the order of its groups, not the model's: a
    step under fsdp from it moves each state as the same step in one process does."""
    groups = ["name=grouped", *CPU, TWO_LAYERS, "optimizer.lr_multipliers={body.1.*: 0.1}", "resume=auto"]
    assert run_cli(project, *groups, "trainer.max_steps=10").returncode == 0
    alone = shutil.copytree(project, tmp_path_factory.mktemp("alone") / "project")  # step 10, for one process
    for folder, strategy in ((project, "fsdp"), (alone, "single")):
        result = run_cli(folder, *groups, f"strategy={strategy}", "trainer.max_steps=11")
        assert result.returncode == 0, result.stderr
    one_file = torch.load(alone / "checkpoints" / "grouped" / "step_00000011.pt", weights_only=True)["optimizer"]
    numbered = [name for group in ("rest", "body") for name in NAMES[group]]
    assert [group["params"] for group in one_file["param_groups"]] == [[0, 1, 2, 3], [4, 5]]
    resharded = whole(project / "checkpoints" / "grouped" / "step_00000011", tmp_path)["optimizer"]["state"]
    for number, name in enumerate(numbered):
        assert torch.allclose(resharded[name]["exp_avg"], one_file["state"][number]["exp_avg"], atol=1e-7), name


NAMES = {"rest": ["body.4.weight", "body.4.bias", "head.weight", "head.bias"], "body": ["body.1.weight", "body.1.bias"]}


def test_a_sweep_of_fine_tunes_finds_its_source_by_its_run_name(project):
    assert run_cli(project, *CPU, "name=base", "trainer.max_steps=10").returncode == 0
    sweep = ["-m", *CPU, "name=ft", "init.checkpoint=base", "optimizer.lr=1e-3,3e-3", "trainer.max_steps=10"]
    result = run_cli(project, *sweep, timeout=600)
    assert result.returncode == 0, result.stderr
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    jobs = runs_named(client, "ft", "tags.`init.source_run_name` = 'base'")
    assert len(jobs) == 2 and all(job.info.status == "FINISHED" for job in jobs)
