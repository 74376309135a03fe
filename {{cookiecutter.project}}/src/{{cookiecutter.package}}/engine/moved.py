"""Where the engine's modules were before it had folders: one table, the old path of each moved
module and its path now, and the two readers of it. A checkpoint saved before the move holds a
config whose `_target_`s name old paths (`<package>.engine.ready.arrow.arrow_folder`): every read
of a checkpoint (checkpoint/schema.py) names them as they are now (`current`), before a resume,
eval.py or export.py checks (targets.py) or builds them. And a project's own files written before
it (run.py's `from <package>.engine import goodput`, a `python -m <package>.engine.ready.shards`
line in configs/): the import system finds each old path as the module now (`Finder`, which the
engine's `__init__` installs), that module itself, never a second copy of it."""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

ENGINE = __name__.rpartition(".")[0]
# Not here: `tracking` and `data`, packages now by their old names, whose `__init__` gives what
# a project's files took from the old modules; and checkpoint.remote, a package too, never
# imported outside the engine.
MOVED = {
    f"{ENGINE}.{old}": f"{ENGINE}.{new}"
    for old, new in {
        "checkpoint.files": "files",
        "checkpoint.remote_url": "checkpoint.remote.url",
        "checkpoint.manifest": "checkpoint.remote.manifest",
        "checkpoint.mirror": "checkpoint.remote.mirror",
        "checkpoint.fetch": "checkpoint.remote.fetch",
        "checkpoint.remote_claim": "checkpoint.remote.claim",
        "checkpoint.remote_run": "checkpoint.remote.run_folder",
        "sender": "tracking.sender",
        "handover": "tracking.sender_pipe",
        "unsent": "tracking.unsent",
        "mlflow_run": "tracking.mlflow_run",
        "mlflow_store": "tracking.mlflow_store",
        "logged_models": "tracking.logged_models",
        "origin": "tracking.origin",
        "masking": "tracking.masking",
        "order": "data.order",
        "streams": "data.streams",
        "workers": "data.workers",
        "ready.arrow": "data.formats.arrow",
        "ready.shards": "data.formats.shards",
        "ready.save_to_disk": "data.formats.save_to_disk",
        "ready.manifest": "data.formats.manifest",
        "hooks": "callbacks.hooks",
        "hold": "callbacks.time_limit",
        "callback_state": "callbacks.state",
        "preemption": "lifecycle.preemption",
        "restarts": "lifecycle.restarts",
        "standby": "lifecycle.standby",
        "goodput": "lifecycle.goodput",
        "divergence": "lifecycle.divergence",
        "evaluation": "validation",
    }.items()
}


def current(name: str) -> str:
    """`name`, a module or a name in one (`<module>.<attribute>`), by its path now."""
    parts = name.split(".")
    for cut in range(len(parts), 2, -1):
        if (module := ".".join(parts[:cut])) in MOVED:
            return ".".join([MOVED[module], *parts[cut:]])
    return name


def current_targets(node: object) -> None:
    """Every `_target_` in `node` (a stored config: dicts and lists) named by its path now, in place."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "_target_" and isinstance(value, str):
                node[key] = current(value)
            else:
                current_targets(value)
    elif isinstance(node, list):
        for value in node:
            current_targets(value)


class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Asked last, after the import system found no module at a path: an old path, found as the
    module now. `python -m <old path>` runs the module now as the program."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # the import system sets this spec on it: put back below
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # it ran when it was imported by its path now

    def get_code(self, name: str) -> object:
        return compile(
            f"import runpy; runpy.run_module({MOVED[name]!r}, run_name='__main__', alter_sys=True)", name, "exec"
        )


def install() -> None:
    if not any(isinstance(finder, Finder) for finder in sys.meta_path):
        sys.meta_path.append(Finder())
