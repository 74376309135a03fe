"""A resumed run continues exactly: the same `train/loss` at every step as a run never stopped."""

import json
import logging
import os
import re
import signal
import time

import pytest
import torch
from conftest import losses, runs_named
from torch.utils.data import TensorDataset

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine import validation as evaluation
from {{cookiecutter.package}}.engine.checkpoint.home import GOODPUT as LEDGER
from {{cookiecutter.package}}.engine.checkpoint.home import best_of, path_of
from {{cookiecutter.package}}.engine.checkpoint.manager import Checkpointer
from {{cookiecutter.package}}.engine.checkpoint.onefile import save
from {{cookiecutter.package}}.engine.checkpoint.resume import newest_valid
from {{cookiecutter.package}}.engine.distributed import World
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.probe import Probe
from {{cookiecutter.package}}.engine.ready.datasets import digits

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# 22 batches an epoch: a stop at step 30 is mid-epoch, 8 batches into the second one.
STOP_AT, MAX_STEPS = 30, 60
QUIET = "mlflow.enabled=false"


def run_id_of(checkpoint_dir) -> str:
    return newest_valid(checkpoint_dir)[1]["tracker"]["run_id"]


# The default settings in the daily loop; the variants under --all (each is three trainings).
@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(["optimizer=adamw", "amp=off"], marks=pytest.mark.daily),
        ["optimizer=adamw", "amp=bf16"],
        ["optimizer=sgd", "amp=off"],
        ["optimizer=sgd", "amp=bf16"],
        ["optimizer=adamw", "optimizer.fused=true"],
        ["optimizer=sgd", "trainer.grad_accum_steps=2"],
        ["model=cnn", "trainer.channels_last=true"],
    ],
    ids=" ".join,
)
def test_resume_after_sigterm_mid_epoch_matches_the_uninterrupted_run_bit_for_bit(
    make_cfg, client, checkpoint_dir, tmp_path, monkeypatch, sigterm_at, settings
):
    common = [*settings, f"trainer.max_steps={MAX_STEPS}", "checkpoint.every_n_steps=25"]
    reference = recipe.train(make_cfg(*common, f"checkpoint.dir={tmp_path / 'reference'}"))
    expected = losses(client, reference["run_id"])
    assert sorted(expected) == list(range(1, MAX_STEPS + 1))

    sigterm_at(STOP_AT)
    with pytest.raises(SystemExit) as stopped:
        recipe.train(make_cfg(*common))
    assert stopped.value.code == 128 + signal.SIGTERM
    path, saved = newest_valid(checkpoint_dir)
    batches = STOP_AT * saved["config"]["trainer"]["grad_accum_steps"]
    data = saved["config"]["data"]  # the demo's digits, as the project's configs size them
    per_epoch = len(digits(data["val_fraction"], data["test_fraction"]).train) // data["batch_size"]
    position = {"epoch": batches // per_epoch, "sample": data["batch_size"] * (batches % per_epoch), "order": "feistel"}
    assert (saved["step"], saved["position"]) == (STOP_AT, position)
    monkeypatch.undo()

    resumed = recipe.train(make_cfg(*common, "resume=last"))
    assert resumed["run_id"] == saved["tracker"]["run_id"], "the resume continues the same MLflow run"
    assert losses(client, resumed["run_id"]) == expected
    assert resumed["val/loss"] == reference["val/loss"]


def test_checkpoint_verify_false_trusts_the_file_and_so_resumes_from_a_damaged_one(make_cfg, checkpoint_dir):
    recipe.train(make_cfg(QUIET, "trainer.max_steps=10"))
    newest = path_of(checkpoint_dir, 10)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern in the weights: torch.load reads it all the same
    newest.write_bytes(bytes(data))
    cpu = World(torch.device("cpu"))
    with pytest.raises(RunError, match="holds checkpoints, but none loads"):
        recipe.setup(make_cfg(QUIET, "resume=last"), cpu, checkpoint_dir)
    run, _, (path, _) = recipe.setup(make_cfg(QUIET, "resume=last", "checkpoint.verify=false"), cpu, checkpoint_dir)
    assert path == newest and run.step == 10


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta parameter")  # meta tensors hold no data
@pytest.mark.daily
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_setup_restores_after_the_move_so_every_tensor_lands_on_the_target_device(make_cfg, checkpoint_dir, model):
    """The recipe's own setup, on the `meta` stand-in for an accelerator: the restored optimizer
    state follows the parameters to the device, and the audit in setup passes."""
    recipe.train(make_cfg(QUIET, f"model={model}", "trainer.max_steps=10"))
    meta = torch.device("meta")
    run, _, (path, _) = recipe.setup(make_cfg(QUIET, f"model={model}", "resume=last"), World(meta), checkpoint_dir)
    assert path.name == "step_00000010.pt" and run.step == 10
    states = [state for param in run.model.parameters() for state in run.optimizer.state[param].values()]
    assert states and {state.device for state in states if state.dim() > 0} == {meta}


def test_resume_with_a_new_learning_rate_applies_it_and_says_so(make_cfg, client, caplog):
    first = recipe.train(make_cfg("scheduler=constant", "trainer.max_steps=20", "optimizer.lr=3e-3"))
    assert losses(client, first["run_id"], "train/lr")[20] == [3e-3]
    with caplog.at_level(logging.INFO):
        resumed = recipe.train(
            make_cfg("scheduler=constant", "trainer.max_steps=30", "optimizer.lr=1e-4", "resume=last")
        )
    assert losses(client, resumed["run_id"], "train/lr")[21] == [1e-4]
    assert re.search(r"resuming with changed settings: .*optimizer\.lr 0\.003 -> 0\.0001", caplog.text)
    tags = client.get_run(resumed["run_id"]).data.tags
    assert tags["resume.1.optimizer.lr"] == "0.0001" and tags["resumes"] == "1"


def test_resume_into_a_changed_model_names_the_mismatching_keys(make_cfg, checkpoint_dir):
    recipe.train(make_cfg("trainer.max_steps=10", "mlflow.enabled=false", "model.hidden_sizes=[128,64]"))
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg("trainer.max_steps=20", "mlflow.enabled=false", "model.hidden_sizes=[32]", "resume=last"))
    message = str(raised.value)
    assert "the checkpoint does not fit this model" in message
    assert "not in this model: body.4.bias, body.4.weight" in message
    assert "body.1.weight (128, 64) in the checkpoint vs (32, 64) now" in message


def test_resume_with_another_optimizer_type_fails_clearly(make_cfg):
    recipe.train(make_cfg("trainer.max_steps=10", "mlflow.enabled=false"))
    with pytest.raises(RunError, match="trained with optimizer torch.optim.AdamW, this run asks for torch.optim.SGD"):
        recipe.train(make_cfg("trainer.max_steps=20", "mlflow.enabled=false", "optimizer=sgd", "resume=last"))


@pytest.mark.parametrize(
    "before, after, note",
    [
        ("fp16", "off", "GradScaler state is not needed and is skipped"),
        ("off", "fp16", "starting a fresh GradScaler"),
    ],
)
def test_amp_switched_between_fp16_and_off_across_a_resume_works(make_cfg, client, caplog, before, after, note):
    recipe.train(make_cfg(f"amp={before}", "trainer.max_steps=20"))
    with caplog.at_level(logging.INFO):
        resumed = recipe.train(make_cfg(f"amp={after}", "trainer.max_steps=30", "resume=last"))
    assert note in caplog.text
    assert sorted(losses(client, resumed["run_id"])) == list(range(1, 31))
    assert client.get_run(resumed["run_id"]).data.tags["continuity"] == "ok"  # within rtol across dtypes


def test_a_fp16_checkpoint_carries_the_scaler_state(make_cfg, checkpoint_dir):
    recipe.train(make_cfg("amp=fp16", "trainer.max_steps=10", "mlflow.enabled=false"))
    scaler = newest_valid(checkpoint_dir)[1]["scaler"]
    assert scaler["scale"] > 0 and "_growth_tracker" in scaler


def test_a_fresh_run_refuses_to_overwrite_a_named_runs_checkpoints(make_cfg, checkpoint_dir):
    recipe.train(make_cfg("trainer.max_steps=10", "mlflow.enabled=false"))
    saved = {path.name: path.read_bytes() for path in checkpoint_dir.glob("step_*")}
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg("trainer.max_steps=10", "mlflow.enabled=false"))
    assert (
        f"already holds checkpoints of {make_cfg().name!r}; continue them with name={make_cfg().name} "
        f"checkpoint.dir={checkpoint_dir} "
        "resume=last, or start a separate run with name=<new name>"
    ) in str(raised.value)
    assert {path.name: path.read_bytes() for path in checkpoint_dir.glob("step_*")} == saved


def mlflow_record(client, run_id: str) -> dict:
    """Everything MLflow holds of a run: status, params, tags and every value of every metric."""
    run = client.get_run(run_id)
    histories = {
        key: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key)]
        for key in run.data.metrics
    }
    return {"status": run.info.status, "params": run.data.params, "tags": run.data.tags, "metrics": histories}


def test_a_checkpoint_of_another_run_is_refused_and_that_run_is_left_as_it_was(
    make_cfg, client, checkpoint_dir, tmp_path
):
    other = recipe.train(make_cfg("name=other-run", "trainer.max_steps=20"))
    files = {path.name: path.read_bytes() for path in checkpoint_dir.iterdir() if path.name != "run.lock"}
    record = mlflow_record(client, other["run_id"])
    refusal = (
        "{path} is a checkpoint of the run 'other-run', not of '{name}'; continue that run with name=other-run "
        "resume=last, or drop resume= and start this one from its weights with init.checkpoint={path}"
    )
    step_10 = checkpoint_dir / "step_00000010.pt"
    with pytest.raises(RunError) as raised:  # a new name, from one of its checkpoints
        recipe.train(
            make_cfg("name=ft", f"checkpoint.dir={tmp_path / 'ft'}", f"resume={step_10}", "trainer.max_steps=30")
        )
    assert str(raised.value) == refusal.format(path=step_10, name="ft")
    with pytest.raises(RunError) as raised:  # a new name on its folder
        recipe.train(make_cfg("name=t6y", "resume=last", "trainer.max_steps=30"))
    assert str(raised.value) == refusal.format(path=checkpoint_dir / "step_00000020.pt", name="t6y")
    assert {path.name: path.read_bytes() for path in checkpoint_dir.iterdir() if path.name != "run.lock"} == files
    assert mlflow_record(client, other["run_id"]) == record
    assert runs_named(client, "ft") == runs_named(client, "t6y") == []


def test_a_resume_that_changes_the_global_batch_says_so_with_the_settings_that_keep_it(make_cfg, client, caplog):
    recipe.train(make_cfg("trainer.max_steps=10", "data.batch_size=64"))
    with caplog.at_level(logging.INFO):
        resumed = recipe.train(make_cfg("trainer.max_steps=20", "resume=last", "data.batch_size=32"))
    said = (
        r"resumed at step 10 on cpu: loss at save \S+, loss now \S+ \(ok\); the global batch changes from 64 to 32 "
        r"samples a step: resume with data\.batch_size=64 or trainer\.grad_accum_steps=2 to keep it$"
    )
    assert re.search(said, caplog.text, re.MULTILINE), caplog.text
    run = client.get_run(resumed["run_id"])
    assert run.data.params["global_batch"] == "64" and run.data.tags["resume.1.global_batch"] == "32"


def test_resume_auto_continues_when_there_is_a_checkpoint_and_starts_fresh_when_not(make_cfg, caplog):
    with caplog.at_level(logging.INFO):
        first = recipe.train(make_cfg("trainer.max_steps=10", "resume=auto"))
        assert "resume=auto: no checkpoint" in caplog.text
        second = recipe.train(make_cfg("trainer.max_steps=20", "resume=auto"))
    assert second["run_id"] == first["run_id"] and second["step"] == 20


def test_a_probe_loss_that_no_longer_matches_is_flagged_or_stops_the_run(make_cfg, checkpoint_dir, client, caplog):
    recipe.train(make_cfg("trainer.max_steps=10"))
    path, saved = newest_valid(checkpoint_dir)
    saved["probe"]["loss"] += 0.5  # as if the weights had not been restored faithfully
    save(saved, checkpoint_dir, keep_last=3)
    with pytest.raises(RunError, match=r"resumed at step 10 on cpu: loss at save .* \(mismatch\)"):
        recipe.train(make_cfg("trainer.max_steps=20", "resume=last", "checkpoint.continuity.on_mismatch=error"))
    with caplog.at_level(logging.WARNING):
        resumed = recipe.train(make_cfg("trainer.max_steps=20", "resume=last"))
    assert "(mismatch): exact match expected on the same device and dtype" in caplog.text
    assert client.get_run(resumed["run_id"]).data.tags["continuity"] == "mismatch"


def test_resuming_an_earlier_checkpoint_makes_it_the_line_that_resume_last_continues(make_cfg, checkpoint_dir):
    saves = (QUIET, "checkpoint.every_n_steps=10", "checkpoint.keep_last=3")  # the steps 20, 30 and 40 kept
    recipe.train(make_cfg(*saves, "trainer.max_steps=40"))
    recipe.train(make_cfg(*saves, "trainer.max_steps=25", f"resume={checkpoint_dir / 'step_00000020.pt'}"))
    assert newest_valid(checkpoint_dir)[1]["step"] == 25
    (set_aside,) = checkpoint_dir.glob("set-aside-*-after-step-20")
    assert sorted(path.name for path in set_aside.iterdir()) == ["step_00000030.pt", "step_00000040.pt"]
    assert recipe.train(make_cfg(*saves, "trainer.max_steps=30", "resume=last"))["step"] == 30


def test_a_batch_larger_than_the_training_set_is_refused_instead_of_spinning(make_cfg):
    with pytest.raises(RunError, match="data.batch_size=5000 is larger than the 1438 training samples"):
        recipe.train(make_cfg(QUIET, "data.batch_size=5000", "data.val_fraction=0.2"))


def test_a_validation_fraction_too_small_to_hold_a_sample_is_refused_before_training(make_cfg):
    with pytest.raises(
        RunError, match=r"data \(.*digits\): val_fraction=0.0001 leaves 0 of 1797 samples for validation"
    ):
        recipe.train(make_cfg(QUIET, "data.val_fraction=0.0001"))


class Counter:
    """A part a user adds: anything with state_dict and load_state_dict."""

    def __init__(self) -> None:
        self.saves = 0

    def state_dict(self) -> dict:
        self.saves += 1
        return {"saves": self.saves}

    def load_state_dict(self, state: dict) -> None:
        self.saves = state["saves"]


def test_a_part_handed_to_the_checkpointer_is_saved_and_restored_and_an_older_checkpoint_without_it_is_named(
    make_cfg, checkpoint_dir, monkeypatch
):
    recipe.train(make_cfg(QUIET, "trainer.max_steps=10", "checkpoint.every_n_steps=5"))  # before the part existed
    counters, real_init = [], Checkpointer.__init__

    def with_a_counter(self, cfg, world, strategy, parts, **hooks) -> None:
        counters.append(Counter())
        real_init(self, cfg, world, strategy, {**parts, "counter": counters[-1]}, **hooks)

    monkeypatch.setattr(Checkpointer, "__init__", with_a_counter)
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(QUIET, "trainer.max_steps=20", "resume=last"))
    assert str(raised.value) == (
        f"{path_of(checkpoint_dir, 10)} holds no counter, which this run saves; resume from a checkpoint of this "
        f"version of the project, or start a new run with name=<new name>"
    )
    counted = [f"checkpoint.dir={checkpoint_dir.parent / 'counted'}", "checkpoint.every_n_steps=5"]
    recipe.train(make_cfg(QUIET, *counted, "trainer.max_steps=10"))
    assert newest_valid(checkpoint_dir.parent / "counted").state["counter"] == {"saves": 2}
    recipe.train(make_cfg(QUIET, *counted, "trainer.max_steps=15", "resume=last"))
    assert counters[-1].saves == 3 and newest_valid(checkpoint_dir.parent / "counted").state["counter"] == {"saves": 3}


def test_the_probe_is_evaluated_in_batches_of_the_size_it_was_saved_with(make_cfg, checkpoint_dir):
    """Its samples in one batch could cost more memory than any training step (long sequences);
    in training's batches they cost no more, and a resume evaluates the same batches as the save."""
    recipe.train(make_cfg("trainer.max_steps=20", "data.batch_size=64"))
    assert newest_valid(checkpoint_dir)[1]["probe"]["batch_size"] == 64
    resumed = recipe.train(make_cfg("trainer.max_steps=30", "data.batch_size=32", "resume=last"))
    assert resumed["continuity"] == "ok"

    samples = TensorDataset(torch.arange(10.0))
    probe = Probe(samples, size=10, batch_size=4)
    device = make_cfg().device
    assert [len(batch) for (batch,) in probe.loader(device)] == [4, 4, 2]
    probe.load_state_dict({"indices": torch.arange(10), "loss": 0.5, "batch_size": 3})
    assert [len(batch) for (batch,) in probe.loader(device)] == [3, 3, 3, 1] and probe.measured_alike
    # Saved before probes had a batch size: measured whole, compared within rtol (its rounding differs).
    probe.load_state_dict({"indices": torch.arange(10), "loss": 0.5})
    assert [len(batch) for (batch,) in probe.loader(device)] == [10] and not probe.measured_alike


# --- A stop during validation -------------------------------------------------------------------

# 23 batches: the digits' 359 validation samples in batches of 16.
LONG_VALIDATION = [
    "data.batch_size=16",
    "data.val_fraction=0.2",
    "trainer.max_steps=40",
    "trainer.val_every_n_steps=20",
]


class Tripwire:
    """A validation's loader, read through: this process is sent SIGTERM as batch `at` is handed
    out (the validation is then under way, by construction), and the batches handed out after it
    are counted."""

    def __init__(self, loader, at: int) -> None:
        self.loader, self.at, self.after = loader, at, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for index, batch in enumerate(self.loader):
            if index == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
            self.after += index > self.at
            yield batch


@pytest.fixture
def sigterm_in_validation(monkeypatch):
    """sigterm_in_validation(step, batch): SIGTERM as the validation at `step` reaches `batch`; returns
    the Tripwire, and the seconds that validation took, once it has run."""
    real_evaluate = evaluation.evaluate

    def arm(step: int, batch: int) -> dict:
        seen = {}

        def evaluate(run, loader, *args, **kwargs):
            if run.step != step or loader is not run.val_loader or seen:
                return real_evaluate(run, loader, *args, **kwargs)
            seen["tripwire"] = Tripwire(loader, batch)
            began = time.perf_counter()
            try:
                return real_evaluate(run, seen["tripwire"], *args, **kwargs)
            finally:
                seen["seconds"] = time.perf_counter() - began

        monkeypatch.setattr(evaluation, "evaluate", evaluate)
        return seen

    return arm


def test_a_sigterm_during_validation_leaves_it_within_a_batch_saves_and_resumes_bit_for_bit(
    make_cfg, client, checkpoint_dir, tmp_path, monkeypatch, sigterm_in_validation, caplog
):
    reference = recipe.train(make_cfg(*LONG_VALIDATION, f"checkpoint.dir={tmp_path / 'reference'}"))

    seen = sigterm_in_validation(20, batch=2)
    with caplog.at_level(logging.INFO), pytest.raises(SystemExit) as stopped:
        recipe.train(make_cfg(*LONG_VALIDATION))
    assert stopped.value.code == 128 + signal.SIGTERM
    tripwire = seen["tripwire"]
    assert len(tripwire) == 23 and tripwire.after == 0, "no batch after the one the signal came in"
    path, saved = newest_valid(checkpoint_dir)
    assert saved["step"] == 20 and saved["monitor"]["owed"] == [20, losses(client, saved["tracker"]["run_id"])[20][0]]
    assert saved["score"] is None and best_of(checkpoint_dir) == path_of(checkpoint_dir, 10), "step 20 ranks nothing"
    said = next(line for line in caplog.messages if line.startswith("stopped at step"))
    assert re.fullmatch(
        rf"stopped at step 20 by SIGTERM during validation, left at a batch boundary \d+\.\d\d s after the signal; "
        rf"saved {re.escape(str(path))}; continue with name={re.escape(saved['config']['name'])} resume=last",
        said,
    ), said
    leg = json.loads((checkpoint_dir / LEDGER).read_text())["legs"][-1]
    assert leg["seconds"]["validation"] >= seen["seconds"], "the validation cut short is validation's time"
    monkeypatch.undo()

    resumed = recipe.train(make_cfg(*LONG_VALIDATION, "resume=last"))
    assert losses(client, resumed["run_id"]) == losses(client, reference["run_id"])
    # The validation cut short is done again first: the val/loss curve is the unbroken run's too.
    assert losses(client, resumed["run_id"], "val/loss") == losses(client, reference["run_id"], "val/loss")
    assert newest_valid(checkpoint_dir).state["monitor"]["owed"] is None


def test_a_sigterm_during_the_last_validation_saves_and_the_resume_finishes_the_run(
    make_cfg, client, checkpoint_dir, tmp_path, monkeypatch, sigterm_in_validation
):
    """The end's validation, cut short, leaves the run stopped (KILLED), not finished without its
    scores: the resume validates, logs and finishes it."""
    reference = recipe.train(make_cfg(*LONG_VALIDATION, f"checkpoint.dir={tmp_path / 'reference'}"))
    seen = sigterm_in_validation(40, batch=1)
    with pytest.raises(SystemExit) as stopped:
        recipe.train(make_cfg(*LONG_VALIDATION))
    assert stopped.value.code == 128 + signal.SIGTERM and seen["tripwire"].after == 0
    run_id = newest_valid(checkpoint_dir).state["tracker"]["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    monkeypatch.undo()

    resumed = recipe.train(make_cfg(*LONG_VALIDATION, "resume=last"))
    assert resumed["val/loss"] == reference["val/loss"] and client.get_run(run_id).info.status == "FINISHED"
    assert losses(client, run_id, "val/loss") == losses(client, reference["run_id"], "val/loss")
