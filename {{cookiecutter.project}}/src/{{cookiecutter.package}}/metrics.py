"""Your metrics, the components of the `metrics` group: each an object with torchmetrics'
interface (`update(outputs, targets)`, `compute()` giving one number, `reset()`, `.to(device)`, a
call giving one batch's value), and an entry of a file in configs/metrics/ that names it with
`_target_`, logged as `val/<name>`. torchmetrics' own need no code here: name them there
(`_target_: torchmetrics.R2Score`).

Accuracy and Perplexity are the engine's ready ones (engine/ready/metrics.py), which the template
maintains; imported here, they keep the names that configs/ and your checkpoints give them
(`{{cookiecutter.package}}.metrics.Accuracy`). Subclass one, or write your own below: this file is
yours, and an update of the template never writes it.
"""

from .engine.ready.metrics import Accuracy, Perplexity

__all__ = ["Accuracy", "Perplexity"]
