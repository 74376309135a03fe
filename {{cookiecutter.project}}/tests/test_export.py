"""export.py: a checkpoint's model weights as safetensors with a sidecar, loaded back by the plain
PyTorch lines of docs/evaluating-and-exporting.md, from a one-file checkpoint and from shards, never
over another file."""

import json
import os
import pickle
import re
import shutil
import stat

import pytest
import torch
from conftest import BASE, CONFIG_ROOTS, PROJECT, configured, losses, run_cli
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from test_cli import on_a_small_disk, small_disk
from test_distributed import CPU
from test_finetune import whole
from test_sharded import ALONE, Payload, reseal

from {{cookiecutter.package}}.datasets import digits
from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.checkpoint import sharded
from {{cookiecutter.package}}.engine.checkpoint.home import BEST, path_of
from {{cookiecutter.package}}.engine.checkpoint.resume import load
from {{cookiecutter.package}}.engine.errors import RunError
from {{cookiecutter.package}}.engine.exporting import export
from {{cookiecutter.package}}.engine.remembered import CommandLine

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it


def docs_lines(marker: str = "load_file") -> str:
    """The one block of plain PyTorch lines in docs/ that holds `marker`: by default those that load
    an export (docs/evaluating-and-exporting.md, "Exporting")."""
    docs = "\n".join(page.read_text() for page in sorted((PROJECT / "docs").glob("*.md")))
    (block,) = [
        block for block in re.findall(r"^```python\n(.*?)^```", docs, re.DOTALL | re.MULTILINE) if marker in block
    ]
    return block


def val_loss(model: torch.nn.Module, val_fraction: float) -> float:
    """The demo's val/loss (mean cross-entropy over the validation samples), computed by hand by a
    model in eval mode."""
    inputs, targets = digits(val_fraction).val.tensors
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(inputs).float(), targets).item()


@pytest.mark.daily
def test_the_docs_lines_rebuild_the_best_model_which_gives_the_val_loss_logged_at_its_step(
    make_cfg, client, checkpoint_dir, tmp_path, monkeypatch
):
    cfg = make_cfg()
    trained = recipe.train(cfg)
    logged = {step: values[-1] for step, values in losses(client, trained["run_id"], "val/loss").items()}
    best = min(logged, key=logged.get)
    assert (checkpoint_dir / BEST).read_text() == path_of(checkpoint_dir, best).name
    export(make_cfg(), "best", tmp_path / "model.safetensors", "fp32")

    monkeypatch.chdir(tmp_path)
    lines = {}
    exec(docs_lines(), lines)
    assert val_loss(lines["model"], cfg.data.val_fraction) == pytest.approx(logged[best], rel=1e-6)
    described = json.loads((tmp_path / "model.json").read_text())
    assert described["source"]["step"] == best and described["source"]["run_id"] == trained["run_id"]
    assert described["score"] == {"metric": "val/loss", "mode": "min", "value": logged[best]}
    weights, saved = load_file(tmp_path / "model.safetensors"), load(path_of(checkpoint_dir, best)).weights()
    assert weights.keys() == saved.keys() and all(torch.equal(weights[key], saved[key]) for key in saved)


@pytest.mark.parametrize(("dtype", "kind"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_half_dtype_halves_the_file_and_keeps_the_model(make_cfg, tmp_path, dtype, kind):
    recipe.train(make_cfg("mlflow.enabled=false"))
    for each in ("fp32", dtype):
        export(make_cfg(), "last", tmp_path / f"{each}.safetensors", each)
    full, half = load_file(tmp_path / "fp32.safetensors"), load_file(tmp_path / f"{dtype}.safetensors")
    assert {tensor.dtype for tensor in half.values()} == {kind}
    assert (tmp_path / f"{dtype}.safetensors").stat().st_size < 0.6 * (tmp_path / "fp32.safetensors").stat().st_size
    for key, tensor in full.items():
        assert torch.equal(half[key], tensor.to(kind))
    assert json.loads((tmp_path / f"{dtype}.json").read_text())["dtype"] == dtype


@pytest.mark.parametrize(
    ("out", "dtype", "said"),
    [
        ("taken.safetensors", "fp32", r"taken.safetensors is there already; export.py writes over nothing"),
        ("sidecar.safetensors", "fp32", r"sidecar.json is there already; export.py writes over nothing"),
        ("taken.json", "fp32", r"the weights are written in safetensors; name the file <name>.safetensors"),
        ("new.safetensors", "fp64", r"dtype=fp64: export.py writes fp32, bf16, fp16"),
        ("missing/new.safetensors", "fp32", r"no folder .*missing; make it first"),
        ("/proc/new.safetensors", "fp32", r"cannot write /proc/new.safetensors \(.+\); pass out=<a path in a folder"),
    ],
)
def test_a_taken_name_or_an_unknown_dtype_is_one_line_and_nothing_is_written(make_cfg, tmp_path, out, dtype, said):
    recipe.train(make_cfg("mlflow.enabled=false", "trainer.max_steps=10"))
    for taken in ("taken.safetensors", "taken.json", "sidecar.json"):
        (tmp_path / taken).write_text("a file of the user's")
    before = sorted(path.name for path in tmp_path.iterdir())
    with pytest.raises(RunError, match=said):
        export(make_cfg(), "last", tmp_path / out, dtype)
    assert sorted(path.name for path in tmp_path.iterdir()) == before
    assert (tmp_path / "taken.safetensors").read_text() == "a file of the user's"


def test_both_files_get_the_mode_of_any_file_created_there_by_the_umask(make_cfg, tmp_path):
    recipe.train(make_cfg("mlflow.enabled=false", "trainer.max_steps=10"))
    out = tmp_path / "out"
    out.mkdir()
    before = os.umask(0o027)  # not the usual 022: the mode is the umask's, not a fixed 0644
    try:
        export(make_cfg(), "last", out / "model.safetensors", "fp32")
        (out / "any").touch()
    finally:
        os.umask(before)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in out.iterdir()}
    assert modes == {"model.safetensors": 0o640, "model.json": 0o640, "any": 0o640}


def test_a_run_whose_data_folder_moved_exports_with_the_new_place_typed_and_other_data_is_still_refused(tmp_path):
    texts, moved, out = tmp_path / "texts", tmp_path / "moved", tmp_path / "model.safetensors"
    texts.mkdir()
    for label in ("no", "yes"):
        (texts / f"{label}.txt").write_text(f"{label}, said once\n" * 20)
    common = [*(f"{key}={value}" for key, value in BASE.items()), f"checkpoint.dir={tmp_path}/run"]
    common += ["mlflow.enabled=false", f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"]  # never opened
    tiny_gpt = ["model=gpt", "model.width=16", "model.depth=1", "model.heads=2", "data.block_size=16"]

    def typed(*overrides: str) -> tuple:
        """The config `python export.py <overrides>` composes, and what it says was typed."""
        said = (*common, *overrides)
        with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
            return compose("config", overrides=list(said)), CommandLine(said, lambda: defaults, CONFIG_ROOTS)

    with initialize_config_dir(config_dir=str(PROJECT / "configs"), version_base="1.3"):
        defaults = compose("config")
    split = ["data.val_fraction=0.1", "data.batch_size=8"]  # the 40 lines' own, whatever the configs give all data
    recipe.train(typed("data=text_folder", f"data.dir={texts}", *split, *tiny_gpt, "trainer.max_steps=2")[0])
    texts.rename(moved)

    cfg, said = typed(f"+data.dir={moved}", "data.val_fraction=0.5")
    with pytest.raises(RunError) as refused:  # what a location is not: a setting of the data
        export(cfg, "last", out, "fp32", said)
    assert "was trained with data.val_fraction=0.1, and this command asks for data.val_fraction=0.5: " in str(
        refused.value
    )
    cfg, said = typed(f"+data.dir={moved}")
    sidecar = export(cfg, "last", out, "fp32", said)
    assert json.loads(sidecar.read_text())["data"]["labels"] == ["no", "yes"]
    assert set(load_file(out)) == set(load(next((tmp_path / "run").glob("step_*.pt"))).part("model"))


ONTO_A_FULL_THEN_A_READ_ONLY_DISK = """
mount -t tmpfs -o size=1m tmpfs "$DISK"
dd if=/dev/zero of="$DISK/filler" bs=64k 2>/dev/null
"$PYTHON" export.py checkpoint=last out="$DISK/model.safetensors" >/dev/null
echo "exit $?"
rm "$DISK/filler"
mount -o remount,ro "$DISK"
"$PYTHON" export.py checkpoint=last out="$DISK/model.safetensors" >/dev/null
echo "exit $?"
ls -A "$DISK"
"""


@small_disk
def test_an_export_onto_a_full_or_a_read_only_disk_is_one_line_and_leaves_nothing(make_cfg, project, tmp_path):
    """safetensors writes in Rust, and says a failed write in a SafetensorError, not an OSError."""
    home = f"checkpoint.dir={project}/checkpoints/{make_cfg().name}"  # where export.py looks for the configs' run
    recipe.train(make_cfg("mlflow.enabled=false", "trainer.max_steps=10", home))
    disk = tmp_path / "disk"
    result = on_a_small_disk(project, disk, ONTO_A_FULL_THEN_A_READ_ONLY_DISK)
    assert result.stdout.split() == ["exit", "2", "exit", "2"], "nothing left behind, not even a scratch file"
    out = disk / "model.safetensors"
    assert result.stderr.strip().splitlines() == [
        f"error: cannot write {out} (No space left on device); free space there, or pass out=<a path in a folder "
        f"you can write>",
        f"error: cannot write {out} (Read-only file system); pass out=<a path in a folder you can write>",
    ]


def test_shards_export_as_the_whole_model_and_a_crafted_metadata_is_refused(project, tmp_path):
    trained = run_cli(project, *ALONE, "trainer.max_steps=10", "checkpoint.every_n_steps=5")
    assert trained.returncode == 0, trained.stderr
    home = project / "checkpoints" / configured().name
    exported = run_cli(project, *CPU, "checkpoint=last", f"out={tmp_path / 'model.safetensors'}", script="export.py")
    assert exported.returncode == 0, exported.stderr
    weights = load_file(tmp_path / "model.safetensors")
    expected = whole(home / "step_00000010", tmp_path)["model"]
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[key], expected[key]) for key in expected)

    marker = tmp_path / "payload-ran"
    newest = home / "step_00000010"
    (newest / sharded.METADATA).write_bytes(pickle.dumps(Payload(marker)))
    reseal(newest, sharded.METADATA)
    refused = run_cli(
        project, *CPU, f"checkpoint={newest}", f"out={tmp_path / 'crafted.safetensors'}", script="export.py"
    )
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip() == (
        f"error: {newest} was refused: its .metadata asks for pathlib.Path.touch, which is not DCP metadata and "
        f"could run code; load only checkpoints this project wrote"
    )
    assert not marker.exists() and not (tmp_path / "crafted.safetensors").exists()


def test_export_py_with_the_runs_home_gone_writes_from_the_remote_the_model_its_home_gave(project):
    """`checkpoint=best` on a machine without the run's home: the best (an early checkpoint, not the
    newest) fetched from checkpoint.remote, exported as the intact home exported it."""
    home, remote = project / "checkpoints" / configured().name, f"checkpoint.remote={project / 'mounted'}"
    settings = ["trainer.max_steps=30", "trainer.val_every_n_steps=10", "checkpoint.every_n_steps=10"]
    trained = run_cli(project, *CPU, *settings, "optimized_mode=max", "checkpoint.keep_last=1", remote)
    assert trained.returncode == 0, trained.stderr
    assert (home / BEST).read_text() != path_of(home, 30).name, "val/loss falls: its highest is at an early save"
    exported = {}
    for where in ("home", "remote"):
        if where == "remote":
            shutil.rmtree(home)
        done = run_cli(project, *CPU, "checkpoint=best", f"out={where}.safetensors", remote, script="export.py")
        assert done.returncode == 0, done.stderr
        exported[where] = load_file(project / f"{where}.safetensors"), (project / f"{where}.json").read_text()
    (here, described), (there, fetched) = exported["home"], exported["remote"]
    assert here.keys() == there.keys() and all(torch.equal(here[key], there[key]) for key in here)
    assert fetched == described
