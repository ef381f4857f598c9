"""Credentials in plans: what counts as one, how it is hidden, and where it is resolved.

A plan reaches storage through ``storage_options`` (per source, for the tokenizer file and the
checkpoint). Two kinds of values there are **credentials**:

- the value of a key whose name says it is one: a word of the name (split at ``_``, ``-``,
  ``.`` and camelCase) is one of :data:`CREDENTIAL_WORDS` (``key``, ``secret``, ``token``,
  ``password``...), at any depth (``client_kwargs: {aws_secret_access_key: ...}``);
- any value given as an environment reference, ``${env:NAME}``, whatever its key.

A reference is resolved only where storage is opened (:func:`resolve`: on the workers for the
sources and the tokenizer, on the scheduler for the checkpoint), so the plan file, the plan
sent to the scheduler and every copy of it carry the reference, never the value. Without any
credential in the plan, fsspec's own configuration applies (``AWS_*`` variables, ``~/.aws``,
instance roles...). A password inside a URL (``scheme://user:password@host/...``) is one too.

Every output shows :func:`redact`'s form: credential values as ``***``, references as written::

    redact({"storage_options": {"key": "AKIA...", "secret": "${env:S3_SECRET}",
                                "endpoint_url": "http://s3:9000"}})
    -> {"storage_options": {"key": "***", "secret": "${env:S3_SECRET}",
                            "endpoint_url": "http://s3:9000"}}

:func:`without_credentials` drops them instead (what a stream fingerprint hashes: changing a
key or moving it to the environment never changes the stream). :class:`StorageOptions` is the
mapping the specs hold: its ``repr`` is redacted, so a spec in a log line or in Dask's report
of a failed task shows no credential. :func:`scrub` takes known credential values out of free
text (error messages that came back from storage libraries).
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from omniload_dask.errors import PlanError

__all__ = [
    "CREDENTIAL_WORDS",
    "REDACTED",
    "StorageOptions",
    "is_credential_key",
    "is_reference",
    "redact",
    "redact_url",
    "resolve",
    "scrub",
    "secret_values",
    "without_credentials",
]

REDACTED = "***"
CREDENTIAL_WORDS = frozenset(
    {
        "auth",
        "authorization",
        "cookie",
        "credential",
        "credentials",
        "key",
        "passphrase",
        "passwd",
        "password",
        "private",
        "pwd",
        "sas",
        "secret",
        "signature",
        "ticket",
        "token",
    }
)
OPTIONS_FIELD = "storage_options"
MIN_SCRUB = 4  # shorter known values are not scrubbed from text (they would match anything)

_REFERENCE = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")
_WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:)(?P<pw>[^/@\s]+)@")


def is_credential_key(name: object) -> bool:
    """Whether an option called ``name`` holds a credential (by the words of its name)."""
    words = _WORD.findall(str(name))
    return any(w.lower() in CREDENTIAL_WORDS for w in words)


def is_reference(value: object) -> bool:
    """Whether ``value`` is an environment reference, ``${env:NAME}``."""
    return isinstance(value, str) and _REFERENCE.match(value) is not None


def redact_url(text: str) -> str:
    """``text`` with the password of any ``scheme://user:password@`` replaced by ``***``."""
    return _URL_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}@", text)


def _redact_options(value: Any, secret: bool) -> Any:
    if isinstance(value, Mapping):
        return {k: _redact_options(v, secret or is_credential_key(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_options(v, secret) for v in value]
    if is_reference(value):
        return value
    if secret and value is not None and not isinstance(value, bool):
        return REDACTED
    return redact_url(value) if isinstance(value, str) else value


def _strip_options(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {
            k: _strip_options(v)
            for k, v in value.items()
            if not is_credential_key(k) and not is_reference(v)
        }
    if isinstance(value, (list, tuple)):
        return [_strip_options(v) for v in value if not is_reference(v)]
    return redact_url(value) if isinstance(value, str) else value


def _walk(data: Any, options: Any) -> Any:
    """``data`` with every ``storage_options`` mapping in it passed through ``options`` and
    every other string's URL passwords redacted."""
    if isinstance(data, Mapping):
        return {
            k: options(v) if k == OPTIONS_FIELD and isinstance(v, Mapping) else _walk(v, options)
            for k, v in data.items()
        }
    if isinstance(data, (list, tuple)):
        return [_walk(v, options) for v in data]
    return redact_url(data) if isinstance(data, str) else data


def redact(data: Any) -> Any:
    """A copy of ``data`` (plan data, a state, figures) fit to show or store: credential
    values ``***``, references as written, URL passwords ``***``."""
    return _walk(data, lambda opts: _redact_options(opts, False))


def without_credentials(data: Any) -> Any:
    """A copy of ``data`` with credentials and references left out (for fingerprints)."""
    return _walk(data, _strip_options)


def resolve(options: Mapping[str, Any], field: str = OPTIONS_FIELD) -> dict[str, Any]:
    """``options`` with every ``${env:NAME}`` replaced by the variable's value, here.

    A PlanError names the field and the variable (never a value) if it is not set.
    """

    def one(value: Any, at: str) -> Any:
        if isinstance(value, Mapping):
            return {k: one(v, f"{at}.{k}") for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [one(v, f"{at}[{i}]") for i, v in enumerate(value)]
        if is_reference(value):
            name = _REFERENCE.match(value)[1]  # type: ignore[index]
            if name not in os.environ:
                raise PlanError(
                    f"{at}: environment variable {name} is not set on this machine "
                    f"({platform.node()}); set it where the data is read"
                )
            return os.environ[name]
        return value

    return {k: one(v, f"{field}.{k}") for k, v in options.items()}


def secret_values(options: Iterable[Mapping[str, Any]]) -> set[str]:
    """The credential values of ``options`` known in this process (literal ones, and
    references whose variable is set here), for :func:`scrub`."""
    found: set[str] = set()

    def visit(value: Any, secret: bool) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(v, secret or is_credential_key(k))
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v, secret)
        elif is_reference(value):
            env = os.environ.get(_REFERENCE.match(value)[1])  # type: ignore[index]
            if env:
                found.add(env)
        elif secret and isinstance(value, str):
            found.add(value)
        elif isinstance(value, str):
            found.update(m["pw"] for m in _URL_PASSWORD.finditer(value))

    for opts in options:
        visit(opts, False)
    return {v for v in found if len(v) >= MIN_SCRUB}


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with each of ``secrets`` (and URL passwords) replaced by ``***``."""
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return redact_url(text)


class StorageOptions(Mapping[str, Any]):
    """fsspec options as a spec holds them: an immutable mapping whose ``repr`` is redacted.

    ``dict(options)`` gives the values as written (references unresolved); :func:`resolve`
    gives what fsspec gets.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = dict(data or {})

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return repr(_redact_options(self._data, False))

    def __reduce__(self) -> tuple[Any, ...]:
        return (StorageOptions, (self._data,))
