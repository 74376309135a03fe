"""Your data: each a function (or class) that returns `Data(train, val, **facts)` (from
`.engine.data`, with `read_file` for the files it reads), and a file in configs/data/ that names it
with `_target_` (docs/your-code.md says what the facts are for).

digits, python_source and text_folder are the engine's ready ones (engine/ready/datasets.py), which
the template maintains; imported here, they keep the names that configs/ and your checkpoints give
them (`{{cookiecutter.package}}.datasets.digits`). Build on one, or write your own below: this file
is yours, and an update of the template never writes it.
"""

from .engine.ready.datasets import digits, python_source, text_folder

__all__ = ["digits", "python_source", "text_folder"]
