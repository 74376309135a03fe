"""A project remembers its template (`.cruft.json`): cruft finds it up to date after a bake, and
`cruft update` brings the template's later commits into it and never writes the user's files (the
record's skip list): the one line docs/updating.md gives updates, lints and tests a project. The
engine's configs are the template's and arrive with it, the user's configs/ stays the user's; a
project of one config root moves to the two; and the line stops, before cruft writes anything, a
project whose files cruft would merge into or whose engine it would miss."""

import json
import os
import re
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
# The post-bake message's first line, and its line for `cruft create`, which keeps no skip list.
NEXT_STEPS = "Created my-trainer. Next, as its README says:"
SKIP_HINT = "Before a first cruft update, add your files to .cruft.json as docs/updating.md shows:"
# The files the README calls yours, which `.cruft.json`'s skip list keeps out of every update.
KINDS = ("models", "datasets", "tasks", "metrics", "callbacks", "schedulers")
YOURS = [*(f"src/{PACKAGE}/{kind}.py" for kind in KINDS), "configs"]
# What a user adds to each of them, before the ready components moved into the engine: code
# appended to the module that then held the ready ones, using what that module imports (the
# update must leave it as it is), and configs that name it.
OWN_CODE = {
    "models": '''

class WideMLP(MLP):
    """The MLP with one wide hidden layer."""

    def __init__(self, input_shape: list[int], num_classes: int, width: int = 96) -> None:
        super().__init__(input_shape, num_classes, [width])
''',
    "datasets": '''

def shifted_digits(val_fraction: float, shift: float) -> Data:
    """The digits with every training pixel raised by `shift`."""
    data = digits(val_fraction)
    images, targets = data.train.tensors
    return Data(TensorDataset(images + shift, targets), data.val, **data.facts)
''',
    "tasks": '''

class Halved(Supervised):
    """The supervised loss, halved."""

    def loss(self, criterion: nn.Module, outputs: Any, targets: Any) -> tuple[torch.Tensor, Any]:
        loss, count = super().loss(criterion, outputs, targets)
        return loss / 2, count
''',
    "callbacks": '''

class Note:
    """Notes each validation's step and how many samples the model's predictions covered."""

    def on_validation_end(self, run: Any, metrics: dict[str, float]) -> None:
        seen = sum(len(targets) for _, targets in run.predictions())
        with open("note.txt", "a") as note:
            note.write(f"{run.step} {seen}\\n")
''',
    "schedulers": '''

def linear(optimizer: torch.optim.Optimizer, total_steps: int) -> LambdaLR:
    """A linear decay from `optimizer.lr` to 0 at `total_steps`."""
    return _schedule(optimizer, 0, lambda after: max(0.0, 1 - after / total_steps))
''',
}
OWN_CONFIGS = {
    Path("configs", "model", "wide.yaml"): f"_target_: {PACKAGE}.models.WideMLP\nwidth: 48\n",
    Path("configs", "data", "shifted.yaml"): (
        f"_target_: {PACKAGE}.datasets.shifted_digits\n"
        "val_fraction: 0.2\nshift: 0.5\nbatch_size: 64\nnum_workers: 0\n"
    ),
    Path("configs", "task", "halved.yaml"): f"_target_: {PACKAGE}.tasks.Halved\n",
    Path("configs", "scheduler", "linear.yaml"): (
        f"_target_: {PACKAGE}.schedulers.linear\ntotal_steps: ${{trainer.max_steps}}\n"
    ),
    Path("configs", "callbacks", "note.yaml"): f"note:\n  _target_: {PACKAGE}.callbacks.Note\n",
    Path("configs", "experiment", "mine.yaml"): (
        "# @package _global_\n"
        "defaults:\n"
        "  - override /model: wide\n  - override /data: shifted\n  - override /task: halved\n"
        "  - override /scheduler: linear\n  - override /callbacks: [note]\n\n"
        "name: mine\n"
    ),
}
# The documented update's fast tests, cut to the file that holds your files and the engine to
# their rules: the template's end-to-end test runs the generated suite whole, and this test runs
# the user's own components.
FAST_TESTS = "python -m pytest -x -q"
SOME_FAST_TESTS = f"{FAST_TESTS} -p no:cacheprovider tests/test_imports.py"
# The update line of docs/updating.md, and that of a project baked before the two config roots.
UPDATE = f"python -m {PACKAGE}.engine.update before && cruft update -y && "
FIRST_UPDATE = f"cruft update -y && python -m {PACKAGE}.engine.update after && "
# The template's last commit with one config root: every group, option and setting in configs/.
ONE_ROOT = "49da35de3da563979c82cccebb5549337815d8cf"
# The template's last commit whose engine was flat: its modules side by side, before its folders
# (checkpoint/remote/, data/, tracking/, callbacks/, lifecycle/) and the names they brought.
FLAT = "659048fb558be5e8deecb9bfffc7c74a84ced4b4"
# What a user chose, in a project of either layout: a group's option and a setting in config.yaml,
# an option of the user's own, and (with the two roots) a file replacing the engine's.
SMALL_CNN = f"_target_: {PACKAGE}.models.CNN\nchannels: [8, 16]\ndropout: 0.0\n"
MY_ADAMW = "_target_: torch.optim.AdamW\nlr: 0.125\n"


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
    baked = typed([part.format(config=config, template=template) for part in command], folder)
    project = folder / "my-trainer"
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    expected = recorded.format(template=template)
    assert (state["template"], state["commit"]) == (expected, git(template, "rev-parse", "HEAD"))
    # What to type next, once; `cruft create` writes .cruft.json itself, without the skip list.
    assert baked.stdout.count(NEXT_STEPS) == 1
    if command[0] == "cruft":
        assert "skip" not in state and baked.stdout.count(SKIP_HINT) == 1
    else:
        assert state["skip"] == YOURS and SKIP_HINT not in baked.stdout
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


def before_the_move(template: Path) -> str:
    """Commits the template as it was before the engine held the ready components: their code in
    the user's files (its imports of the engine spelled from there), no engine/ready/, and no
    module at the old path of the engine's data; returns the commit."""
    package = template / "{{cookiecutter.project}}" / "src" / "{{cookiecutter.package}}"
    ready = package / "engine" / "ready"
    for kind in KINDS:
        code = (
            (ready / f"{kind}.py").read_text(encoding="utf-8").replace("from ..", "from .engine.")
        )
        (package / f"{kind}.py").write_text(code, encoding="utf-8")
    shutil.rmtree(ready)
    (package / "data.py").unlink()
    return commit_all(template, "The ready components in the user's files")


def after_the_move(template: Path, layout: str) -> str:
    """Commits the template of `layout` (a commit) again, with a change of its own to a config
    file: what `cruft update` would write if configs/ were not the user's; returns the commit."""
    git(template, "checkout", layout, "--", ".")
    config = template / "{{cookiecutter.project}}" / "configs" / "config.yaml"
    with config.open("a", encoding="utf-8") as file:
        file.write("# The template's later line.\n")
    return commit_all(template, "The ready components in the engine")


def yours(project: Path) -> dict[str, bytes]:
    """The bytes of every file of the user's: the six modules and all of configs/."""
    files = [project / "src" / PACKAGE / f"{kind}.py" for kind in KINDS]
    files += sorted(path for path in (project / "configs").rglob("*") if path.is_file())
    return {str(path.relative_to(project)): path.read_bytes() for path in files}


def add_own_code(project: Path) -> None:
    """The user's model, data, task, callback, schedule, and configs that name them."""
    for kind, code in OWN_CODE.items():
        with (project / "src" / PACKAGE / f"{kind}.py").open("a", encoding="utf-8") as file:
            file.write(code)
    for path, text in OWN_CONFIGS.items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(text, encoding="utf-8")


def update_line(project: Path, start: str = UPDATE) -> str:
    """docs/updating.md's line that updates the project, lints it and runs its fast tests, here
    with fewer of them: the line of every update, or its line that starts with `start`."""
    page = (project / "docs" / "updating.md").read_text(encoding="utf-8")
    line = next(line for line in page.splitlines() if line.startswith(start))
    line = line.partition("  #")[0].strip()
    assert line.endswith(FAST_TESTS), line
    return line.removesuffix(FAST_TESTS) + SOME_FAST_TESTS


def updating(project: Path, line: str) -> subprocess.CompletedProcess:
    """`line` typed in the project, with this venv's cruft, ruff and Python."""
    return subprocess.run(
        ["bash", "-c", line],
        cwd=project,
        env={
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(project / "src"),
            "PWD": str(project),
        },
        capture_output=True,
        text=True,
    )


def composed(project: Path, *overrides: str, package: str = PACKAGE) -> dict:
    """The config `python run.py <overrides>` runs with in `project`, as its own engine composes
    it, unresolved: ${project_root:} stays as written."""
    code = (
        f"import json, sys; from {package}.engine.config import Config\n"
        "from hydra import compose, initialize_config_dir; from omegaconf import OmegaConf\n"
        "with initialize_config_dir(config_dir=sys.argv[1], version_base='1.3'):\n"
        "    print(json.dumps(OmegaConf.to_container(compose('config', sys.argv[2:]))))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, str(project / "configs"), *overrides],
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr
    return json.loads(found.stdout)


def merged_cleanly(project: Path) -> bool:
    """Whether the update left no file unmerged and no `.rej`."""
    unmerged = git(project, "diff", "--name-only", "--diff-filter=U")
    return unmerged == "" and not list(project.rglob("*.rej"))


def release(template: Path) -> str:
    """Commits a release of the template: a default of the engine's configs changed, a setting the
    engine now requires (in its schema and its engine.yaml), and a change of its own to the user's
    config.yaml, which the update must not write; returns the commit."""
    package = template / "{{cookiecutter.project}}" / "src" / "{{cookiecutter.package}}"
    edit(
        package / "engine" / "configs" / "checkpoint" / "default.yaml",
        "keep_last: 3\n",
        "keep_last: 5\n",
    )
    edit(
        package / "engine" / "config.py",
        "class TrainerConfig:\n",
        "class TrainerConfig:\n    sanity_steps: int = MISSING  # required from this release\n",
    )
    edit(
        package / "engine" / "configs" / "engine.yaml",
        "\ntrainer:\n",
        "\ntrainer:\n  sanity_steps: 7\n",
    )
    with (template / "{{cookiecutter.project}}" / "configs" / "config.yaml").open("a") as file:
        file.write("# The template's later line.\n")
    return commit_all(template, "keep_last 5, and trainer.sanity_steps")


def edit(file: Path, old: str, new: str) -> None:
    text = file.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{file}: {old!r}"
    file.write_text(text.replace(old, new), encoding="utf-8")


def choose(project: Path) -> None:
    """The user's choices in a project of two config roots: the CNN and 50 steps for every run in
    config.yaml, an option of their own, and their AdamW in place of the engine's."""
    edit(project / "configs" / "config.yaml", "  - model: mlp\n", "  - model: cnn\n")
    with (project / "configs" / "config.yaml").open("a") as file:
        file.write("\ntrainer:\n  max_steps: 50\n")
    for group, name, text in (("model", "small_cnn", SMALL_CNN), ("optimizer", "adamw", MY_ADAMW)):
        (project / "configs" / group).mkdir()
        (project / "configs" / group / f"{name}.yaml").write_text(text, encoding="utf-8")


@pytest.mark.slow
def test_the_documented_update_leaves_the_users_files_byte_for_byte_and_the_project_passes(
    bake: Bake, template: Path
) -> None:
    """Baked while the ready components were in the user's files, the user's own code added to
    each, then updated to the template that moved them into the engine: the update writes none of
    the user's files (`.cruft.json`'s skip list), so the code that leans on what those files held
    and imported runs as before; the engine's change arrives, and the lint and tests pass."""
    layout = git(template, "rev-parse", "HEAD")
    before_the_move(template)
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    add_own_code(project)
    commit_all(project, "My model, data, task, callback, schedule and configs")
    own = yours(project)
    new = after_the_move(template, layout)

    updated = updating(project, update_line(project))
    assert updated.returncode == 0, f"{updated.stdout}\n{updated.stderr}"
    assert NEXT_STEPS not in updated.stdout  # the two renders cruft compares are no one's bakes

    assert yours(project) == own
    assert merged_cleanly(project)
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    assert (state["commit"], state["skip"]) == (new, YOURS)
    assert (project / "src" / PACKAGE / "engine" / "ready" / "models.py").is_file()

    ran = subprocess.run(
        [
            sys.executable,
            "run.py",
            "experiment=mine",
            "device=cpu",
            "trainer.max_steps=4",
            "trainer.val_every_n_steps=2",
            "mlflow.enabled=false",
        ],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, f"{ran.stdout}\n{ran.stderr}"
    assert (project / "note.txt").read_text(encoding="utf-8") == "2 359\n4 359\n"


@pytest.mark.slow
def test_a_project_without_a_skip_list_takes_the_docs_one_and_the_update_leaves_its_files(
    template: Path,
) -> None:
    """`cruft create` writes no skip list, nor did a bake before the template kept one: the list
    docs/updating.md gives, added to `.cruft.json`, keeps an update off the user's files."""
    layout = git(template, "rev-parse", "HEAD")
    before_the_move(template)
    folder = template.parent
    typed(["cruft", "create", "-y", "continuum"], folder)
    project = folder / "my-trainer"
    state_file = project / ".cruft.json"
    state = json.loads(state_file.read_text(encoding="utf-8"))
    page = (project / "docs" / "updating.md").read_text(encoding="utf-8")
    listed = re.search(r"^```json\n(.*?)^```", page, flags=re.DOTALL | re.MULTILINE)
    state["skip"] = json.loads("{" + listed[1] + "}")["skip"]
    state_file.write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    git(project, "init", "-q")
    add_own_code(project)
    commit_all(project, "Baked, my code added, my files out of the updates")
    own = yours(project)
    after_the_move(template, layout)

    updated = typed(["cruft", "update", "-y"], project)
    assert NEXT_STEPS not in updated.stdout
    assert yours(project) == own
    assert (project / "src" / PACKAGE / "engine" / "ready" / "models.py").is_file()
    assert json.loads(state_file.read_text(encoding="utf-8"))["skip"] == YOURS


@pytest.mark.slow
def test_an_update_brings_the_engines_changed_default_and_new_setting_and_keeps_your_choices(
    bake: Bake, template: Path
) -> None:
    """The engine's configs are the template's: a release's default (checkpoint.keep_last 3 -> 5)
    and a setting its schema now requires both arrive; what the user chose in configs/ (a group's
    option and a setting in config.yaml, an option of their own, a file replacing the engine's)
    stays, byte for byte, and wins."""
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    choose(project)
    commit_all(project, "My choices")
    own = yours(project)
    new = release(template)

    updated = updating(project, update_line(project))
    assert updated.returncode == 0, f"{updated.stdout}\n{updated.stderr}"
    assert "Good work!" in updated.stdout and merged_cleanly(project)
    assert yours(project) == own
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new
    config = composed(project)
    assert (config["checkpoint"]["keep_last"], config["trainer"]["sanity_steps"]) == (5, 7)
    assert config["model"]["_target_"] == f"{PACKAGE}.models.CNN"
    assert config["trainer"]["max_steps"] == 50
    assert config["optimizer"] == {"_target_": "torch.optim.AdamW", "lr": 0.125}
    assert composed(project, "model=small_cnn")["model"]["channels"] == [8, 16]


@pytest.mark.slow
def test_an_update_brings_the_templates_new_experiments_where_experiment_finds_them(
    bake: Bake, template: Path
) -> None:
    """configs/experiment/ is the user's, and the skip list keeps cruft out of it: the line's
    `after` brings an experiment the template added and the new version of one the user never
    changed; one the user changed or removed stays as they left it."""
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    mine = project / "configs" / "experiment"
    (mine / "char_lm.yaml").unlink()
    with (mine / "cnn_digits.yaml").open("a", encoding="utf-8") as file:
        file.write("seed: 3\n")
    commit_all(project, "My experiments")
    edited = (mine / "cnn_digits.yaml").read_bytes()
    shipped = template / "{{cookiecutter.project}}" / "configs" / "experiment"
    (shipped / "wide_mlp.yaml").write_text(
        "# @package _global_\nname: wide_mlp\nmodel:\n  hidden_sizes: [256]\n", encoding="utf-8"
    )
    for name in ("token_gpt", "cnn_digits", "char_lm"):
        with (shipped / f"{name}.yaml").open("a", encoding="utf-8") as file:
            file.write("seed: 4\n")
    commit_all(template, "An experiment added, three changed")

    updated = updating(project, update_line(project))
    assert updated.returncode == 0, f"{updated.stdout}\n{updated.stderr}"
    told = updated.stdout.splitlines()
    assert "new experiments in configs/experiment/: wide_mlp" in told, updated.stdout
    assert "updated experiments you never changed: token_gpt" in told, updated.stdout
    assert (mine / "token_gpt.yaml").read_text(encoding="utf-8").endswith("\nseed: 4\n")
    assert (mine / "cnn_digits.yaml").read_bytes() == edited
    assert not (mine / "char_lm.yaml").exists()
    assert composed(project, "experiment=wide_mlp")["model"]["hidden_sizes"] == [256]
    assert composed(project, "experiment=token_gpt")["seed"] == 4


@pytest.mark.slow
def test_after_stops_in_one_line_when_the_template_is_not_at_the_commit_recorded(
    bake: Bake, template: Path
) -> None:
    """What the bake wrote comes from the template at its commit: one git cannot check out stops
    the step in one line, exit 2, with no URL in it (a URL may hold a token), and writes nothing."""
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    state["commit"] = "0" * 40
    (project / ".cruft.json").write_text(json.dumps(state, indent=2), encoding="utf-8")
    stopped = updating(project, f"python -m {PACKAGE}.engine.update after")
    assert stopped.returncode == 2, f"{stopped.stdout}\n{stopped.stderr}"
    assert stopped.stderr.startswith("error: git could not check out the template that .cruft.json")
    assert stopped.stderr.count("\n") == 1 and str(template) not in stopped.stderr
    assert git(project, "status", "--porcelain") == " M .cruft.json"


def as_at(template: Path, commit: str, message: str) -> str:
    """Commits the template as it was at `commit`, from this checkout's history; returns it."""
    history = ["git", "-C", str(TEMPLATE)]
    if subprocess.run([*history, "cat-file", "-e", f"{commit}^{{commit}}"]).returncode:
        pytest.skip(f"needs the template's commit {commit[:7]}: a checkout with its history")
    git(template, "rm", "-rq", ".")
    parts = ["cookiecutter.json", "hooks", "{{cookiecutter.project}}"]
    tree = subprocess.run([*history, "archive", commit, *parts], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(template)], input=tree.stdout, check=True)
    return commit_all(template, message)


@pytest.mark.slow
def test_a_project_of_one_config_root_moves_to_two_by_the_documented_line_keeping_its_choices(
    bake: Bake, template: Path
) -> None:
    """Baked with every group, option and setting in configs/, its choices made there (a setting
    and a group's option in config.yaml, a default edited in the group's file, an option of its
    own), then updated by the line docs/updating.md gives such a project: a file as the bake wrote
    it gives way to the engine's, and its new defaults arrive (checkpoint.every_s, null then, 300
    now; hydra's exclude_keys, which gained checkpoint.remote*); the edited file keeps the user's
    value and gains the engine's new keys; the template's experiments arrive where `experiment=`
    finds them; the project composes as a fresh bake given those choices."""
    layout = git(template, "rev-parse", "HEAD")
    fresh = bake(template.parent / "fresh", template=template)
    as_at(template, ONE_ROOT, "One config root")
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    configs = project / "configs"
    edit(configs / "config.yaml", "\nname: demo ", "\nname: mine ")
    edit(configs / "config.yaml", "  max_steps: 300 ", "  max_steps: 50 ")
    edit(configs / "config.yaml", "  - model: mlp\n", "  - model: cnn\n")
    edit(configs / "checkpoint" / "default.yaml", "keep_last: 3\n", "keep_last: 2\n")
    (configs / "model" / "small_cnn.yaml").write_text(SMALL_CNN, encoding="utf-8")
    commit_all(project, "My choices")
    git(template, "rm", "-rq", ".")
    git(template, "checkout", layout, "--", ".")
    new = commit_all(template, "Two config roots")

    updated = updating(project, update_line(fresh, FIRST_UPDATE))
    assert updated.returncode == 0, f"{updated.stdout}\n{updated.stderr}"
    assert merged_cleanly(project)
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new
    experiments = {
        path.relative_to(fresh / "configs") for path in (fresh / "configs" / "experiment").iterdir()
    }
    left = {path.relative_to(configs) for path in configs.rglob("*.yaml")}
    assert left == {
        Path("config.yaml"),
        Path("checkpoint/default.yaml"),
        Path("model/small_cnn.yaml"),
        *experiments,
    }
    assert all(
        (configs / path).read_bytes() == (fresh / "configs" / path).read_bytes()
        for path in experiments
    )
    assert "exclude_keys" not in (configs / "config.yaml").read_text(encoding="utf-8")
    told = [line.strip() for line in updated.stdout.splitlines()]
    assert "from the engine now: 31 files you never changed" in told, updated.stdout
    assert (
        "kept: configs/checkpoint/default.yaml (yours: keep_last; the engine's: every_s, remote, "
        "remote_wait_s, remote_lease_s); configs/model/small_cnn.yaml (yours)"
    ) in told
    assert (
        "config.yaml keeps name, trainer.max_steps "
        "(the earlier one: git show HEAD:configs/config.yaml)" in told
    )
    chosen = ["name=mine", "trainer.max_steps=50", "model=cnn", "checkpoint.keep_last=2"]
    assert composed(project) == composed(fresh, *chosen)
    assert composed(project)["checkpoint"]["every_s"] == 300
    assert composed(project, "model=small_cnn")["model"]["channels"] == [8, 16]
    gpt = composed(project, "experiment=token_gpt")  # found in configs/experiment/, as arrived
    assert (gpt["name"], gpt["model"]["_target_"]) == ("token-gpt", f"{PACKAGE}.models.GPT")
    assert hydra_config(project, "job.config.override_dirname.exclude_keys") == hydra_config(
        fresh, "job.config.override_dirname.exclude_keys"
    )


def hydra_config(project: Path, key: str) -> object:
    """A key of the `hydra` node `python run.py` runs with in `project`."""
    code = (
        f"import json, sys; import {PACKAGE}.engine.config  # registers the schema\n"
        "from hydra import compose, initialize_config_dir; from omegaconf import OmegaConf\n"
        "with initialize_config_dir(config_dir=sys.argv[1], version_base='1.3'):\n"
        "    node = compose('config', return_hydra_config=True).hydra\n"
        "print(json.dumps(OmegaConf.to_container(OmegaConf.select(node, sys.argv[2]))))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, str(project / "configs"), key],
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr
    return json.loads(found.stdout)


def set_as_told(project: Path, told: str) -> None:
    """Sets in `.cruft.json` what an update's stop said to set (`set "<key>": <JSON> in
    .cruft.json`), the answer `package` among the answers."""
    key, value = re.search(r'set "(\w+)": (.*?) in \.cruft\.json', told).groups()
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    (state["context"]["cookiecutter"] if key == "package" else state)[key] = json.loads(value)
    (project / ".cruft.json").write_text(json.dumps(state, indent=2), encoding="utf-8")


@pytest.mark.slow
def test_a_project_whose_skip_list_is_empty_is_told_what_to_set_before_a_file_is_written(
    template: Path,
) -> None:
    """With nothing skipped, cruft would merge the template's config.yaml into the user's (a
    conflict in the trial's four files); the line stops first, in one line that gives the list,
    and once it is set the update leaves the user's files and brings the engine's."""
    typed(["cruft", "create", "-y", "continuum"], template.parent)
    project = template.parent / "my-trainer"
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    (project / ".cruft.json").write_text(
        json.dumps({**state, "skip": []}, indent=2), encoding="utf-8"
    )
    git(project, "init", "-q")
    with (project / "configs" / "config.yaml").open("a") as file:
        file.write("# My later line.\n")
    baked = commit_all(project, "Baked, a line of mine added")
    release(template)
    line = update_line(project)

    stopped = updating(project, line)
    assert stopped.returncode == 2, f"{stopped.stdout}\n{stopped.stderr}"
    assert stopped.stderr.startswith("error: .cruft.json's skip leaves out ")
    assert stopped.stderr.count("\n") == 1 and "Traceback" not in stopped.stderr
    assert git(project, "status", "--porcelain") == ""
    assert git(project, "rev-parse", "HEAD") == baked

    set_as_told(project, stopped.stderr)
    commit_all(project, "My files out of the updates")
    own = yours(project)
    updated = updating(project, line)
    assert updated.returncode == 0, f"{updated.stdout}\n{updated.stderr}"
    assert merged_cleanly(project) and yours(project) == own
    assert composed(project)["checkpoint"]["keep_last"] == 5


@pytest.mark.slow
def test_a_renamed_package_stops_the_update_in_one_line_and_the_line_it_gives_brings_the_fix(
    bake: Bake, template: Path
) -> None:
    """`git mv src/my_trainer src/renamed`: cruft would patch nothing of the engine, leave no
    `.rej`, say "Good work!" and record the new commit, so no later update brings the fix either.
    The line stops before cruft; what it says to set makes the update bring the fix to the
    renamed engine."""
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    line = update_line(project).replace(PACKAGE, "renamed")  # as its reader types it now
    git(project, "mv", f"src/{PACKAGE}", "src/renamed")
    for name in git(project, "ls-files").splitlines():
        path = project / name
        text = path.read_text(encoding="utf-8")
        if PACKAGE in text and name != ".cruft.json":
            path.write_text(text.replace(PACKAGE, "renamed"), encoding="utf-8")
    renamed = commit_all(project, "The package renamed")
    release(template)

    stopped = updating(project, line)
    assert stopped.returncode == 2, f"{stopped.stdout}\n{stopped.stderr}"
    assert stopped.stderr.startswith(f"error: the template's engine is src/{PACKAGE}/engine/ ")
    assert 'set "package": "renamed" in .cruft.json' in stopped.stderr
    assert stopped.stderr.count("\n") == 1 and "Traceback" not in stopped.stderr
    assert git(project, "status", "--porcelain") == ""
    assert git(project, "rev-parse", "HEAD") == renamed

    set_as_told(project, stopped.stderr)
    commit_all(project, "The template's answer: my package's name")
    stopped = updating(project, line)  # the skip list's paths name the package too
    assert stopped.returncode == 2 and f'"skip": ["src/{PACKAGE}/models.py' in stopped.stderr
    set_as_told(project, stopped.stderr)
    commit_all(project, "My files, by their new paths, out of the updates")
    updated = updating(project, line)
    assert updated.returncode == 0, f"{updated.stdout}\n{updated.stderr}"
    assert merged_cleanly(project)
    engine = project / "src" / "renamed" / "engine"
    assert "sanity_steps: int = MISSING" in (engine / "config.py").read_text(encoding="utf-8")
    assert composed(project, package="renamed")["checkpoint"]["keep_last"] == 5


def in_project(project: Path, *command: str) -> subprocess.CompletedProcess:
    """`python <command>` in `project`, with its own package."""
    return subprocess.run(
        [sys.executable, *command],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
    )


@pytest.mark.slow
def test_a_flat_engines_project_updates_and_its_old_run_resumes_evaluates_and_exports(
    bake: Bake, template: Path
) -> None:
    """Baked when the engine's modules lay side by side, a run trained there on Arrow shards: its
    checkpoint's config names `my_trainer.engine.ready.arrow.arrow_folder`, which is no module
    after the documented update brings the engine's folders. The update keeps the user's files; the
    project's run.py, eval.py and export.py as they were then (importing `engine.goodput`,
    `engine.checkpoint.remote_url`) resume that run, evaluate and export its checkpoint; and the
    shards' command of before (`python -m my_trainer.engine.ready.arrow`) still writes."""
    layout = git(template, "rev-parse", "HEAD")
    as_at(template, FLAT, "The flat engine")
    project = bake(template.parent / "out", template=template)
    git(project, "init", "-q")
    commit_all(project, "Baked")
    own = yours(project)
    commands = {name: (project / name).read_bytes() for name in ("run.py", "eval.py", "export.py")}
    digits = template.parent / "digits"
    old = f"{PACKAGE}.engine.ready.arrow"
    assert in_project(project, "-m", old, "write-digits", str(digits)).returncode == 0
    train = ["run.py", "experiment=arrow_digits", f"data.dir={digits}", "device=cpu", "mlflow.enabled=false"]
    trained = in_project(project, *train, "trainer.max_steps=4", "trainer.val_every_n_steps=2")
    assert trained.returncode == 0, trained.stderr
    git(template, "rm", "-rq", ".")
    git(template, "checkout", layout, "--", ".")
    new = commit_all(template, "The engine's folders")

    updated = updating(project, update_line(project))
    assert updated.returncode == 0, f"{updated.stdout}\n{updated.stderr}"
    assert merged_cleanly(project) and yours(project) == own
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new
    engine = project / "src" / PACKAGE / "engine"
    assert (engine / "data" / "formats" / "arrow.py").is_file() and not (engine / "ready" / "arrow.py").exists()
    assert (engine / "lifecycle" / "goodput.py").is_file() and not (engine / "goodput.py").exists()

    for name, code in commands.items():  # the project's own, as it wrote them before the update
        (project / name).write_bytes(code)
    resumed = in_project(project, *train, "trainer.max_steps=8", "trainer.val_every_n_steps=2", "resume=last")
    assert resumed.returncode == 0, resumed.stderr
    home = project / "checkpoints" / "arrow-digits"
    assert {path.name for path in home.glob("step_*.pt")} >= {"step_00000004.pt", "step_00000008.pt"}
    evaluated = in_project(project, "eval.py", "name=arrow-digits", "checkpoint=last", "device=cpu", "mlflow.enabled=false")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "val/loss" in evaluated.stdout + evaluated.stderr
    exported = in_project(project, "export.py", "name=arrow-digits", "checkpoint=last", "out=model.safetensors")
    assert exported.returncode == 0, exported.stderr
    assert (project / "model.safetensors").stat().st_size > 0
    again = in_project(project, "-m", old, "write-digits", str(template.parent / "again"))
    assert again.returncode == 0, again.stderr
    assert sorted(path.name for path in (template.parent / "again").rglob("*")) == sorted(
        path.name for path in digits.rglob("*")
    )
