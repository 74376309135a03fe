"""Bake this checkout of the template through the cookiecutter API, away from the user's home."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]

Bake = Callable[..., Path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The end-to-end test first, and the other slow tests (the READMEs' runs, the updates: minutes
    each) first in the list's second half: pytest-xdist's work stealing hands each of two workers a
    half in order, so one starts the end-to-end test and the other the rest of the long ones at
    once, and the short ones fill in as they finish (with one worker, the order changes nothing)."""
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    first = [item for item in slow if item.path.name == "test_end_to_end.py"]
    long = [item for item in slow if item not in first]
    short = [item for item in items if item.get_closest_marker("slow") is None]
    filler = len(items) // 2 - len(first)
    items[:] = first + short[:filler] + long + short[filler:]


@pytest.fixture(scope="session")
def bake(tmp_path_factory: pytest.TempPathFactory) -> Bake:
    """Return bake(output_dir, [template,] **answers), which bakes this checkout (or `template`)
    without prompting and returns the project.

    Cookiecutter records every bake's answers in a replay folder under the home directory;
    a config file pointing that folder at a temporary one keeps the tests off the user's home.
    """
    home = tmp_path_factory.mktemp("cookiecutter-home")
    config = home / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {"cookiecutters_dir": str(home / "cookiecutters"), "replay_dir": str(home / "replay")}
        )
    )

    def _bake(output_dir: Path, template: Path = TEMPLATE, **answers: Any) -> Path:
        project = cookiecutter(
            str(template),
            no_input=True,
            output_dir=str(output_dir),
            extra_context=answers,
            config_file=str(config),
        )
        return Path(project)

    return _bake
