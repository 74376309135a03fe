"""Every command block of both READMEs runs, in the order shown, as a new user would type it: the
template's README in a copy of the checkout (its quick start bakes there, then `make demo`), the
generated one in a fresh bake, followed there by each of its docs/ pages in the order the README
links them (a page's lines use the runs that the README and the pages before it trained). A line
that stops working fails this test, so the READMEs and the pages cannot drift from the code.

What this machine cannot do as written is adapted by the rules in REWRITES (no network, no GPU,
2 cores, seconds instead of minutes), and a line that cannot run here at all is listed in SKIPPED
with the reason and the test that covers it instead. Every other line runs as written. In either
chain, a foreground `python` or `torchrun` line is forked by the bake's warm parent (its
tests/warm_parent.py) once the project is installed: the imports are paid once a chain, not once a
line (WarmChain).
"""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[1]

VENV_BIN = Path(sys.executable).parent
# Steps run here are the README's divided by this, so a block takes seconds, not minutes.
SCALE = 20
DEFAULT_MAX_STEPS = 300  # configs/config.yaml's trainer.max_steps

# (pattern, replacement, why): applied in order to every line that runs.
REWRITES: list[tuple[str, str, str]] = [
    # The test's venv already holds torch and every dependency; the project goes into it.
    (r"python3 -m venv \.venv && (\. \.venv/bin/activate)?( && )?", "", "venv exists"),
    (
        r"(\.venv/bin/)?pip install torch(==[\d.]+)? && (\.venv/bin/)?pip install -e '\.\[dev\]'",
        "pip install -q --no-deps --no-build-isolation -e .",
        "dependencies installed, no network",
    ),
    (r"\S*\.venv/bin/", "", "the test's venv is first on PATH"),
    (r"device=(cuda|xpu)\b", "device=cpu", "no GPU here"),
    (r"--nproc-per-node=\d+", "--nproc-per-node=2", "2 cores here"),
    (r"hydra\.sweeper\.n_trials=\d+", "hydra.sweeper.n_trials=2", "seconds, not minutes"),
    (r"\bmake demo\b", f"make demo VENV={VENV_BIN.parent}", "the test's venv, set up"),
]

# Substrings of lines that cannot run here, with why and what covers them instead.
SKIPPED = {
    "make test": "this test runs inside it",
    "hydra/launcher=slurm": "needs a SLURM cluster: the bake's tests/test_slurm.py runs this line on one it starts",
    "tracking replay": "needs an outage's leftover file; the bake's test_tracking replays one",
    "--nnodes=2": "needs two nodes: the bake's test_distributed runs this form with two torchruns on one machine",
    "cruft": "needs a newer template commit: tests/test_update.py runs check, create and update on a bake",
    "git init": "the project as its own repository: tests/test_update.py commits a bake before cruft update",
}


# The generated README is the first screen of the project: what it is and the commands of every
# day; the rest is in docs/, a page a topic, each linked from it.
README_LINES = 250
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A row of the README's table of pages: `| [Title](docs/<page>.md) | what it holds |`.
PAGE_ROW = re.compile(r"^\| \[[^]]+\]\((docs/[^)#]+\.md)\) \|", flags=re.MULTILINE)


def linked_pages(readme: str) -> list[str]:
    """The docs/ pages of the README's table, in its order: a reader's, in which a page may use the
    runs that the README and the pages before it trained."""
    return PAGE_ROW.findall(readme)


def command_blocks(readme: str) -> list[list[str]]:
    """A README's ```bash blocks in order, each as its lines: continuations joined, comments
    dropped."""
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, flags=re.DOTALL | re.MULTILINE)
    return [
        [line for line in map(uncommented, block.replace("\\\n", " ").splitlines()) if line]
        for block in blocks
    ]


def uncommented(line: str) -> str:
    return re.sub(r"(^|\s+)#.*", "", line).strip()


def scaled(line: str) -> str:
    """The line with every step count divided by SCALE, the default one too when it trains."""
    line = re.sub(
        r"\b(trainer\.max_steps|scheduler\.total_steps)=(\d+)",
        lambda m: f"{m[1]}={int(m[2]) // SCALE}",
        line,
    )
    if re.search(r"\brun\.py\b", line) and "trainer.max_steps=" not in line:
        line += f" trainer.max_steps={DEFAULT_MAX_STEPS // SCALE}"
    return line


def adapted(line: str) -> str:
    for pattern, replacement, _why in REWRITES:
        line = re.sub(pattern, replacement, line)
    return scaled(line)


class WarmChain:
    """The bake's warm parent for a chain's lines, started once a block has installed the project
    (`pip install`): a line before then, or with none, starts a new interpreter."""

    def __init__(self) -> None:
        self.client: Path | None = None
        self.parent = None

    def env(self) -> dict[str, str]:
        if self.parent is None:
            return {}
        return {"WARM_PARENT": str(self.client), "WARM_SOCKET": self.parent.path}

    def installed(self, project: Path) -> None:
        if self.parent is None:
            self.client = project / "tests" / "warm_parent.py"
            spec = importlib.util.spec_from_file_location("bakes_warm_parent", self.client)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self.parent = module.WarmParent()

    def stop(self) -> None:
        if self.parent is not None:
            self.parent.stop()


# `python` and `torchrun` in a chain: a foreground line goes to the warm parent (its client runs
# anything the warm parent does not start as a new interpreter); a line in a subshell (`&`, whose
# `$!` a README reads, a pipe, `$(...)`) is the new interpreter itself, as the shell would start it.
WARM_LINES = r"""
python() {
  if [ "$BASHPID" != "$$" ]; then exec python "$@"; fi
  if [ -z "${WARM_SOCKET-}" ]; then command python "$@"; return; fi
  command python "$WARM_PARENT" --client "$WARM_SOCKET" "$@"
}
torchrun() {
  if [ "$BASHPID" != "$$" ] || [ -z "${WARM_SOCKET-}" ]; then command torchrun "$@"; return; fi
  python -m torch.distributed.run "$@"
}
"""


def run_readme(
    readme: str, cwd: Path, source: str = "README.md", warm: WarmChain | None = None
) -> list[str]:
    """Run each block of the README (or docs page) in a shell of its own that starts in `cwd`
    (where its reader stands), so `cd` and `&&` mean what they say; return the lines that ran, as
    adapted. With `warm`, a block that installs the project goes on after its install line in a
    second shell, where the first one stood, its lines forked by the project's warm parent."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_TRACKING_URI", None)
    ran = []
    for block in command_blocks(readme):
        lines = [adapted(line) for line in block if not any(skip in line for skip in SKIPPED)]
        lines = [line for line in lines if line]  # a set-up step done here already leaves nothing
        ran += lines
        installs = [number for number, line in enumerate(lines) if "pip install" in line]
        parts = [lines]
        if warm is not None and installs:
            parts = [lines[: installs[-1] + 1], lines[installs[-1] + 1 :]]
        where = cwd
        for number, part in enumerate(parts):
            if number == 1:
                warm.installed(where)
            where = run_lines(part, where, env | (warm.env() if warm else {}), source)
    return ran


def run_lines(lines: list[str], cwd: Path, env: dict[str, str], source: str) -> Path:
    """Run `lines` in one shell that starts in `cwd`; return the folder it ended in."""
    with tempfile.TemporaryDirectory() as told:
        ended = Path(told, "pwd")
        script = ["set -euo pipefail", SERVER_CHECK, WARM_LINES]
        for line in lines:
            script += [f"echo {shlex.quote('$ ' + line)}", line]
        script.append(f'echo "$PWD" >{shlex.quote(str(ended))}')
        result = subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=cwd,
            env=env,
            input="\n" * 50,  # Enter at each of cookiecutter's questions: the defaults
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        assert result.returncode == 0, f"{source}:\n{result.stdout}\n{result.stderr}"
        return Path(ended.read_text().strip())


# `mlflow ui` serves until stopped: here it is started on a port of the kernel's choosing (port 0:
# no clash with another server on this machine), with one worker and no job runner (the page needs
# neither; each of the four default workers would import MLflow's server on two busy cores), asked
# for the page a user opens, and stopped with its own process group. Every wait is for the server:
# for the line that says where it listens, then (in one interpreter) for the page, asked again while
# the port refuses or a taken connection goes unanswered; the server's end or 600 s of refusals end
# it, with the server's log. A shell function, so that the README's line runs as written.
SERVER_CHECK = r"""
PROBE='
import os, sys, time, urllib.error, urllib.request
server, url, bound = int(sys.argv[1]), sys.argv[2], time.monotonic() + 600
while True:
    try:
        urllib.request.urlopen(url, timeout=60)
        break
    except urllib.error.HTTPError:
        raise
    except OSError as refused:
        os.kill(server, 0)  # ProcessLookupError once the server has ended
        if time.monotonic() > bound:
            sys.exit(f"{url} still refuses after 600 s: {refused}")
        time.sleep(0.2)
'
mlflow() {
  if [ "$1" != ui ]; then command mlflow "$@"; return; fi
  local log server url= answer=0
  log=$(mktemp)  # made here, empty: the server's line is never read from an earlier server's log
  MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false \
    setsid mlflow "$@" --port 0 --workers 1 >"$log" 2>&1 &
  server=$!
  until url=$(grep -o 'Uvicorn running on http://[0-9.]*:[0-9]*' "$log" | grep -o 'http://.*'); do
    kill -0 $server 2>/dev/null || { cat "$log"; return 1; }
    sleep 0.1
  done
  command python -c "$PROBE" $server "$url/" || answer=$?
  kill -- -$server; wait $server || true
  [ $answer = 0 ] || { cat "$log"; return 1; }
  rm -f "$log"
}
"""


@pytest.mark.slow
def test_the_template_readme_runs_in_order_in_a_copy_of_the_checkout(tmp_path: Path) -> None:
    # A copy of the checkout, where its reader stands: make demo writes demo/ beside the Makefile.
    checkout = tmp_path / "continuum"
    shutil.copytree(TEMPLATE, checkout, ignore=shutil.ignore_patterns(".venv", ".git", "demo"))
    warm = WarmChain()
    try:
        ran = run_readme((TEMPLATE / "README.md").read_text(), checkout, warm=warm)
    finally:
        warm.stop()
    assert any(line.startswith("cookiecutter") for line in ran)
    assert (checkout / "my-trainer" / "mlflow.db").exists()
    assert (checkout / "demo" / "my-trainer" / "checkpoints" / "demo" / "latest").exists()


@pytest.mark.slow
def test_the_generated_readme_and_its_docs_run_in_order_in_a_fresh_bake(
    bake: Callable[..., Path], tmp_path: Path
) -> None:
    """Its `pytest` block is the bake's daily tier on the stock defaults, which the end-to-end test,
    on a team's own defaults, does not run."""
    project = bake(tmp_path)
    readme = (project / "README.md").read_text()
    warm = WarmChain()
    try:
        ran = run_readme(readme, project, warm=warm)
        for page in linked_pages(readme):
            ran += run_readme((project / page).read_text(), project, page, warm)
    finally:
        warm.stop()
    assert any("strategy=fsdp" in line for line in ran)
    assert any("hydra/sweeper=search" in line for line in ran)


def test_every_readme_line_is_run_or_skipped_for_a_stated_reason(
    bake: Callable[..., Path], tmp_path: Path
) -> None:
    project = bake(tmp_path)
    readmes = (TEMPLATE / "README.md", project / "README.md", *sorted(project.glob("docs/*.md")))
    lines = [
        line for readme in readmes for block in command_blocks(readme.read_text()) for line in block
    ]
    assert len(lines) > 20
    for skip, why in SKIPPED.items():
        assert any(skip in line for line in lines), f"SKIPPED[{skip!r}] ({why}) matches no line"
    for pattern, _, why in REWRITES:
        assert any(re.search(pattern, line) for line in lines), f"{pattern!r} ({why}) is unused"


def test_the_generated_readme_is_short_and_links_each_docs_page_whose_links_all_resolve(
    bake: Callable[..., Path], tmp_path: Path
) -> None:
    project = bake(tmp_path)
    readme = (project / "README.md").read_text()
    lines = len(readme.splitlines())
    assert lines <= README_LINES, (
        f"README.md has {lines} lines: give a topic a docs/ page of its own"
    )
    pages = sorted(path.relative_to(project).as_posix() for path in project.glob("docs/*.md"))
    assert sorted(linked_pages(readme)) == pages, "each docs/ page is one row of the README's table"
    for document in ["README.md", *pages]:
        for target in LINK.findall(prose((project / document).read_text())):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (project / document).parent / path if path else project / document
            assert linked.is_file(), f"{document} links {target}: no file {path}"
            if anchor:
                headings = anchors(linked.read_text())
                assert anchor in headings, f"{document} links {target}: no such heading"


def prose(markdown: str) -> str:
    """A page without its code blocks, whose `#` and `](` are code."""
    return re.sub(r"^ *```.*?^ *```", "", markdown, flags=re.DOTALL | re.MULTILINE)


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, spaces as hyphens, other
    punctuation dropped."""
    headings = re.findall(r"^#+ (.*)$", prose(markdown), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}
