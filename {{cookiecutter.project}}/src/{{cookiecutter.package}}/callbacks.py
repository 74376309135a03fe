"""Your callbacks: each a class with any of the hooks (docs/callbacks.md), and a file in
configs/callbacks/ that names it with `_target_`; what a hook gets is the run's public side
(`run.predictions()`, `run.autocast()`, `run.log_figure(...)`), never the engine's internals.

ConfusionMatrix and TextSample are the engine's ready ones (engine/ready/callbacks.py), which the
template maintains; imported here, they keep the names that configs/ and your checkpoints give them
(`{{cookiecutter.package}}.callbacks.ConfusionMatrix`). Subclass one, or write your own below: this
file is yours, and an update of the template never writes it.
"""

from .engine.ready.callbacks import ConfusionMatrix, TextSample

__all__ = ["ConfusionMatrix", "TextSample"]
