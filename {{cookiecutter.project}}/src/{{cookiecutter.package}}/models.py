"""Your models: each a class, an `nn.Module`, and a file in configs/model/ that names it with
`_target_` (docs/your-code.md says what its constructor gets).

MLP, CNN and GPT are the engine's ready ones (engine/ready/models.py), which the template maintains;
imported here, they keep the names that configs/ and your checkpoints give them
(`{{cookiecutter.package}}.models.MLP`). Subclass one, or write your own below: this file is yours,
and an update of the template never writes it.
"""

from .engine.ready.models import CNN, GPT, MLP

__all__ = ["CNN", "GPT", "MLP"]
