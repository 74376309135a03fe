"""What looks like a credential in a diff, masked before the diff leaves the machine for the tracking
store, where others read it: a changed README or config that gained a token would carry it there.

Line by line, with one search for a few words that most lines fail (a diff of 100,000 lines of code
costs a fraction of a second): a private key's block, the keys and tokens whose form their issuers fixed
(AWS, GitHub, GitLab, Slack, OpenAI-style `sk-`, Hugging Face, Google), the value given to a name
like a password, token, secret or key (`password: ...`, `API_TOKEN=...`, `"client_secret": "..."`),
and the password of a URL (`postgresql://user:...@host`). A value that is a reference, not a literal
(`${oc.env:HF_TOKEN}`, `$TOKEN`, `os.environ["HF_TOKEN"]`, `getpass()`), and the tokenizer's own
(`eos_token: "</s>"`, `max_new_tokens: 256`) stay as they are. It is a net under the untracked files'
allow-list, not a proof: a secret of no known form in a file of no secret-like name passes.
"""

import re

MASK = "<masked>"

# Keys and tokens by the form their issuers give them.
ISSUED = (
    r"\b(?:AKIA|ASIA|ABIA|ACCA)[0-9A-Z]{16}\b",  # AWS access key ids
    r"\bgh[pousr]_[A-Za-z0-9]{36,}\b",  # GitHub
    r"\bgithub_pat_[A-Za-z0-9_]{22,}\b",
    r"\bglpat-[A-Za-z0-9_\-]{20,}\b",  # GitLab
    r"\bxox[abposr]-[A-Za-z0-9\-]{10,}\b",  # Slack
    r"\bsk-[A-Za-z0-9_\-]{20,}\b",  # OpenAI, Anthropic and others'
    r"\bhf_[A-Za-z0-9]{30,}\b",  # Hugging Face
    r"\bAIza[0-9A-Za-z_\-]{35}\b",  # Google
)
KEY_BEGINS = r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----"
KEY_ENDS = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----")
ONE_LINE_KEY = re.compile(rf"({KEY_BEGINS}).*?({KEY_ENDS.pattern})")  # a JSON file's, its line breaks written "\n"
# A name that holds a secret, its end only (`tokenizer`, `max_new_tokens` are no such name), then a
# quote that closes it, a Python annotation (`token: str = `), `:` or `=` (not `==`), and the value:
# quoted, to its closing quote, or bare, to a space, a call's or an index's bracket, or the end of a collection.
ASSIGNED = (
    r"(?i:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|private[_-]?key|credentials?)"
    r"[\"']?\s*(?::\s*[\w.\[\] |]+?\s*(?==))?[:=](?!=)\s*"
    r"(?:(?P<quote>[\"'])(?P<quoted>[^\"'\n]+)|(?P<bare>[^\s\"',()\[\]{}]+))"
)
URL_PASSWORD = r"\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@]+:(?P<password>[^\s/@]+)@"
# What every line that holds one of the above holds, lower-cased: the line's one test, where most end.
# (Python's regular expressions search literals far faster than the patterns above, ignoring case.)
WORDS = re.compile(
    r"pass|pwd|secret|token|api.?key|access.?key|private.?key|credential|://"
    r"|akia|asia|abia|acca|gh[pousr]_|github_pat_|glpat-|xox|sk-|hf_|aiza"
)
# A value that says where the secret is rather than what it is, or the tokenizer's own (`"</s>"`, `"[PAD]"`).
REFERENCE = re.compile(r"[$<{\[]|(?i:true|false|none|null|yes|no)$")
SHORTEST = 4  # characters: a shorter value is a placeholder, or a word of prose (`password: see below`)
CODE = (".py", ".pyi")  # where a value not quoted is a name (`token = args.token`), not a literal


def mask(diff: str) -> tuple[str, dict[str, int]]:
    """`diff` (git's) with what looks like a credential in its changed and context lines replaced by
    MASK, and the number of lines masked in each file it names. Its headers (file names, hunks) are
    left as they are, and so is the number of lines: it still reads as the diff it was."""
    lines = diff.splitlines(keepends=True)
    masked: dict[str, int] = {}
    path, in_hunk, in_key = "", False, False
    for number, line in enumerate(lines):
        if line.startswith("diff --git "):
            path, in_hunk, in_key = line.rstrip("\n").rsplit(" b/", 1)[-1], False, False
        elif line.startswith("@@ "):
            in_hunk = True
        elif in_hunk and (in_key or WORDS.search(line.lower())):
            lines[number], in_key = _masked(line, in_key, path.endswith(CODE))
            if lines[number] != line:
                masked[path] = masked.get(path, 0) + 1
    return "".join(lines), masked


def _masked(line: str, in_key: bool, code: bool) -> tuple[str, bool]:
    """`line`, a diff's line (its first character +, - or space), masked; and whether a private key's
    block goes on past it. `code`: a line of Python."""
    sign, text, end = line[:1], line[1:].rstrip("\n"), line[len(line.rstrip("\n")) :]
    if in_key:
        if not (closed := KEY_ENDS.search(text)):
            return sign + MASK + end, True
        text = (MASK if text[: closed.start()].strip() else "") + text[closed.start() :]
    text = ONE_LINE_KEY.sub(rf"\1{MASK}\2", text)
    if (begun := list(re.finditer(KEY_BEGINS, text))) and not KEY_ENDS.search(text, begun[-1].end()):
        # the block goes on over the lines that follow
        return sign + text[: begun[-1].end()] + (MASK if text[begun[-1].end() :].strip() else "") + end, True
    for pattern in ISSUED:
        text = re.sub(pattern, MASK, text)
    text = re.sub(ASSIGNED, lambda found: _value(found, code), text)
    text = re.sub(URL_PASSWORD, lambda found: _replaced(found, "password"), text)
    return sign + text + end, False


def _value(found: re.Match, code: bool) -> str:
    group = "quoted" if found["quote"] else "bare"
    value, after = found[group], found.string[found.end() : found.end() + 1]
    if (
        MASK in value
        or REFERENCE.match(value)
        or len(value) < SHORTEST
        or (code and group == "bare")  # a name: `token = args.token`
        or after in ("(", "[")  # a call or an index: `token = os.environ["HF_TOKEN"]` in a README's example
    ):
        return found[0]
    return _replaced(found, group)


def _replaced(found: re.Match, group: str) -> str:
    start, end = found.start(group) - found.start(), found.end(group) - found.start()
    return found[0][:start] + MASK + found[0][end:]
