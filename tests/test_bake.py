"""Every answer combination bakes a project that parses, loads and does what was asked."""

import ast
import importlib.metadata
import itertools
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
from cookiecutter.exceptions import FailedHookException

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

Bake = Callable[..., Path]

DEVICES = ("auto", "cpu", "cuda", "xpu")
# (answers, device the project should default to, whether IPEX support is baked in)
ANSWERS = [pytest.param(({}, "auto", False), id="defaults")] + [
    pytest.param(
        ({"default_device": device, "ipex": ipex}, device, ipex), id=f"{device}-ipex{ipex}"
    )
    for device, ipex in itertools.product(DEVICES, (False, True))
]
DEFAULT_PACKAGE = "my_trainer"
TEMPLATE = Path(__file__).resolve().parents[1] / "{{cookiecutter.project}}"
JINJA = re.compile(r"\{\{|\{%|\{#")
# cookiecutter.json copies these verbatim (_copy_without_render): GitHub Actions uses ${{ }}.
VERBATIM = Path(".github", "workflows")
IPEX_HEADING = "## Intel Extension for PyTorch (opt-in)"


@pytest.fixture(scope="module", params=ANSWERS)
def baked(
    request: pytest.FixtureRequest, bake: Bake, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, str, bool]:
    """Bake once per answer combination; the checks below only read the tree."""
    answers, device, ipex = request.param
    return bake(tmp_path_factory.mktemp("bake"), **answers), device, ipex


def files(project: Path) -> list[Path]:
    """Every file in the baked tree, sorted so failure messages are stable."""
    return sorted(path for path in project.rglob("*") if path.is_file())


def grep(project: Path, pattern: re.Pattern[str], exclude: Path | None = None) -> list[str]:
    """Return 'path' for each file name and 'path:line: text' for each line matching pattern."""
    hits = []
    for path in files(project):
        relative = path.relative_to(project)
        if exclude is not None and relative.is_relative_to(exclude):
            continue
        if pattern.search(str(relative)):
            hits.append(str(relative))
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            if pattern.search(line):
                hits.append(f"{relative}:{number}: {line.strip()}")
    return hits


def test_no_jinja_syntax_survives_rendering(baked: tuple[Path, str, bool]) -> None:
    project, _, _ = baked
    assert grep(project, JINJA, exclude=VERBATIM) == []


def test_every_python_file_parses(baked: tuple[Path, str, bool]) -> None:
    project, _, _ = baked
    for path in files(project):
        if path.suffix == ".py":
            ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_every_yaml_file_loads(baked: tuple[Path, str, bool]) -> None:
    project, _, _ = baked
    for path in files(project):
        if path.suffix in (".yaml", ".yml"):
            yaml.safe_load(path.read_text(encoding="utf-8"))


def test_no_file_is_empty_except_py_typed(baked: tuple[Path, str, bool]) -> None:
    project, _, _ = baked
    empty = [
        str(path.relative_to(project))
        for path in files(project)
        if path.name != "py.typed" and not path.read_bytes().strip()
    ]
    assert empty == []


@pytest.mark.parametrize(
    "page",
    [
        "README.md",
        *sorted(path.relative_to(TEMPLATE).as_posix() for path in TEMPLATE.glob("docs/*.md")),
    ],
)
def test_the_readme_and_docs_render_every_heading_as_a_heading(
    baked: tuple[Path, str, bool], page: str
) -> None:
    """Whitespace control in the template's Jinja can glue a heading to the line before it, or
    leave a code fence open, and then everything after renders as text or code."""
    project, _, ipex = baked
    expected = headings((TEMPLATE / page).read_text(encoding="utf-8"))
    if not ipex and IPEX_HEADING in expected:
        expected.remove(IPEX_HEADING)
    assert headings((project / page).read_text(encoding="utf-8")) == expected


def headings(text: str) -> list[str]:
    """A page's headings below its title (which names the project), outside code blocks; fails on
    a heading glued to the line before it or a code fence never closed."""
    lines = text.splitlines()
    found, in_code = [], False
    for number, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif line.startswith("#") and not in_code:
            assert number == 0 or lines[number - 1] == "", (
                f"{line!r} is glued to the line before it"
            )
            if line.startswith("##"):
                found.append(line)
    assert not in_code, "a code fence is never closed"
    return found


def test_config_defaults_list_picks_the_chosen_device(baked: tuple[Path, str, bool]) -> None:
    project, device, _ = baked
    config = yaml.safe_load((project / "configs" / "config.yaml").read_text(encoding="utf-8"))
    assert {"device": device} in config["defaults"]


def test_ipex_is_mentioned_only_when_asked_for(baked: tuple[Path, str, bool]) -> None:
    project, _, ipex = baked
    if not ipex:
        # .cruft.json records every answer, this one too (`"ipex": false`), for cruft update.
        assert grep(project, re.compile("ipex", re.IGNORECASE), exclude=Path(".cruft.json")) == []
        return
    assert (project / "src" / DEFAULT_PACKAGE / "engine" / "ipex.py").is_file()
    pyproject = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    assert "ipex" in pyproject["project"]["optional-dependencies"]


def test_ruff_targets_the_oldest_python_the_project_supports(bake: Bake, tmp_path: Path) -> None:
    project = bake(tmp_path, python_min="3.12")
    pyproject = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    assert pyproject["project"]["requires-python"] == ">=3.12"
    assert pyproject["tool"]["ruff"]["target-version"] == "py312"


def test_a_bake_ends_by_saying_what_to_type_next(tmp_path: Path) -> None:
    """As a person bakes: the cookiecutter command, whose output they read."""
    config = tmp_path / "cookiecutter.yaml"  # replays go here, not to the home directory
    config.write_text(yaml.safe_dump({"replay_dir": str(tmp_path / "replay")}), encoding="utf-8")
    cookiecutter = Path(sys.executable).with_name("cookiecutter")
    command = [
        str(cookiecutter),
        "--no-input",
        "--config-file",
        str(config),
        "-o",
        str(tmp_path),
        str(TEMPLATE.parent),
    ]
    result = subprocess.run(
        [*command, "project=demo-run"], capture_output=True, text=True, check=True
    )
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert "Created demo-run. Next, as its README says:" in lines and "cd demo-run" in lines
    readme = (tmp_path / "demo-run" / "README.md").read_text(encoding="utf-8")
    setup = next(line for line in lines if line.startswith("python3 -m venv"))
    assert f"{setup} && .venv/bin/python run.py" in readme  # the README's set-up line, less the run
    assert any(
        line.startswith(".venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db")
        for line in lines
    )


def test_package_is_derived_from_project_name(bake: Bake, tmp_path: Path) -> None:
    project = bake(tmp_path, project="Fancy-Trainer")
    assert project == tmp_path / "Fancy-Trainer"
    assert (project / "src" / "fancy_trainer" / "__init__.py").is_file()


REJECTED = [
    pytest.param("package", value, id=f"package={value}")
    for value in ("torch", "class", "1abc", "my-pkg", "json")
] + [pytest.param("python_min", value, id=f"python_min={value}") for value in ("2.7", "3.9", "3")]


@pytest.mark.parametrize(("answer", "value"), REJECTED)
def test_pre_gen_hook_refuses_with_one_line_naming_the_answer_and_bakes_nothing(
    bake: Bake, tmp_path: Path, capfd: pytest.CaptureFixture[str], answer: str, value: str
) -> None:
    with pytest.raises(FailedHookException):
        bake(tmp_path, **{answer: value})
    assert list(tmp_path.iterdir()) == []
    [line] = capfd.readouterr().err.splitlines()
    assert line.startswith(f"error: {answer} {value!r} ")


def test_a_refused_answer_typed_at_the_prompt_gets_the_same_line_phrased_for_the_prompt(
    tmp_path: Path,
) -> None:
    """As a person answers the questions: Enter for the defaults, a keyword for the package."""
    config = tmp_path / "cookiecutter.yaml"
    config.write_text(yaml.safe_dump({"replay_dir": str(tmp_path / "replay")}), encoding="utf-8")
    cookiecutter = Path(sys.executable).with_name("cookiecutter")
    out = tmp_path / "out"
    result = subprocess.run(
        [str(cookiecutter), "--config-file", str(config), "-o", str(out), str(TEMPLATE.parent)],
        input="\nclass\n" + "\n" * 10,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1
    [line] = [line for line in result.stderr.splitlines() if "error: " in line]
    assert line.endswith(
        "error: package 'class' is a Python keyword; run cookiecutter again and answer the "
        "package question with <another name> (or pass package=<another name> with --no-input)"
    )
    assert not out.exists() or list(out.iterdir()) == []


# The bake's three collections in one interpreter (each alone pays torch's and MLflow's imports):
# pytest's `--collect-only` with the options of each, as its command line would be, printed as JSON.
COLLECTIONS = """
import json, sys
import pytest

class Collected:
    def pytest_collection_finish(self, session):
        self.tests = [item.nodeid for item in session.items]

found = []
for options in json.loads(sys.argv[1]):
    collected = Collected()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *options], [collected])
    assert code == 0, f"pytest --collect-only {' '.join(options)} exited {code}"
    found.append(collected.tests)
print(json.dumps(found))
"""


def test_the_bakes_default_pytest_leaves_out_the_slow_tests_and_all_adds_them(
    bake: Bake, tmp_path: Path
) -> None:
    project = bake(tmp_path)
    options = [[], ["--all"], ["-m", "slow and not daily"]]
    result = subprocess.run(
        [sys.executable, "-c", COLLECTIONS, json.dumps(options)],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    default, every, slow = map(set, json.loads(result.stdout.splitlines()[-1]))
    assert default and slow and default | slow == every and not default & slow
    # Slow by its `project` fixture (a subprocess), not by a marker of its own:
    assert any(
        test.startswith("tests/test_untrusted_files.py::test_a_fifo_named_for_a_checkpoint")
        for test in slow
    )
    # A module of the engine's contracts is slow, but for the tests it marks daily:
    assert (
        "tests/test_tracking.py::test_a_run_records_only_the_settings_of_the_components_it_chose"
        in slow
    )
    assert (
        "tests/test_resume.py::test_setup_restores_after_the_move_so_every_tensor_lands_on_the_target_device[mlp]"
        in default
    )


def template_version(project: Path) -> str:
    """What the baked project's runs tag as `template.version` (its origin.py, as the MLflow
    sender calls it from the folder a run starts in)."""
    origin = f"{DEFAULT_PACKAGE}.engine.tracking.origin"
    code = f"from {origin} import template_version; print(template_version(Path()))"
    found = subprocess.run(
        [sys.executable, "-c", f"from pathlib import Path; {code}"],
        cwd=project,
        env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True,
        text=True,
        check=True,
    )
    return found.stdout.strip()


def test_a_bake_records_the_template_and_its_commit_which_its_runs_tag(
    bake: Bake, tmp_path: Path
) -> None:
    project = bake(tmp_path)
    head = subprocess.run(
        ["git", "-C", str(TEMPLATE.parent), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    state = json.loads((project / ".cruft.json").read_text(encoding="utf-8"))
    assert (state["template"], state["commit"], state["checkout"]) == (
        str(TEMPLATE.parent),
        head,
        None,
    )
    answers = state["context"]["cookiecutter"]
    assert (answers["project"], answers["package"], answers["_template"]) == (
        "my-trainer",
        DEFAULT_PACKAGE,
        str(TEMPLATE.parent),
    )
    # Where this bake ran: cookiecutter sets them again when cruft bakes the update.
    assert "_output_dir" not in answers and "_repo_dir" not in answers
    assert template_version(project) == head


def test_a_template_that_is_no_git_checkout_bakes_with_a_null_commit(
    bake: Bake, tmp_path: Path
) -> None:
    copy = tmp_path / "template"
    shutil.copytree(
        TEMPLATE.parent, copy, ignore=shutil.ignore_patterns(".git", ".venv", "demo", "*_cache")
    )
    project = bake(tmp_path / "out", template=copy)
    assert json.loads((project / ".cruft.json").read_text(encoding="utf-8"))["commit"] is None
    assert template_version(project) == "unknown"


# The distributions of the launchers and the sweeper, by the module a test asks for.
LAUNCHERS = {
    "hydra_plugins.hydra_joblib_launcher": "hydra-joblib-launcher",
    "hydra_plugins.hydra_submitit_launcher": "hydra-submitit-launcher",
    "hydra_plugins.hydra_optuna_sweeper": "hydra-optuna-sweeper",
}
NEEDS_A_LAUNCHER = re.compile(
    r"""importorskip\("(hydra_plugins\.\w+)", reason="pip install -e '\.\[(\w+)\]'"\)"""
)


def distribution(requirement: str) -> str:
    return re.split(r"[<>=!~; \[]", requirement, maxsplit=1)[0]


def test_the_dev_extra_holds_no_launcher_and_each_launcher_test_names_the_extra_that_does(
    bake: Bake, tmp_path: Path
) -> None:
    """`pip install -e '.[dev]'` is the daily loop's; the sweep launchers and the search (optuna,
    submitit and what they bring) are extras of their own, which the docs of sweeps name."""
    project = bake(tmp_path)
    pyproject = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    extras = {
        name: {distribution(requirement) for requirement in requirements}
        for name, requirements in pyproject["project"]["optional-dependencies"].items()
    }
    assert not extras["dev"] & set(LAUNCHERS.values())
    asked = {
        found
        for test in (project / "tests").glob("test_*.py")
        for found in NEEDS_A_LAUNCHER.findall(test.read_text(encoding="utf-8"))
    }
    assert {module for module, _ in asked} == set(LAUNCHERS)
    for module, extra in asked:
        assert LAUNCHERS[module] in extras[extra], f"{module}: the extra {extra} lacks it"
    sweeps = (project / "docs" / "sweeps.md").read_text(encoding="utf-8")
    assert "pip install -e '.[sweeps]'" in sweeps and "pip install -e '.[search]'" in sweeps


REQUIREMENT = re.compile(r"([A-Za-z0-9_.-]+)\s*(?:\[([^\]]*)\])?")


def test_ci_installs_with_the_readmes_commands_and_every_extra_they_ask_for_exists(
    bake: Bake, tmp_path: Path
) -> None:
    """CI's installs (but torch's, which the README leaves to the reader's machine) are the README's
    commands as typed, of extras the project has; and each package asked for with an extra of its
    own (`moto[s3]`) has that extra where it is installed here: pip only warns of one that is gone
    (`s3fs[boto3]`), and installs the package without what the name promised."""
    project = bake(tmp_path)
    ci = yaml.safe_load((project / ".github" / "workflows" / "ci.yml").read_text(encoding="utf-8"))
    runs = [step.get("run", "") for step in ci["jobs"]["test"]["steps"]]
    installs = [run for run in runs if run.startswith("pip install") and "torch" not in run]
    readme = (project / "README.md").read_text(encoding="utf-8")
    assert installs and [run for run in installs if f"`{run}`" not in readme] == []
    pyproject = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))
    extras = pyproject["project"]["optional-dependencies"]
    for run in installs:
        named = re.fullmatch(r"pip install -e '\.\[([\w,-]+)\]'", run)[1].split(",")
        assert set(named) <= set(extras), run
    ours = (TEMPLATE.parent / "requirements-dev.txt").read_text(encoding="utf-8").splitlines()
    for requirement in [*itertools.chain(*extras.values()), *ours]:
        name, asked = REQUIREMENT.match(requirement.split("#")[0].strip() or "-").groups()
        if asked and (provided := installed_extras(name)) is not None:
            assert set(asked.split(",")) <= provided, f"{requirement}: {name} has {provided}"


def installed_extras(name: str) -> set[str] | None:
    """The extras the installed distribution `name` provides; None where it is not installed."""
    try:
        return set(importlib.metadata.metadata(name).get_all("Provides-Extra") or [])
    except importlib.metadata.PackageNotFoundError:
        return None


# Imported first in the bake's test processes: the launchers and the sweeper as if not installed.
WITHOUT_LAUNCHERS = f"""
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.startswith({tuple(LAUNCHERS)!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Absent())
"""


def launcher_tests(tests: Path) -> dict[str, str]:
    """Each test of the bake's that asks for a launcher or the sweeper, by its pytest node id, with
    the extra its skip names."""
    found = {}
    for module in sorted(tests.glob("test_*.py")):
        source = module.read_text(encoding="utf-8")
        for test in ast.parse(source).body:
            if isinstance(test, ast.FunctionDef):
                for _, extra in NEEDS_A_LAUNCHER.findall(ast.get_source_segment(source, test)):
                    found[f"tests/{module.name}::{test.name}"] = extra
    return found


@pytest.mark.slow
def test_without_the_launchers_their_tests_skip_each_naming_its_extra(
    bake: Bake, tmp_path: Path
) -> None:
    project = bake(tmp_path / "bake")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(WITHOUT_LAUNCHERS, encoding="utf-8")
    tests = launcher_tests(project / "tests")
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--all", *tests],
        cwd=project,
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{project / 'src'}"},
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    skipped = [line for line in ran.stdout.splitlines() if line.startswith("SKIPPED")]
    assert f"{len(tests)} skipped" in ran.stdout and len(skipped) == len(tests), ran.stdout
    for extra in set(tests.values()):
        named = sum(f"pip install -e '.[{extra}]'" in line for line in skipped)
        assert named == list(tests.values()).count(extra), ran.stdout


@pytest.mark.slow
def test_an_install_that_is_not_editable_carries_the_engines_configs(
    bake: Bake, tmp_path: Path
) -> None:
    """The engine's configs are data of its package: a project's configs/ finds them where the
    package is installed, its src/ nowhere on the path."""
    project = bake(tmp_path / "bake")
    installed = tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(installed), str(project)], check=True)
    engine = Path("my_trainer", "engine", "configs")
    shipped = {
        path.relative_to(project / "src" / engine)
        for path in (project / "src" / engine).rglob("*.yaml")
    }
    assert {
        path.relative_to(installed / engine) for path in (installed / engine).rglob("*.yaml")
    } == shipped
    configs = shutil.copytree(project / "configs", tmp_path / "elsewhere" / "configs")
    code = (
        "import sys; import my_trainer.engine.config  # the schema, registered as it is imported\n"
        "from my_trainer.engine.config_roots import config_roots\n"
        "from hydra import compose, initialize_config_dir\n"
        "from hydra.core.hydra_config import HydraConfig\n"
        "with initialize_config_dir(config_dir=sys.argv[1], version_base='1.3'):\n"
        "    cfg = compose('config', ['optimizer=sgd'], return_hydra_config=True)\n"
        "HydraConfig.instance().set_config(cfg)\n"
        "print(cfg.optimizer._target_, *config_roots())"
    )
    found = subprocess.run(
        [sys.executable, "-c", code, str(configs)],
        cwd=tmp_path / "elsewhere",
        env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["torch.optim.SGD", str(configs), str(installed / engine)]
