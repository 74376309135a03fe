"""A remote checkpoint's manifest, `committed/step_00001200.json`: written after every object of the
checkpoint is whole in the store, so that it is what makes the checkpoint visible. A set of objects
is never atomic (a folder of shards, a file beside its ranking): a kill -9 mid-upload leaves objects
without a manifest, which no resume picks and no retention deletes.

It names the checkpoint's files with their sizes, and its seal (onefile.seal: of the file, or of a
folder's state.pt, which holds its shards' checksums), so that a download is known to be the
checkpoint that was uploaded, byte for byte, by the checks any checkpoint passes (resume.load). It
comes from elsewhere, and is read as data: small, of exact keys and types, naming files inside the
checkpoint only.
"""

import json
import re
import time
from pathlib import Path

from .. import onefile
from ..home import NAME, step_of
from ..schema import STATE

FORMAT = 1
FOLDER = "committed"
MOST_BYTES = 2**20  # a manifest of 10,000 shard files is about 400 kB
MOST_FILES = 100_000
# A file of a folder checkpoint: one level, DCP's names (`__0_0.distcp`, `.metadata`) and state.pt.
FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*|\.[A-Za-z0-9_][A-Za-z0-9_.-]*")
SEAL = re.compile(r"crc32c:[0-9a-f]{8}")
KEYS = {"format", "run", "step", "kind", "seal", "files", "leg", "written"}


def key_of(step: int) -> str:
    return f"{FOLDER}/step_{step:08d}.json"


def build(path: Path, run: str, leg: str) -> dict:
    """The manifest of the checkpoint `path` (a file, or a folder of shards) in this run's home."""
    folder = path.is_dir()
    files = (
        {found.name: found.stat().st_size for found in path.iterdir()} if folder else {path.name: path.stat().st_size}
    )
    return {
        "format": FORMAT,
        "run": run,
        "step": step_of(path),
        "kind": "folder" if folder else "file",
        "seal": onefile.seal(path / STATE if folder else path),
        "files": files,
        "leg": leg,
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def name_of(manifest: dict) -> str:
    """The checkpoint's name in a home: `step_00001200.pt`, or the folder `step_00001200`."""
    return f"step_{manifest['step']:08d}" + ("" if manifest["kind"] == "folder" else ".pt")


def objects(manifest: dict) -> dict[str, int]:
    """The checkpoint's objects, by keys relative to the run's folder, with their sizes."""
    if manifest["kind"] == "file":
        return dict(manifest["files"])
    return {f"{name_of(manifest)}/{name}": size for name, size in manifest["files"].items()}


def parse(data: bytes, run: str, step: int) -> dict | str:
    """The manifest in `data`, if it is one this module writes for the checkpoint of `step` of `run`;
    else what is wrong with it, in words."""
    if len(data) > MOST_BYTES:
        return f"is larger than {MOST_BYTES} bytes"
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError):
        return "is not JSON"
    if not (isinstance(manifest, dict) and set(manifest) == KEYS and manifest["format"] == FORMAT):
        return "is not a manifest this project writes"
    files, kind = manifest["files"], manifest["kind"]
    if not (
        manifest["run"] == run
        and type(manifest["step"]) is int
        and manifest["step"] == step
        and kind in ("file", "folder")
        and isinstance(manifest["seal"], str)
        and SEAL.fullmatch(manifest["seal"])
        and isinstance(manifest["leg"], str)
        and isinstance(manifest["written"], str)
        and isinstance(files, dict)
        and 0 < len(files) <= MOST_FILES
        and all(type(size) is int and size >= 0 for size in files.values())
    ):
        return f"is not the manifest of step {step} of {run!r}"
    names_ok = (
        set(files) == {name_of(manifest)} if kind == "file" else STATE in files and all(map(FILE.fullmatch, files))
    )
    if not names_ok or not NAME.fullmatch(name_of(manifest)):
        return "names files outside its checkpoint"
    return manifest


def committed(store, run: str) -> dict[int, dict | str]:
    """The manifests of `run` in `store` (a remote.Store), by step: each parsed, or what is wrong
    with it. Objects in `committed/` of other names are not manifests of this project's."""
    found = {}
    for key in store.list(f"{run}/{FOLDER}"):
        if (match := re.fullmatch(r"step_(\d{8,})\.json", key)) is None:
            continue
        step = int(match[1])
        try:
            found[step] = parse(store.get_bytes(f"{run}/{FOLDER}/{key}"), run, step)
        except FileNotFoundError:  # deleted since the listing: by a retention of this run
            continue
    return found
