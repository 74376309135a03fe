"""`checkpoint.remote` as typed: a store's folder (`s3://`, `gs://`, `az://`) or a mounted folder's
path, carrying no credential. Credentials come from the store's own environment and provider chain
(`AWS_*` and `~/.aws`, `GOOGLE_APPLICATION_CREDENTIALS`, `AZURE_STORAGE_*`), never from the URL: a
URL that carries one is refused before fsspec sees it (s3fs would take `user:secret@bucket` for a
bucket's name and print it in its errors), and before Hydra writes the command line into
`.hydra/overrides.yaml` (RemoteURLCheck); the refusal does not repeat it.
"""

from typing import Any, NoReturn
from urllib.parse import urlsplit

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ..errors import RunError, reported, shown

# The store's fsspec package, by scheme: what `pip install` needs (the project's `remote` extra has s3fs).
PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
# Where a URL's user part is the store's own (Azure's container@account), not a credential.
NAMED_USER = ("az", "abfs", "abfss")


def checked(url: str) -> str:
    """`url`, once it is a store's folder that carries no credential; else a RunError that names
    what is wrong without repeating the URL's secret part."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if "::" in url:
        problem = "chains filesystems ('::'), which may carry options and credentials"
    elif parts.password is not None:
        problem = "carries a password"
    elif scheme and (parts.query or parts.fragment):
        problem = "carries a query or fragment (a key or a signature, say)"
    elif parts.username is not None and scheme not in NAMED_USER:
        problem = "carries a user (an access key, say)"
    elif scheme in (*PACKAGES, "file", "") or len(scheme) == 1:  # a Windows drive: C:\...
        return url
    else:
        return _refused(f"checkpoint.remote={shown_url(url)} is not a store's folder", "")
    return _refused(f"checkpoint.remote={shown_url(url)} {problem}", " without it")


def _refused(said: str, without: str) -> NoReturn:
    raise RunError(
        f"{said}; give s3://<bucket>/<folder>, gs://..., az://... or a mounted folder's path{without}: credentials "
        f"come from the store's own environment (AWS_ACCESS_KEY_ID or ~/.aws, GOOGLE_APPLICATION_CREDENTIALS, "
        f"AZURE_STORAGE_*)"
    )


def shown_url(url: str) -> str:
    """`url` as a message may print it: its user part (but for Azure's container), password, query
    and fragment dropped, and what follows `::` too."""
    parts = urlsplit(url.split("::")[-1])
    if not parts.scheme or len(parts.scheme) == 1:
        return shown(url.split("::")[-1])
    host = parts.hostname or ""
    if parts.username and parts.scheme.lower() in NAMED_USER and parts.password is None:
        host = f"{parts.username}@{host}"
    return shown(f"{parts.scheme}://{host}{parts.path}")


class RemoteURLCheck(Callback):
    """Hydra's callback (engine.yaml) that refuses, in one line, a `checkpoint.remote` carrying a
    credential, before Hydra writes what was typed into the run's `.hydra/` or a sweep's
    `multirun.yaml`: each value a sweep lists, and the composed one (an interpolation resolved)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        reported(lambda: _check(config))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        reported(lambda: _check(config))


def _check(config: DictConfig) -> None:
    typed = []
    for override in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
        if override.key_or_group == "checkpoint.remote" and not override.is_delete():
            value = override.value()
            typed += value.list if isinstance(value, ChoiceSweep) else [value]
    for url in [*typed, config.checkpoint.get("remote")]:
        if url is not None:
            checked(str(url))
