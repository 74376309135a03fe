"""experiment=classify_text: a char_lm run's GPT fine-tuned into a classifier of lines of text (the
same body, its features pooled, a new head), stopped and resumed, exported, and classifying a
string through the lines of docs/fine-tuning.md; the text_folder data's refusals."""

import logging
import os
import re
import signal

import pytest
import torch
from conftest import losses, run_cli
from test_distributed import CPU
from test_export import docs_lines

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.data.contract import build_data
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.exporting import export, plain
from {{cookiecutter.package}}.engine.ready.datasets import PAD
from {{cookiecutter.package}}.models import GPT

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

LABELS = ["code", "comment", "definition", "import"]


def test_a_char_lm_run_fine_tunes_into_a_classifier_that_resumes_exports_and_names_a_label(
    make_cfg, client, tmp_path, monkeypatch, sigterm_at, capsys
):
    def cfg(*overrides: str):
        return make_cfg(f"checkpoint.dir={tmp_path}/checkpoints/" + "${name}", *overrides)

    recipe.train(cfg("experiment=char_lm", "trainer.max_steps=2", "data.max_chars=20000"))
    # The experiment's own settings but how long it trains, on 100 lines a label.
    common = ["experiment=classify_text", "trainer.max_steps=8", "trainer.val_every_n_steps=4", "data.max_lines=100"]
    sigterm_at(5)
    with pytest.raises(SystemExit) as stopped:
        recipe.train(cfg(*common))
    assert stopped.value.code == 128 + signal.SIGTERM
    monkeypatch.undo()
    resumed = recipe.train(cfg(*common, "resume=last"))
    assert resumed["continuity"] == "ok"
    assert sorted(losses(client, resumed["run_id"])) == list(range(1, 9))
    tags = client.get_run(resumed["run_id"]).data.tags
    assert (tags["init.source_run_name"], tags["init.ignored"]) == ("char-lm", "2")  # head.weight, head.bias

    export(cfg(*common), "last", tmp_path / "model.safetensors", "fp32")
    monkeypatch.chdir(tmp_path)
    lines = {}
    exec(docs_lines(), lines)
    exec(docs_lines('described["data"]'), lines)  # the lines of docs/fine-tuning.md that classify a string
    assert lines["label"] in LABELS
    assert capsys.readouterr().out.splitlines()[-1] == lines["label"]
    assert lines["data"]["labels"] == LABELS

    # The exported model, on the padded validation texts, scores what the run logged at its end.
    inputs, targets = build_data(cfg(*common).data).val.tensors
    with torch.no_grad():
        right = (lines["model"](inputs).argmax(1) == targets).float().mean().item()
    assert right == pytest.approx(resumed["val/accuracy"], abs=1e-6)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_padding_changes_no_class_score(pooling):
    torch.manual_seed(0)
    model = GPT(vocab_size=98, block_size=16, num_classes=3, pooling=pooling, pad=PAD).eval()
    text = torch.randint(2, 98, (1, 9))
    padded = torch.cat([text, torch.full((1, 7), PAD)], dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(padded), model(text))
        assert model(text).shape == (1, 3)


@pytest.mark.parametrize(
    ("files", "said"),
    [
        (None, "is no folder"),
        ({}, "holds no <label>.txt file, and a classifier needs two labels"),
        ({"notes.csv": "a\n"}, "holds no <label>.txt file, and a classifier needs two labels"),
        ({"good.txt": "fine\n"}, "holds only good.txt, and a classifier needs two labels"),
        ({"good.txt": "fine\n", "bad.txt": "\n  \n"}, "bad.txt holds no example (one a line)"),
        (
            {"good.txt": "fine\n", "x.txt": None},  # None: a folder of that name
            "cannot read {folder}/x.txt (it is a folder, not a file); put a readable file there, or move it out of "
            "the data's folder",
        ),
    ],
    ids=["missing", "empty", "no-txt", "one-label", "blank-label", "folder-label"],
)
def test_a_folder_without_two_labelled_files_is_one_line_naming_it_and_the_fix(make_cfg, tmp_path, files, said):
    folder = tmp_path / "texts"
    if files is not None:
        folder.mkdir()
        for name, text in files.items():
            if text is None:
                (folder / name).mkdir()
            else:
                (folder / name).write_text(text)
    with pytest.raises(RunError, match=re.escape(said.format(folder=folder))) as refused:
        build_data(make_cfg("data=text_folder", f"data.dir={folder}").data)
    assert str(folder) in str(refused.value) and "\n" not in str(refused.value)


def test_a_label_file_that_is_a_fifo_is_refused_in_one_line_at_once_and_the_home_is_let_go(project, tmp_path):
    """Read as a file, a FIFO waits for a writer that may never come, the run's home locked meanwhile
    (run_cli's time-out ends a wait: the test fails instead of hanging)."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "good.txt").write_text("fine\n" * 10)
    os.mkfifo(texts / "bad.txt")
    result = run_cli(project, *CPU, "data=text_folder", f"data.dir={texts}", "model=gpt", "mlflow.enabled=false")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"error: data ({{cookiecutter.package}}.datasets.text_folder): cannot read {texts / 'bad.txt'} (it is a FIFO, "
        f"not a file); put a readable file there, or move it out of the data's folder"
    )
    assert not (project / "checkpoints").exists(), "the home it claimed and locked is let go"


def test_a_folder_of_labelled_lines_gives_classes_by_label_name_and_the_facts_export_writes(make_cfg, tmp_path):
    (tmp_path / "yes.txt").write_text("ok\nsure thing\n\n" * 5)
    (tmp_path / "no.txt").write_text("nope\u00e9\n" * 10)
    data = build_data(make_cfg("data=text_folder", f"data.dir={tmp_path}", "data.block_size=8").data)
    assert (len(data.train), len(data.val)) == (18, 2)
    assert {key: data.facts[key] for key in ("labels", "num_classes", "block_size", "pad")} == {
        "labels": ["no", "yes"],
        "num_classes": 2,
        "block_size": 8,
        "pad": PAD,
    }
    inputs, targets = data.train.tensors
    nope = inputs[targets == 0][0].tolist()
    characters = data.facts["characters"]
    assert nope == [characters.index(c) for c in "nope"] + [len(characters)] + [PAD] * 3  # é: unknown


def test_a_fact_json_cannot_hold_is_left_out_of_the_sidecar_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        kept = plain({"labels": ["a", "b"], "input_shape": (1, 8, 8), "weights": torch.ones(2)})
    assert kept == {"labels": ["a", "b"], "input_shape": (1, 8, 8)}
    assert "the data's fact weights (a Tensor) is not plain data: left out of the sidecar" in caplog.text
