"""Callbacks by config (hooks.py): what they log reaches the MLflow run, their state resumes with
the run, under ddp they log once, and one that raises or lacks its library stops the run in one line."""

import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROJECT, runs_named
from omegaconf import open_dict
from PIL import Image
from test_distributed import finished, only_run, store, torchrun
from test_tasks import LM, PADDED

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint.home import path_of, steps
from {{cookiecutter.package}}.engine.checkpoint.manager import Checkpointer
from {{cookiecutter.package}}.engine.errors import RunError

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

QUIET = ["trainer.log_every_n_steps=10", "trainer.val_every_n_steps=10", "checkpoint.every_n_steps=10"]


class Counting:
    """Counts the validations it sees, and logs a figure, a text and its count at each."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.count, self.fail_at = 0, fail_at

    def on_validation_end(self, run, metrics):
        if run.step == self.fail_at:
            raise ValueError(f"no figure at step {run.step}")
        self.count += 1
        from matplotlib.figure import Figure

        figure = Figure()
        figure.add_subplot().plot([0, 1], [metrics["val/loss"]] * 2)
        run.log_figure(figure, f"curves/step_{run.step}.png")
        run.log_text(f"{self.count} at {run.step}", f"texts/step_{run.step}.txt")
        run.log_metrics({"callback/count": self.count})

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


COUNTING = "+callbacks.counting._target_=test_hooks.Counting"


def files(client, run_id: str, folder: str) -> list[str]:
    return sorted(item.path for item in client.list_artifacts(run_id, folder))


def text_of(client, run_id: str, path: str) -> str:
    return Path(client.download_artifacts(run_id, path)).read_text()


def test_a_callback_logs_at_each_validation_and_its_state_resumes_after_sigterm(
    make_cfg, client, sigterm_at, monkeypatch
):
    sigterm_at(15)
    with pytest.raises(SystemExit) as stopped:
        recipe.train(make_cfg(*QUIET, COUNTING))
    assert stopped.value.code == 128 + signal.SIGTERM
    monkeypatch.undo()
    result = recipe.train(make_cfg(*QUIET, COUNTING, "resume=last"))

    validated = sorted(metric.step for metric in client.get_metric_history(result["run_id"], "val/loss"))
    assert validated == [10, 20, 30, 40]  # the unbroken run's: the save at the signal waits for no validation
    counts = {metric.step: metric.value for metric in client.get_metric_history(result["run_id"], "callback/count")}
    assert counts == {step: float(number) for number, step in enumerate(validated, start=1)}
    assert files(client, result["run_id"], "texts") == [f"texts/step_{step}.txt" for step in validated]
    assert files(client, result["run_id"], "curves") == [f"curves/step_{step}.png" for step in validated]
    assert text_of(client, result["run_id"], "texts/step_40.txt") == "4 at 40"


def test_a_callback_that_raises_stops_the_run_in_one_line_after_the_last_good_checkpoint(make_cfg, checkpoint_dir):
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg(*QUIET, COUNTING, "+callbacks.counting.fail_at=30"))
    assert str(raised.value) == (
        "callbacks.counting (test_hooks.Counting) raised in on_validation_end: ValueError: no figure at step 30; "
        f"the newest checkpoint on disk is {path_of(checkpoint_dir, 20)}; fix it, then continue from it with "
        f"name={make_cfg().name} resume=last"
    )
    assert [step for step, _ in steps(checkpoint_dir)] == [10, 20]  # nothing of step 30
    result = recipe.train(make_cfg(*QUIET, COUNTING, "+callbacks.counting.fail_at=null", "resume=last"))
    assert result["step"] == 40 and result["continuity"] == "ok"


def test_a_callback_whose_library_is_missing_stops_the_run_before_step_1(make_cfg, checkpoint_dir, client, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    with pytest.raises(RunError) as raised:
        recipe.train(make_cfg("name=no-matplotlib", "callbacks=[confusion_matrix]"))
    assert str(raised.value) == "callbacks.confusion_matrix needs matplotlib: pip install matplotlib"
    assert not checkpoint_dir.exists() or not steps(checkpoint_dir)
    assert runs_named(client, "no-matplotlib") == []


def test_a_checkpoint_from_before_callbacks_resumes_with_a_stateful_callback_fresh(make_cfg, client, monkeypatch):
    real_init = Checkpointer.__init__

    def without_callbacks(self, cfg, world, strategy, parts, **hooks) -> None:
        real_init(self, cfg, world, strategy, {key: part for key, part in parts.items() if key != "callbacks"}, **hooks)

    monkeypatch.setattr(Checkpointer, "__init__", without_callbacks)
    recipe.train(make_cfg(*QUIET, "trainer.max_steps=20"))
    monkeypatch.undo()
    result = recipe.train(make_cfg(*QUIET, COUNTING, "trainer.max_steps=30", "resume=last"))
    counts = client.get_metric_history(result["run_id"], "callback/count")
    assert [(metric.step, metric.value) for metric in counts] == [(30, 1.0)]


def test_text_sample_writes_what_the_char_lm_generates_at_each_validation(make_cfg, client):
    result = recipe.train(
        make_cfg(
            "experiment=char_lm", "trainer.max_steps=4", "trainer.val_every_n_steps=2", "checkpoint.every_n_steps=4",
            "data.max_chars=20000", "callbacks=[text_sample]", "callbacks.text_sample.length=30",
        )
    )  # fmt: skip
    assert files(client, result["run_id"], "text_sample") == [
        "text_sample/step_000002.txt",
        "text_sample/step_000004.txt",
    ]
    text = text_of(client, result["run_id"], "text_sample/step_000004.txt")
    assert text.startswith("def ") and len(text) == 4 + 30


CALLBACKS = """
import torch.distributed as dist


class Ranked:
    def on_validation_end(self, run, metrics):
        run.log_text(f"rank {dist.get_rank()}", f"ranked/step_{run.step}.txt")
"""


def test_under_ddp_every_process_calls_the_hooks_and_rank_0_alone_logs(project):
    (project / "ddp_callbacks.py").write_text(CALLBACKS)
    extra = ["callbacks=[confusion_matrix]", "+callbacks.ranked._target_=ddp_callbacks.Ranked"]
    finished(torchrun(project, "name=hooked", "trainer.max_steps=20", "trainer.val_every_n_steps=10", *extra))
    client = store(project)
    run_id = only_run(client, "hooked").info.run_id
    assert files(client, run_id, "confusion_matrix") == [
        "confusion_matrix/step_000010.png",
        "confusion_matrix/step_000020.png",
    ]
    assert files(client, run_id, "ranked") == ["ranked/step_10.txt", "ranked/step_20.txt"]
    assert text_of(client, run_id, "ranked/step_20.txt") == "rank 0"


class Imaging:
    def on_fit_end(self, run, metrics):
        run.log_image(torch.zeros(3, 8, 5), "blank")  # CHW, as torch holds images


def test_log_image_logs_a_chw_tensor_in_the_image_slider_at_the_step(make_cfg, client):
    result = recipe.train(make_cfg(*QUIET, "trainer.max_steps=10", "+callbacks.image._target_=test_hooks.Imaging"))
    (png,) = [path for path in files(client, result["run_id"], "images") if path.endswith(".png")]
    assert png.startswith("images/blank+step+10+")
    with Image.open(client.download_artifacts(result["run_id"], png)) as image:
        assert image.size == (5, 8)  # width, height


def test_text_sample_refuses_a_vocabulary_it_cannot_write_before_step_1(make_cfg, tmp_path, monkeypatch):
    """A char_lm adapted to other data (test_tasks' sequences of 11 tokens) with the ready text sample."""
    (tmp_path / "sequences.py").write_text(PADDED)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = make_cfg(*LM, "callbacks=[text_sample]", f"checkpoint.dir={tmp_path / 'checkpoints'}")
    with open_dict(cfg):
        cfg.data = {"_target_": "sequences.padded", "batch_size": 4}
    with pytest.raises(
        RunError, match=r"on_fit_start: ValueError: text_sample writes .* vocab_size is 11; leave it out"
    ):
        recipe.train(cfg)
    assert steps(tmp_path / "checkpoints") == []


def test_the_docs_callback_logs_its_curve_at_each_validation(make_cfg, client, tmp_path, monkeypatch):
    """The LossCurve of docs/callbacks.md, as a user's package names it on the command line."""
    page = (PROJECT / "docs" / "callbacks.md").read_text()
    (block,) = [
        block for block in re.findall(r"^```python\n(.*?)^```", page, re.DOTALL | re.MULTILINE) if "LossCurve" in block
    ]
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").touch()
    (tmp_path / "mypkg" / "callbacks.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = recipe.train(
        make_cfg(*QUIET, "trainer.max_steps=20", "+callbacks.curve._target_=mypkg.callbacks.LossCurve")
    )
    assert files(client, result["run_id"], "curves") == ["curves/step_10.png", "curves/step_20.png"]
