"""Your tasks: what a batch holds for the model, and how its outputs become the loss and the
metrics' inputs; each a class that a file in configs/task/ names with `_target_` (docs/your-code.md
says what the recipe asks of it).

Supervised and NextToken are the engine's ready ones (engine/ready/tasks.py), which the template
maintains; imported here, they keep the names that configs/ and your checkpoints give them
(`{{cookiecutter.package}}.tasks.Supervised`). Subclass one, or write your own below: this file is
yours, and an update of the template never writes it.
"""

from .engine.ready.tasks import NextToken, Supervised

__all__ = ["NextToken", "Supervised"]
