"""What looks like a credential in a diff bound for the tracking store (engine/tracking/masking.py): masked in
added, removed and context lines alike, its place kept (`password: <masked>`), the lines counted per
file; what names a secret's place rather than its value, and the tokenizer's own tokens, left as
they are; the diff's headers and its number of lines unchanged."""

import pytest

from {{cookiecutter.package}}.engine.tracking.masking import MASK, mask


def diff_of(path: str, *lines: str) -> str:
    """git's diff of `path`, its changed and context lines as given (each with its sign)."""
    return (
        f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,{len(lines)} +1,{len(lines)} @@\n"
        + "".join(f"{line}\n" for line in lines)
    )


MASKED = {
    "+aws_access_key_id = AKIAIOSFODNN7EXAMPLE": "+aws_access_key_id = <masked>",
    "+see ASIAY34FZKBOKMUTVV7A here": "+see <masked> here",
    f"-GITHUB_TOKEN=ghp_{'x' * 36}": "-GITHUB_TOKEN=<masked>",
    f" url = https://github_pat_{'y' * 30}@github.com": " url = https://<masked>@github.com",
    "+gitlab glpat-abcdefghij0123456789": "+gitlab <masked>",
    "+slack xoxb-1234567890-abcdefghij": "+slack <masked>",
    "+OPENAI sk-proj-abcdefghij0123456789": "+OPENAI <masked>",
    f"+login hf_{'z' * 34}": "+login <masked>",
    f"+maps AIza{'k' * 35}": "+maps <masked>",
    "+password: hunter2-pw": "+password: <masked>",
    "+password: pass:word#1": "+password: <masked>",
    '+"client_secret": "json-5d4c3b",': '+"client_secret": "<masked>",',
    "+aws_secret_access_key = aws-1a2b3c": "+aws_secret_access_key = <masked>",
    "+export HF_TOKEN=abcdef123": "+export HF_TOKEN=<masked>",
    "+apiKey: 'k-123456'": "+apiKey: '<masked>'",
    "+db: postgresql://alice:s3cr3t-url@db.example/runs": "+db: postgresql://alice:<masked>@db.example/runs",
    '+  "private_key": "-----BEGIN PRIVATE KEY-----\\nMIIEvQ\\n-----END PRIVATE KEY-----\\n",': (
        '+  "private_key": "-----BEGIN PRIVATE KEY-----<masked>-----END PRIVATE KEY-----\\n",'
    ),
}
KEPT = [
    '+eos_token: "</s>"',
    '+pad_token: "[PAD]"',
    "+max_new_tokens: 256",
    "+tokenizer: bpe-32k",
    "+hub_token: ${oc.env:HF_TOKEN}",
    "+token = os.environ['HF_TOKEN']",
    "+password = getpass.getpass()",
    "+use_auth_token: true",
    "+password: see",  # prose, or a placeholder: too short for a secret
    "+docs: https://example.com/x?y=1",
    "+if token == 'abc123':",
]


@pytest.mark.parametrize("line", MASKED)
def test_a_credential_is_masked_in_its_place_and_counted(line):
    diff, masked = mask(diff_of("project/README.md", line))
    assert diff == diff_of("project/README.md", MASKED[line]) and masked == {"project/README.md": 1}


def test_what_names_a_secrets_place_and_the_tokenizers_tokens_are_left_as_they_are():
    diff = diff_of("project/configs/run.yaml", *KEPT)
    assert mask(diff) == (diff, {})


def test_in_python_a_name_is_no_secret_and_a_string_is():
    code = ["+token: str = 'abcd1234'", "+self.token = token", "+tokenizer.pad_token = tokenizer.eos_token"]
    assert mask(diff_of("project/login.py", *code, "+login(token='hf-secret-1')")) == (
        diff_of("project/login.py", "+token: str = '<masked>'", *code[1:], "+login(token='<masked>')"),
        {"project/login.py": 2},
    )


def test_a_private_keys_block_is_masked_line_by_line_to_its_end_and_only_there():
    begins, ends = "-----BEGIN OPENSSH PRIVATE KEY-----", "-----END OPENSSH PRIVATE KEY-----"
    diff = diff_of(
        "project/notes.md", " before", f"+{begins}", "+b3BlbnNzaC1rZXktdjE", "+AAAAbbbb", f"+{ends}", "+after AAAAbbbb"
    )
    assert mask(diff) == (
        diff_of("project/notes.md", " before", f"+{begins}", f"+{MASK}", f"+{MASK}", f"+{ends}", "+after AAAAbbbb"),
        {"project/notes.md": 2},
    )


def test_the_headers_are_never_masked_and_each_file_is_counted_apart():
    named = "project/token=abcdef123.md"  # a file's name is the diff's own, and `git apply` needs it whole
    first = diff_of(named, "+password: one-1234", "+password: two-1234")
    second = diff_of("project/b.yaml", "-secret: three-1234")
    diff, masked = mask(first + second)
    assert diff.splitlines()[:4] == first.splitlines()[:4] and diff.count("\n") == (first + second).count("\n")
    assert masked == {named: 2, "project/b.yaml": 1} and "1234" not in diff
