"""What `provenance/git.diff` may carry to the tracking store, where others read it: the project's
untracked files by name, their content only when mlflow.untracked_content asks for it and never a
secret's, nothing from outside the project's folder; and a git that fails, said and tagged unknown."""

import logging
import re
from pathlib import Path

import pytest
from test_tracking import git, provenance_of

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.origin import UNTRACKED_BYTES, origin

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# Untracked in the project, each named like a secret (a folder's name counts; case does not).
SECRETS = {
    ".env": "API_TOKEN=env-0f1e2d\n",
    "id_rsa": "-----BEGIN OPENSSH PRIVATE KEY-----\nrsa-9a8b7c\n",
    "secrets.json": '{"password": "json-5d4c3b"}\n',
    "Secrets/db.yaml": "password: folder-7c6b5a\n",
    "tls/server.PEM": "pem-2b3c4d\n",
}
# Untracked in the larger repository, outside the project's folder.
OUTSIDE = {".aws/credentials": "aws_secret_access_key = aws-1a2b3c\n", ".bash_history": "export T=history-6e5f4a\n"}
NOTES = "notes-3c2b1a\n"
NAMED_ONLY = (
    "# Untracked files, named only: their content is copied only with mlflow.untracked_content=true, and never "
    "that of a link, of a file over 1 MiB or of a name that looks like a secret's\n"
)
TEN_STEPS = "trainer.max_steps=10"


@pytest.fixture
def inside_a_repository(tmp_path, monkeypatch) -> Path:
    """The project's folder, the run's working folder, inside a larger git repository (a home folder
    kept in git): a committed file changed in it and one outside it; untracked in it, secrets,
    notes, data over 1 MiB and a link out to the credentials that lie untracked outside it."""
    outer = tmp_path / "home"
    project = outer / "project"
    project.mkdir(parents=True)
    git(outer, "init", "-q")
    (outer / ".profile").write_text("PATH=/bin\n")
    (project / "model.py").write_text("width = 1\n")
    git(outer, "add", "-A")
    git(outer, "commit", "-q", "-m", "first")
    (outer / ".profile").write_text("PATH=/bin:/opt/bin\n")
    (project / "model.py").write_text("width = 2\n")
    for folder, files in ((outer, OUTSIDE), (project, SECRETS)):
        for name, text in files.items():
            (folder / name).parent.mkdir(exist_ok=True)
            (folder / name).write_text(text)
    (project / "notes.txt").write_text(NOTES)
    (project / "data.csv").write_bytes(b"0\n" * (UNTRACKED_BYTES // 2 + 1))
    (project / "linked.txt").symlink_to(outer / ".aws" / "credentials")
    monkeypatch.chdir(project)
    return project


def named(diff: str) -> list[str]:
    """The untracked files the diff names without their content."""
    assert diff.startswith(NAMED_ONLY)
    return [line.removeprefix("#   ") for line in diff.splitlines() if line.startswith("#   ")]


def assert_no_secret_in(diff: str) -> None:
    for text in [*SECRETS.values(), *OUTSIDE.values()]:
        assert text.splitlines()[-1] not in diff
    assert ".aws" not in diff and ".bash_history" not in diff and ".profile" not in diff  # outside the project


def applies_in_reverse(outer: Path, diff: str, tmp_path: Path) -> None:
    (tmp_path / "git.diff").write_text(diff)
    git(outer, "apply", "--check", "-R", str(tmp_path / "git.diff"))


def test_untracked_files_are_named_without_their_content_and_nothing_outside_the_project(
    inside_a_repository, make_cfg, client, tmp_path
):
    run_id = recipe.train(make_cfg(TEN_STEPS))["run_id"]
    assert client.get_run(run_id).data.tags["git.dirty"] == "true"
    diff = provenance_of(client, run_id, tmp_path / "artifacts")["git.diff"]
    assert named(diff) == [
        "project/.env",
        "project/Secrets/db.yaml",
        "project/data.csv",
        "project/id_rsa",
        "project/linked.txt",
        "project/notes.txt",
        "project/secrets.json",
        "project/tls/server.PEM",
    ]
    assert_no_secret_in(diff)
    assert NOTES.strip() not in diff
    assert "-width = 1\n+width = 2\n" in diff
    applies_in_reverse(inside_a_repository.parent, diff, tmp_path)


def test_asked_for_the_content_of_untracked_files_the_diff_copies_no_secret_link_or_data(
    inside_a_repository, make_cfg, client, tmp_path, capfd
):
    run_id = recipe.train(make_cfg(TEN_STEPS, "mlflow.untracked_content=true"))["run_id"]
    diff = provenance_of(client, run_id, tmp_path / "artifacts")["git.diff"]
    assert f"+++ b/project/notes.txt\n@@ -0,0 +1 @@\n+{NOTES}" in diff
    assert named(diff) == [
        "project/.env",
        "project/Secrets/db.yaml",
        "project/data.csv",
        "project/id_rsa",
        "project/linked.txt",
        "project/secrets.json",
        "project/tls/server.PEM",
    ]
    assert_no_secret_in(diff)
    applies_in_reverse(inside_a_repository.parent, diff, tmp_path)
    assert (
        "provenance/git.diff names but leaves out the untracked files over 1 MiB, taken for data: project/data.csv "
        "(add them to .gitignore, or commit them)"
    ) in capfd.readouterr().err


def test_a_git_that_fails_on_a_corrupt_index_is_said_once_and_tagged_unknown(
    inside_a_repository, make_cfg, client, tmp_path, capfd
):
    outer = inside_a_repository.parent
    head = git(outer, "rev-parse", "HEAD").strip()
    (outer / ".git" / "index").write_text("junk\n")
    run_id = recipe.train(make_cfg(TEN_STEPS))["run_id"]
    tags = client.get_run(run_id).data.tags
    assert (tags["git.dirty"], tags["mlflow.source.git.commit"]) == ("unknown", head)
    assert sorted(provenance_of(client, run_id, tmp_path / "artifacts")) == ["requirements.txt"]
    said = [line for line in capfd.readouterr().err.splitlines() if "git failed" in line]
    assert len(said) == 1
    assert re.search(
        rf"git failed in {re.escape(str(inside_a_repository))} \(.*index.*\): the run is tagged git.dirty=unknown, "
        r"and its provenance/git.diff is left out$",
        said[0],
    )


def test_without_git_in_a_checkout_the_tree_is_unknown_and_outside_one_nothing_is_said(
    inside_a_repository, tmp_path, monkeypatch, caplog
):
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    (tmp_path / "elsewhere").mkdir()
    with caplog.at_level(logging.WARNING):
        assert "git.dirty" not in origin(tmp_path / "elsewhere", untracked_content=False)[0]
        assert not caplog.records
        tags, files = origin(inside_a_repository, untracked_content=False)
    assert tags["git.dirty"] == "unknown" and "mlflow.source.git.commit" not in tags and "git.diff" not in files
    assert caplog.messages == [
        f"git failed in {inside_a_repository} (git is not installed): the run is tagged git.dirty=unknown, "
        f"and its provenance/git.diff is left out"
    ]
