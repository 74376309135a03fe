"""`checkpoint.remote` as typed: a store's folder (`s3://`, `gs://`, `az://`) or a mounted folder's
path (or `file:///<path>`), carrying no credential. Credentials come from the store's own
environment and provider chain (`AWS_*` and `~/.aws`, `GOOGLE_APPLICATION_CREDENTIALS`,
`AZURE_STORAGE_*`), never from the URL: a URL that carries one is refused before fsspec sees it
(s3fs would take `user:secret@bucket` for a bucket's name and print it in its errors), and before
Hydra prints or writes it down: the command line is read before Hydra parses it (`refuse_typed`,
first in run.py, eval.py and export.py: Hydra prints an override it cannot parse whole), and what
a sweep lists in its configs (`hydra.sweeper.params`) or in the options it chooses before the
launcher prints each job's overrides and writes `multirun.yaml` or a job's .hydra/ (RemoteURLCheck). A refusal repeats none of the URL but a
store's scheme: where a URL carries a secret, no rule can say where the secret ends (an AWS secret
key holds `/` and `+`).
"""

import re
import unicodedata
from collections.abc import Iterable, Iterator
from typing import Any, NoReturn
from urllib.parse import urlsplit

from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ...errors import RunError, reported

KEY = "checkpoint.remote"
# The store's fsspec package, by scheme: what `pip install` needs (the project's `remote` extra has s3fs).
PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs", "abfss": "adlfs"}
# Where a URL's user part is the store's own (Azure's container@account), not a credential.
NAMED_USER = ("az", "abfs", "abfss")
LOCAL_HOSTS = ("", "localhost")  # what a file:// URL may name before its path
HOST = "names a host, which a path or a file:// URL cannot reach (file:///<path> or the path is a mounted folder's)"


def checked(url: str) -> str:
    """`url`, once it is a store's folder or a mounted folder's path that carries no credential;
    else a RunError that names what is wrong and repeats none of `url` but a store's scheme."""
    scheme = urlsplit(url).scheme.lower()  # ASCII letters only: `ｓ3://` (a fullwidth s) has none
    rest = url[len(scheme) + 1 :] if scheme else ""  # after `<scheme>:`
    host = rest[2:].split("/", 1)[0] if rest.startswith("//") else ""
    # Where a credential would be: the host part, all that fsspec reads one from (a path may hold ':'
    # and '@': a time, an address); without `//`, no host part is told from the path: all of it.
    login = host if rest.startswith("//") else rest
    said = f"{scheme}://..." if scheme and rest.startswith("//") else "..."
    path = urlsplit(url).path if scheme == "file" else url  # the folder a path or a file: URL names
    normal = unicodedata.normalize("NFKC", url)  # a look-alike letter as the letter it looks like: `ｓ` as `s`
    if "::" in url:
        problem = "chains filesystems ('::'), which may carry options and credentials"
    elif ("://" in normal and not (scheme and rest.startswith("//"))) or (urlsplit(normal).scheme and not scheme):
        return _refused(said, "has a scheme that is no store's (a look-alike letter, as a fullwidth 'ｓ'?)")
    elif re.match(r"[/\\]{2}[^/\\]", path):  # a share's //host/: Linux reads `/...` (`\\host\`: a relative folder)
        return _refused(said, HOST)
    elif not scheme or (len(scheme) == 1 and not rest.startswith("//")):  # a path; or a Windows drive's, C:\...
        return url
    elif scheme not in (*PACKAGES, "file"):
        return _refused(said, "is not a store's folder")
    elif "?" in rest or "#" in rest:
        problem = "carries a query or fragment (a key or a signature, say)"
    elif scheme == "file" and host.lower() not in LOCAL_HOSTS:
        return _refused(said, HOST)
    elif scheme == "file" and not path.startswith("/"):  # `file:runs`: a folder under the working one
        return _refused(said, "names no absolute path (file:///<path> is a mounted folder's)")
    elif scheme in PACKAGES and ":" in login:
        problem = "carries a password"
    elif scheme in PACKAGES and "@" in login and not (scheme in NAMED_USER and login.count("@") == 1):
        problem = "carries a user (an access key, say)"
    else:
        return url
    return _refused(said, problem, " without it")


def _refused(said: str, problem: str, without: str = "") -> NoReturn:
    raise RunError(
        f"{KEY}={said} {problem}; give s3://<bucket>/<folder>, gs://..., az://... or a mounted folder's path{without}: "
        f"credentials come from the store's own environment (AWS_ACCESS_KEY_ID or ~/.aws, "
        f"GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*)"
    )


def refuse_typed(argv: list[str]) -> None:
    """Exits 2 with one line where the command line `argv` gives `checkpoint.remote` a value (or a
    sweep's) that `checked` refuses; before Hydra, which prints the whole of an override it cannot
    parse (`s3://...#<secret>` unquoted), and which `--cfg job` prints back."""
    reported(lambda: _each_checked(_given(argv[1:])))


class RemoteURLCheck(Callback):
    """Hydra's callback (engine.yaml) that refuses, in one line, a `checkpoint.remote` carrying a
    credential before Hydra prints or writes it: each value a sweep lists on the command line or
    in `hydra.sweeper.params` (the launcher prints each job's, and `multirun.yaml`, `hydra.yaml`
    hold them), the composed one (an interpolation resolved), and each one an option the sweep
    chooses sets or lists (its job's .hydra/ holds it)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        reported(lambda: _each_checked(_configured(config)))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        reported(lambda: _each_checked(_swept(config)))


def _each_checked(urls: Iterable[str]) -> None:
    for url in urls:
        checked(url)


SWEPT = "hydra.sweeper.params"  # where a sweep's values may be typed too, read by the sweeper


def _overrides(config: DictConfig) -> list[str]:
    """What `config`'s command line overrides, and what its sweeper's params list, as Hydra's
    sweepers read them (`key: <override's value>`)."""
    params = OmegaConf.select(config, SWEPT) or {}
    return [*config.hydra.overrides.task, *(f"{key}={value}" for key, value in params.items())]


def _configured(config: DictConfig) -> Iterator[str]:
    """The values of `checkpoint.remote` in `config`: those its command line gives, those its
    sweeper's params list, the composed one."""
    yield from _given(_overrides(config))
    try:
        url = config.checkpoint.get("remote")
    except OmegaConfBaseException:  # an interpolation that does not resolve (`${oc.env:...}` unset): the job says so
        return
    if url is not None:
        yield str(url)


def _swept(config: DictConfig) -> Iterator[str]:
    """The values of `checkpoint.remote` in a sweep's `config` (`_configured`), and in the config of
    each option the sweep chooses for a config group (`experiment=a,b`, `checkpoint=default,keyed`,
    typed or the sweeper's param), composed as its job's will be: each job writes its own config to
    its .hydra/ before it starts, and an option's file may set `checkpoint.remote` or list a sweep."""
    yield from _configured(config)
    loader = GlobalHydra.instance().config_loader()
    try:
        overrides = OverridesParser.create(config_loader=loader).parse_overrides(_overrides(config))
    except HydraException:
        return  # the sweeper says what it cannot parse, a checkpoint.remote refused above
    fixed = [override.input_line for override in overrides if not override.is_sweep_override()]
    for override in overrides:
        if not (override.is_discrete_sweep() and loader.get_group_options(override.key_or_group)):
            continue
        for option in override.sweep_string_iterator():
            job = f"{override.get_key_element()}={option}"
            try:
                chosen = loader.load_sweep_config(config, [*fixed, job])
            except (HydraException, OmegaConfBaseException):
                continue  # an option that does not compose: its job says so
            yield from _configured(chosen)


def _given(overrides: Iterable[str]) -> Iterator[str]:
    """The values that `overrides` give `checkpoint.remote`, as Hydra parses them (each of a
    sweep's, typed as the setting or as the sweeper's param); where Hydra cannot parse one, the
    whole text after its `=`, judged as one."""
    for override in overrides:
        key = _key(override.partition("=")[0])
        if key not in (KEY, f"{SWEPT}.{KEY}", SWEPT):
            continue
        try:
            parsed = OverridesParser.create().parse_override(override)
        except HydraException:
            yield override.partition("=")[2]
            continue
        value = parsed.value()  # a deletion's too: `.hydra/overrides.yaml` holds it
        if key == SWEPT:  # the sweeper's params typed whole: `hydra.sweeper.params={checkpoint.remote: ...}`
            value = {name: each for name, each in value.items() if _key(name) == KEY} if isinstance(value, dict) else []
        yield from _strings(value)


def _key(typed: str) -> str:
    """The setting an override's key names, as Hydra may read it: `+`, `++` and `~` before it, a
    package after `@` (`checkpoint.remote@_global_`) and `/` for `.` (`checkpoint/remote`) left out."""
    return typed.lstrip("+~").partition("@")[0].replace("/", ".")


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, ChoiceSweep):
        value = value.list
    if isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, str):
        yield value
