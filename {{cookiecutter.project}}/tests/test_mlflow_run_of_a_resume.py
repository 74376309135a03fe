"""Which MLflow run a resume writes into, and what its page says the run trains with now: a run id
read from a checkpoint is continued only where that run is this run (its name, its experiment, this
store), and the `current.<key>` tags hold the settings of the last leg, as params hold the first's."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import losses
from mlflow import MlflowClient

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import onefile
from {{cookiecutter.package}}.engine.distributed import World
from {{cookiecutter.package}}.engine.provenance import record

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

OWN = "continues in a run of its own"


def rewritten(path: Path, to: Path, change: Callable[[dict], object]) -> None:
    """The checkpoint `path` as `to`, its state changed by `change` and sealed again with the project's
    writer, as whoever sends a checkpoint can (the seal is a checksum anyone recomputes, no signature)."""
    state = torch.load(path, weights_only=True)
    change(state)
    to.parent.mkdir(parents=True, exist_ok=True)
    onefile.write(state, to)


def current(client: MlflowClient, run_id: str) -> dict[str, str]:
    return {
        key.removeprefix("current."): value
        for key, value in client.get_run(run_id).data.tags.items()
        if key.startswith("current.")
    }


def lines_naming(text: str, what: str) -> list[str]:
    return [line for line in text.splitlines() if what in line]


def test_a_checkpoint_copied_into_another_names_home_leaves_its_run_alone_and_goes_on_in_a_run_of_its_own(
    make_cfg, client, tmp_path, capfd
):
    demo_home, m1_home = tmp_path / "demo", tmp_path / "m1"
    demo = recipe.train(make_cfg("trainer.max_steps=20", f"checkpoint.dir={demo_home}"))["run_id"]
    before, curve = client.get_run(demo), losses(client, demo)
    # demo's checkpoints copied into m1's home, each naming m1 as its run (the name check passes).
    for path in demo_home.glob("step_*.pt"):
        rewritten(path, m1_home / path.name, lambda state: state["config"].update(name="m1"))
    capfd.readouterr()

    m1 = recipe.train(make_cfg("name=m1", "trainer.max_steps=30", f"checkpoint.dir={m1_home}", "resume=last"))["run_id"]
    experiment, name = make_cfg().mlflow.experiment_name, make_cfg().name
    assert lines_naming(capfd.readouterr().err, demo) == [
        f"{m1_home / 'step_00000020.pt'} names MLflow run {demo}, the run {name!r} in experiment {experiment!r}, not "
        f"this run ('m1' in {experiment!r}); that run is left as it is, and this one {OWN}"
    ]
    after = client.get_run(demo)
    assert (after.data.params, after.data.tags, after.info.status) == (
        before.data.params,
        before.data.tags,
        before.info.status,
    )
    assert losses(client, demo) == curve and "resumes" not in after.data.tags
    run = client.get_run(m1)
    assert m1 not in (None, demo) and run.info.experiment_id == before.info.experiment_id
    assert (run.info.run_name, run.data.params["name"], run.data.tags["resumed_from_run"]) == ("m1", "m1", demo)
    assert run.data.tags["resumed_from_checkpoint"] == str(m1_home / "step_00000020.pt")
    assert sorted(losses(client, m1)) == list(range(21, 31))

    # Each name goes on in its own run, without a word: demo in demo's, m1 in the one opened for it, even from
    # a checkpoint that still names demo's run (saved before m1's sender had answered, as a short leg's is).
    newest = m1_home / "step_00000030.pt"
    rewritten(newest, newest, lambda state: state["tracker"].update(run_id=demo))
    m1_again = recipe.train(make_cfg("name=m1", "trainer.max_steps=40", f"checkpoint.dir={m1_home}", "resume=last"))
    demo_again = recipe.train(make_cfg("trainer.max_steps=30", f"checkpoint.dir={demo_home}", "resume=last"))
    assert (m1_again["run_id"], demo_again["run_id"]) == (m1, demo)
    assert sorted(losses(client, m1)) == list(range(21, 41)) and sorted(losses(client, demo)) == list(range(1, 31))
    assert client.get_run(m1).data.tags["resumes"] == "1" and client.get_run(demo).data.tags["resumes"] == "1"
    assert not lines_naming(capfd.readouterr().err, OWN)


def test_a_checkpoint_whose_run_is_in_another_projects_experiment_goes_on_in_a_run_of_this_projects(
    make_cfg, client, tmp_path, capfd
):
    """Two projects logging to one server: a checkpoint of the other's, under the same name, is not this run."""
    home = tmp_path / "demo"
    theirs = recipe.train(
        make_cfg("mlflow.experiment_name=their-project", "trainer.max_steps=10", f"checkpoint.dir={home}")
    )
    capfd.readouterr()
    ours = recipe.train(make_cfg("trainer.max_steps=20", f"checkpoint.dir={home}", "resume=last"))
    experiment, name = make_cfg().mlflow.experiment_name, make_cfg().name
    assert lines_naming(capfd.readouterr().err, OWN) == [
        f"{home / 'step_00000010.pt'} names MLflow run {theirs['run_id']}, the run {name!r} in experiment "
        f"'their-project', not this run ({name!r} in {experiment!r}); that run is left as it is, and this one {OWN}"
    ]
    assert ours["run_id"] not in (None, theirs["run_id"])
    assert client.get_run(ours["run_id"]).info.experiment_id == client.get_experiment_by_name(experiment).experiment_id
    assert sorted(losses(client, ours["run_id"])) == list(range(11, 21))
    assert sorted(losses(client, theirs["run_id"])) == list(range(1, 11))
    assert "resumes" not in client.get_run(theirs["run_id"]).data.tags


def test_the_current_tags_hold_the_settings_of_the_last_leg_and_the_params_those_of_the_first(make_cfg, client):
    first = ["trainer.max_steps=10", "trainer.grad_clip=1.0", "optimizer.lr=0.003"]
    run_id = recipe.train(make_cfg(*first))["run_id"]
    params = client.get_run(run_id).data.params
    assert current(client, run_id) == params == record(make_cfg(*first), World(torch.device("cpu")), {})[0]

    # A leg with another lr, in bf16, its gradients no longer clipped.
    resumed = ["trainer.max_steps=20", "optimizer.lr=0.01", "amp=bf16", "trainer.grad_clip=null", "resume=last"]
    assert recipe.train(make_cfg(*resumed))["run_id"] == run_id
    now = current(client, run_id)
    assert now == record(make_cfg(*resumed), World(torch.device("cpu")), {})[0]
    assert (now["optimizer.lr"], now["amp.enabled"], now["amp.dtype"]) == ("0.01", "True", "bfloat16")
    assert "trainer.grad_clip" not in now, "a setting null now is no current tag, as it would be no param"
    run = client.get_run(run_id)
    assert {key: run.data.params[key] for key in params} == params, "params keep the first leg's settings"
    assert (run.data.params["optimizer.lr"], run.data.params["amp.enabled"]) == ("0.003", "False")
    assert (run.data.tags["resume.1.optimizer.lr"], run.data.tags["resume.1.amp.dtype"]) == ("0.01", "bfloat16")


def test_a_finished_checkpoint_copied_into_another_names_home_logs_no_model_into_the_run_it_names(
    make_cfg, client, tmp_path, capfd
):
    """A resume with nothing left to train only logs the models its run lacks (mlflow.log_models):
    into its own run, never into the one a copied checkpoint names."""
    demo_home, m1_home = tmp_path / "demo", tmp_path / "m1"
    demo = recipe.train(make_cfg("trainer.max_steps=20", f"checkpoint.dir={demo_home}"))["run_id"]
    for path in demo_home.glob("step_*.pt"):
        rewritten(path, m1_home / path.name, lambda state: state["config"].update(name="m1"))
    capfd.readouterr()

    said = ["name=m1", "trainer.max_steps=20", f"checkpoint.dir={m1_home}", "resume=last", "mlflow.log_models=best"]
    recipe.train(make_cfg(*said))
    assert lines_naming(capfd.readouterr().err, demo) == [
        f"the checkpoint names MLflow run {demo}, the run {make_cfg().name!r} in experiment "
        f"{make_cfg().mlflow.experiment_name!r}, "
        "not this run ('m1'): that run is left as it is, and no model is logged to it"
    ]
    experiment = client.get_run(demo).info.experiment_id
    assert client.search_logged_models(experiment_ids=[experiment], filter_string=f"source_run_id = '{demo}'") == []
