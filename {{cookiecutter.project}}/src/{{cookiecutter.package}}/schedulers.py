"""Your learning-rate schedules, the components of the `scheduler` group: each a function of the
optimizer and its settings that returns a schedule, a pure function of the step (so that a resume
recomputes it), and a file in configs/scheduler/ that names it with `_target_`. Optimizers need no
code: configs/optimizer/ names torch's own.

constant and cosine are the engine's ready ones (engine/ready/schedulers.py), which the template
maintains; imported here, they keep the names that configs/ and your checkpoints give them
(`{{cookiecutter.package}}.schedulers.cosine`). Write your own below: this file is yours, and an
update of the template never writes it.
"""

from .engine.ready.schedulers import constant, cosine

__all__ = ["constant", "cosine"]
