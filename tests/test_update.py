"""A project remembers its template (`.cruft.json`): cruft finds it up to date after a bake, and
`cruft update` brings the template's later commits into it, the user's own code kept."""

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

Bake = Callable[..., Path]

TEMPLATE = Path(__file__).resolve().parents[1]
PACKAGE = "my_trainer"
# A bake's command as a person types it in the folder that holds the template, and the template
# its `.cruft.json` should name: what cruft clones, a local folder by its absolute path.
GH = "https://github.com/org/continuum.git"
MAKERS = {
    "cookiecutter-path": (
        ["cookiecutter", "--no-input", "--config-file", "{config}", "continuum"],
        "{template}",
    ),
    "cookiecutter-git-url": (
        ["cookiecutter", "--no-input", "--config-file", "{config}", "git+file://{template}"],
        "file://{template}",
    ),
    "cookiecutter-gh": (
        ["cookiecutter", "--no-input", "--config-file", "{config}", "gh:org/continuum"],
        GH,
    ),
    "cruft-create": (["cruft", "create", "-y", "continuum"], "{template}"),
}
# The update test's files: the recipe, and the examples' modules the user adds to.
RECIPE = Path("src", PACKAGE, "engine", "train.py")
MODELS = Path("src", PACKAGE, "models.py")
DATASETS = Path("src", PACKAGE, "datasets.py")
OWN_FILES = {
    Path("configs", "model", "linear.yaml"): f"_target_: {PACKAGE}.models.Linear\n",
    Path("configs", "data", "shifted_digits.yaml"): (
        f"_target_: {PACKAGE}.datasets.shifted_digits\n"
        "val_fraction: 0.2\nshift: 0.5\nbatch_size: 64\nnum_workers: 0\n"
    ),
    Path("configs", "experiment", "mine.yaml"): (
        "# @package _global_\n"
        "defaults:\n  - override /model: linear\n  - override /data: shifted_digits\n\n"
        "name: mine\n\n"
        f"hydra:\n  callbacks:\n    note:\n      _target_: {PACKAGE}.my_callbacks.Note\n"
    ),
    Path("src", PACKAGE, "my_callbacks.py"): (
        '"""Leaves a note when a run ends."""\n\n'
        "from pathlib import Path\n\n"
        "from hydra.experimental.callback import Callback\n\n\n"
        "class Note(Callback):\n"
        "    def on_job_end(self, config, job_return, **kwargs):\n"
        '        Path("note.txt").write_text(job_return.status.name)\n'
    ),
}
OWN_MODEL = '''

class Linear(nn.Module):
    """One linear layer over the flattened sample."""

    def __init__(self, input_shape: list[int], num_classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, inputs):
        return self.head(inputs.flatten(1))
'''
OWN_DATA = '''

def shifted_digits(val_fraction: float, shift: float, test_fraction: float = 0.0) -> Data:
    """The digits with every training pixel raised by `shift`."""
    data = digits(val_fraction, test_fraction)
    images, targets = data.train.tensors
    return Data(TensorDataset(images + shift, targets), data.val, data.test, **data.facts)
'''


def git(folder: Path, *arguments: str) -> str:
    return subprocess.run(
        ["git", "-C", str(folder), *arguments], capture_output=True, text=True, check=True
    ).stdout.rstrip("\n")  # the leading space of `status --porcelain` kept


def typed(command: list[str], folder: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run the venv's cookiecutter or cruft in `folder` as a shell does, PWD saying where."""
    executable = Path(sys.executable).with_name(command[0])
    result = subprocess.run(
        [str(executable), *command[1:]],
        cwd=folder,
        env={**os.environ, "PWD": str(folder)},
        capture_output=True,
        text=True,
        check=False,
    )
    if check and result.returncode != 0:
        pytest.fail(
            f"`{' '.join(command)}` exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def commit_all(folder: Path, message: str) -> str:
    git(folder, "add", "-A")
    git(folder, "commit", "-q", "-m", message)
    return git(folder, "rev-parse", "HEAD")


@pytest.fixture
def template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This checkout's template as it stands, uncommitted edits included, committed alone in a
    repository of its own (`continuum`), under a git that takes GH for that repository: cruft and
    cookiecutter clone `gh:org/continuum` without a network."""
    copy = tmp_path / "continuum"
    copy.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*_cache")
    for part in ("cookiecutter.json", "hooks", "{{cookiecutter.project}}"):
        source = TEMPLATE / part
        if source.is_dir():
            shutil.copytree(source, copy / part, ignore=ignore)
        else:
            shutil.copy(source, copy / part)
    config = tmp_path / "gitconfig"
    config.write_text(
        "[user]\n\tname = Test\n\temail = test@example.com\n"
        f'[url "file://{copy}"]\n\tinsteadOf = {GH}\n',
        encoding="utf-8",
    )
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    git(copy, "init", "-q")
    commit_all(copy, "The template")
    return copy


@pytest.mark.parametrize(("command", "recorded"), MAKERS.values(), ids=MAKERS)
def test_a_bake_records_the_template_and_its_commit_which_cruft_checks(
    template: Path, command: list[str], recorded: str
) -> None:
    folder = template.parent
    config = folder / "cookiecutter.yaml"  # clones and replays go here, not to the home directory
    config.write_text(
        yaml.safe_dump(
            {"cookiecutters_dir": str(folder / "clones"), "replay_dir": str(folder / "replay")}
        ),
        encoding="utf-8",
    )
    typed([part.format(config=config, template=template) for part in command], folder)
    project = folder / "my-trainer"
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    expected = recorded.format(template=template)
    assert (state["template"], state["commit"]) == (expected, git(template, "rev-parse", "HEAD"))
    answers = state["context"]["cookiecutter"]
    assert (answers["project"], answers["package"], answers["_template"]) == (
        "my-trainer",
        PACKAGE,
        expected,
    )
    assert "up to date" in typed(["cruft", "check"], project).stdout
    (template / "{{cookiecutter.project}}" / "NEWS.md").write_text(
        "A later commit.\n", encoding="utf-8"
    )
    commit_all(template, "A later commit")
    checked = typed(["cruft", "check"], project, check=False)
    assert checked.returncode == 1 and "out of date" in checked.stdout


def test_a_template_inside_another_repository_bakes_with_a_null_commit(
    bake: Bake, template: Path, tmp_path: Path
) -> None:
    """The other repository's commit is not the template's."""
    shutil.rmtree(template / ".git")
    git(tmp_path, "init", "-q")
    commit_all(tmp_path, "A repository that holds the template")
    project = bake(tmp_path / "out", template=template)
    assert json.loads((project / ".cruft.json").read_text(encoding="utf-8"))["commit"] is None


@pytest.mark.slow
def test_cruft_update_brings_the_templates_change_and_keeps_the_users_own_code(
    bake: Bake, template: Path
) -> None:
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    # The user's own model, data, experiment and callback: new files, and classes added to the
    # examples' modules.
    for path, text in OWN_FILES.items():
        (project / path).write_text(text, encoding="utf-8")
    for path, added in ((MODELS, OWN_MODEL), (DATASETS, OWN_DATA)):
        with (project / path).open("a", encoding="utf-8") as file:
            file.write(added)
    own = {path: (project / path).read_text(encoding="utf-8") for path in [*OWN_FILES, DATASETS]}
    commit_all(project, "My model, data, experiment and callback")

    # The template's next commit: a line at the end of the recipe (a file the user left alone) and
    # one at the top of models.py (far from the user's class).
    package = template / "{{cookiecutter.project}}" / "src" / "{{cookiecutter.package}}"
    with (package / "engine" / "train.py").open("a", encoding="utf-8") as file:
        file.write("\n# {{ cookiecutter.package }}: this line came with cruft update.\n")
    models = package / "models.py"
    models.write_text(
        "# The template's own line.\n" + models.read_text(encoding="utf-8"), encoding="utf-8"
    )
    new = commit_all(template, "The engine changes")

    typed(["cruft", "update", "-y"], project)

    changed = {line[3:] for line in git(project, "status", "--porcelain").splitlines()}
    assert changed == {".cruft.json", str(RECIPE), str(MODELS)}
    assert git(project, "diff", "--name-only", "--diff-filter=U") == ""  # no file left unmerged
    assert not list(project.rglob("*.rej"))
    recipe = (project / RECIPE).read_text(encoding="utf-8")
    assert recipe.endswith(f"\n# {PACKAGE}: this line came with cruft update.\n")
    assert "<<<<<<<" not in recipe
    assert (project / MODELS).read_text(encoding="utf-8").startswith("# The template's own line.\n")
    assert (project / MODELS).read_text(encoding="utf-8").endswith(OWN_MODEL)
    assert {path: (project / path).read_text(encoding="utf-8") for path in own} == own
    assert json.loads((project / ".cruft.json").read_text(encoding="utf-8"))["commit"] == new

    # The updated project runs the user's experiment, and its own import check passes.
    environment = {**os.environ, "PYTHONPATH": str(project / "src")}
    for command in (
        ["run.py", "experiment=mine", "trainer.max_steps=5", "mlflow.enabled=false"],
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_imports.py"],
    ):
        result = subprocess.run(
            [sys.executable, *command], cwd=project, env=environment, capture_output=True, text=True
        )
        assert result.returncode == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    assert (project / "note.txt").read_text(encoding="utf-8") == "COMPLETED"
