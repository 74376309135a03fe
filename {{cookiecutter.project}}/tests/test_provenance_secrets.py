"""What `provenance/git.diff` may carry to the tracking store, where others read it: the project's
untracked files by name, their content only when mlflow.untracked_content asks for it and only of
source, config and text types (never a hidden file's, a secret-named one's), nothing from outside the
project's folder; what looks like a credential in a tracked file's changes, masked and said; and a
git that fails, said and tagged unknown."""

import logging
import re
from pathlib import Path

import pytest
from test_tracking import git, provenance_of

from {{cookiecutter.package}}.engine import train as recipe
from {{cookiecutter.package}}.engine.tracking.origin import UNTRACKED_BYTES, origin

pytestmark = pytest.mark.slow  # beyond the daily loop: `pytest --all` runs it

# Untracked in the project: files of the forms credentials take (hidden, of no type, INI, JSON, keys
# and certificates), and a config named like a secret (a folder's name counts; case does not). The
# last line of each holds what masking would not catch: only leaving the file out keeps it out.
SECRETS = {
    ".env": "API_TOKEN=env-0f1e2d\n",
    "id_rsa": "-----BEGIN OPENSSH PRIVATE KEY-----\nrsa-9a8b7c\n",
    "secrets.json": '{"password": "json-5d4c3b"}\n',
    "Secrets/db.yaml": "db: folder-7c6b5a\n",
    "tls/server.PEM": "pem-2b3c4d\n",
    ".netrc": "machine example.com login me password netrc-4d5e6f\n",
    ".pypirc": "[pypi]\nusername = __token__\n# pypirc-5f6a7b\n",
    "kubeconfig": "users:\n- name: me\n  user: kube-6a7b8c\n",
    "cert.p12": "p12-7b8c9d\n",
    "service-account.json": '{"type": "service_account", "client_email": "sa-8c9d0e@example.iam"}\n',
    ".aws/config": "[default]\nregion = aws-config-9d0e1f\n",
    ".ssh/config": "Host gpu\n  HostName ssh-0e1f2a.example\n",
    ".docker/config.json": '{"auths": {"registry.example": {"auth": "ZG9ja2VyLTFmMmEzYg=="}}}\n',
    ".pgpass": "db.example:5432:*:me:pgpass-2a3b4c\n",
    ".htpasswd": "me:$apr1$htpasswd-3b4c5d\n",
    "setup.cfg": "[upload]\nkey-4c5d6e\n",
    "openai_key.txt": "apikey-5e6f7a\n",
}
# Untracked source and configs of the types whose content is copied.
SOURCES = {"notes.txt": "notes-3c2b1a\n", "layers.py": "depth = 3\n", "experiment/wide.yaml": "width: 64\n"}
# Untracked in the larger repository, outside the project's folder.
OUTSIDE = {".aws/credentials": "aws_secret_access_key = aws-1a2b3c\n", ".bash_history": "export T=history-6e5f4a\n"}
NAMED_ONLY = (
    "# Untracked files, named only: their content is copied only with mlflow.untracked_content=true, and only "
    "that of a file of its own of at most 1 MiB, of a type among .py .pyi .yaml .yml .toml .md .rst .txt .c .cpp "
    ".h .cu, neither hidden nor named like a secret\n"
)
NAMED = sorted(f"project/{name}" for name in [*SECRETS, "data.csv", "linked.txt", "vocab.txt"])
TEN_STEPS = "trainer.max_steps=10"


@pytest.fixture
def inside_a_repository(tmp_path, monkeypatch) -> Path:
    """The project's folder, the run's working folder, inside a larger git repository (a home folder
    kept in git): a committed file changed in it and one outside it; untracked in it, secrets,
    sources, data and a text over 1 MiB, and a link out to the credentials that lie untracked outside it."""
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
    for folder, files in ((outer, OUTSIDE), (project, SECRETS), (project, SOURCES)):
        for name, text in files.items():
            (folder / name).parent.mkdir(exist_ok=True)
            (folder / name).write_text(text)
    (project / "data.csv").write_bytes(b"0\n" * (UNTRACKED_BYTES // 2 + 1))
    (project / "vocab.txt").write_bytes(b"a\n" * (UNTRACKED_BYTES // 2 + 1))
    (project / "linked.txt").symlink_to(outer / ".aws" / "credentials")
    monkeypatch.chdir(project)
    return project


def named(diff: str) -> list[str]:
    """The untracked files the diff names without their content."""
    assert diff.startswith(NAMED_ONLY)
    return [line.removeprefix("#   ") for line in diff.splitlines() if line.startswith("#   ")]


def assert_no_secret_in(diff: str) -> None:
    assert [name for name, text in {**SECRETS, **OUTSIDE}.items() if text.splitlines()[-1] in diff] == []
    assert all(name not in diff for name in (".aws/credentials", ".bash_history", ".profile"))  # outside the project


def applies_in_reverse(outer: Path, diff: str, tmp_path: Path) -> None:
    (tmp_path / "git.diff").write_text(diff)
    git(outer, "apply", "--check", "-R", str(tmp_path / "git.diff"))


def test_untracked_files_are_named_without_their_content_and_nothing_outside_the_project(
    inside_a_repository, make_cfg, client, tmp_path
):
    run_id = recipe.train(make_cfg(TEN_STEPS))["run_id"]
    assert client.get_run(run_id).data.tags["git.dirty"] == "true"
    diff = provenance_of(client, run_id, tmp_path / "artifacts")["git.diff"]
    assert named(diff) == sorted([*NAMED, *(f"project/{name}" for name in SOURCES)])
    assert_no_secret_in(diff)
    assert not any(text.strip() in diff for text in SOURCES.values())
    assert "-width = 1\n+width = 2\n" in diff
    applies_in_reverse(inside_a_repository.parent, diff, tmp_path)


def test_asked_for_the_content_of_untracked_files_the_diff_copies_source_and_configs_only_never_a_secret_or_link(
    inside_a_repository, make_cfg, client, tmp_path, capfd
):
    run_id = recipe.train(make_cfg(TEN_STEPS, "mlflow.untracked_content=true"))["run_id"]
    diff = provenance_of(client, run_id, tmp_path / "artifacts")["git.diff"]
    for name, text in SOURCES.items():
        assert f"+++ b/project/{name}\n@@ -0,0 +1 @@\n+{text}" in diff
    assert_no_secret_in(diff)
    assert named(diff) == NAMED
    applies_in_reverse(inside_a_repository.parent, diff, tmp_path)
    assert (
        "provenance/git.diff names but leaves out the untracked files over 1 MiB, taken for data: project/vocab.txt "
        "(add them to .gitignore, or commit them)"
    ) in capfd.readouterr().err


# Lines added to a tracked README: each holds a credential of a kind masking knows, the part that must
# not reach the store after it; and lines that name a token's place, not its value, which stay.
CREDENTIALS = {
    "aws_access_key_id = AKIAZ3Q4R5S6T7U8V9W0": "AKIAZ3Q4R5S6T7U8V9W0",
    f"export GITHUB_TOKEN=ghp_{'A1b2' * 9}": "A1b2A1b2",
    "gitlab: glpat-x9Y8z7W6v5U4t3S2r1Q0": "x9Y8z7W6v5U4t3S2r1Q0",
    "slack: xoxb-1234567890-abcdefghij": "abcdefghij",
    "openai: sk-proj-Q1w2E3r4T5y6U7i8O9p0": "Q1w2E3r4T5y6U7i8O9p0",
    "hub: hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345": "AbCdEfGhIjKlMnOpQrStUvWxYz012345",
    "password: hunter2-pw": "hunter2-pw",
    "db: postgresql://alice:url-s3cr3t@db.example/runs": "url-s3cr3t",
    '"client_secret": "json-9f8e7d"': "json-9f8e7d",
    "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA-key-body\n-----END RSA PRIVATE KEY-----": "key-body",
}
PLACES = ['eos_token: "</s>"', "max_new_tokens: 256", "hub_token: ${oc.env:HF_TOKEN}", "docs: https://example.com/x"]


def test_what_looks_like_a_credential_in_a_tracked_files_changes_is_masked_and_said(
    inside_a_repository, make_cfg, client, tmp_path, capfd
):
    readme = inside_a_repository / "README.md"
    readme.write_text("# Demo\n")
    git(inside_a_repository.parent, "add", "project/README.md")
    git(inside_a_repository.parent, "commit", "-q", "-m", "readme")
    readme.write_text("# Demo\n" + "".join(f"{line}\n" for line in [*CREDENTIALS, *PLACES]))

    run_id = recipe.train(make_cfg(TEN_STEPS))["run_id"]  # untracked content left out, as by default
    diff = provenance_of(client, run_id, tmp_path / "artifacts")["git.diff"]
    assert not [secret for secret in CREDENTIALS.values() if secret in diff]
    said = (
        "what looks like a credential (a private key, a cloud key, a token, a password) in project/README.md "
        "(10 lines): there, this diff does not apply"
    )
    assert diff.splitlines()[len(named(diff)) + 1] == f"# Masked as <masked>, {said}"
    changed = diff.split("+++ b/project/README.md\n")[1].split("diff --git")[0]
    assert [line[1:] for line in changed.splitlines() if line.startswith("+")] == [
        "aws_access_key_id = <masked>",
        "export GITHUB_TOKEN=<masked>",
        "gitlab: <masked>",
        "slack: <masked>",
        "openai: <masked>",
        "hub: <masked>",
        "password: <masked>",
        "db: postgresql://alice:<masked>@db.example/runs",
        '"client_secret": "<masked>"',
        "-----BEGIN RSA PRIVATE KEY-----",
        "<masked>",
        "-----END RSA PRIVATE KEY-----",
        *PLACES,
    ]
    assert "-width = 1\n+width = 2\n" in diff  # the rest as it was
    warned = [line for line in capfd.readouterr().err.splitlines() if "masks" in line]
    assert len(warned) == 1 and warned[0].endswith(
        "provenance/git.diff masks what looks like a credential in project/README.md (10 lines): keep it out of the "
        "project's files (in an environment variable, or a file that git ignores)"
    )


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
