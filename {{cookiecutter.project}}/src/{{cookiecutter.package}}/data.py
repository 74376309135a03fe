"""`{{cookiecutter.package}}.data` before the engine had a folder of its own: a data component
written then imports `Data` from here, and this module keeps it working, with a warning that names
the new path, for one release. The template deletes it in the next."""

import warnings

from .engine.data import Data

__all__ = ["Data"]

warnings.warn(
    "{{cookiecutter.package}}.data is {{cookiecutter.package}}.engine.data now: import Data from there; {{cookiecutter.package}}.data goes in the next release",
    FutureWarning,
    stacklevel=2,
)
