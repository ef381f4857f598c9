"""Small helpers that read untrusted mappings field by field and name the field path on error.

A ``Fields`` wraps one mapping at one path (``sources[2]``); each getter checks type and range and
raises :class:`~omniload_dask.errors.PlanError` with ``path.field: what is wrong, got value``.
``done()`` rejects unknown keys, suggesting the closest known one, so typos never pass silently::

    f = Fields({"seq_len": 4096, "micro_batch": 2}, "batch")
    f.integer("seq_len", min=8)          # 4096
    f.integer("micro_batches", 1)        # 1 (the default: the key is absent)
    f.done()  # PlanError: batch.micro_batch: unknown field (known: micro_batches, seq_len);
              #            did you mean 'micro_batches'?

A misspelt key is named also where its absence fails first: ``batch: {seq_length: 4096}`` gives
``batch.seq_length: unknown field; did you mean 'seq_len'? (batch.seq_len: is required)``.

:func:`resolve_path` reads a path field: environment variables expanded, relative local paths
taken from the plan file's folder, and the result checked (:func:`check_path`): no control
characters, a protocol fsspec knows, a bucket or host where the protocol needs one.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlsplit

from omniload_dask.errors import PlanError
from omniload_dask.plan.credentials import StorageOptions, is_reference

logger = logging.getLogger(__name__)
C = TypeVar("C", bound=str)  # a choice field's ``Literal`` type (plan.choices)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def fail(path: str, message: str, value: Any = ...) -> NoReturn:
    """Raise a PlanError for ``path`` (``message`` says what is expected).

    When the field at ``path`` is absent and its mapping holds an unknown key close to its name
    (``seq_length`` for a required ``seq_len``, ``bacth`` for a whole missing ``batch``), the
    error names that key first: the typo is the cause, the absence only its effect.
    """
    got = "" if value is ... else f", got {value!r}"
    typo = _typo_of(path)
    if typo is not None:
        raise PlanError(f"{typo} ({path}: {message}{got})")
    raise PlanError(f"{path}: {message}{got}")


# The mappings being read, by path, in this thread: fail() looks a missing field's mapping up
# here to find a misspelt key. Weak, so a mapping read long ago never answers for a new plan.
_reading = threading.local()


def _open_fields() -> weakref.WeakValueDictionary[str, Fields]:
    table = getattr(_reading, "fields", None)
    if table is None:
        table = _reading.fields = weakref.WeakValueDictionary()
    return table


def _typo_of(path: str) -> str | None:
    """``section.key: unknown field; did you mean 'name'?`` for a misspelt key standing in for
    the absent field at ``path`` (or for its absent section), else None."""
    section, _, key = path.rpartition(".")
    name = key.split("[", 1)[0]
    fields = _open_fields().get(section)
    if fields is None or not name:
        return None
    unknown = fields.unknown()
    if fields.data.get(name) is None:
        close = difflib.get_close_matches(name, unknown, n=1)
        if close:
            return f"{fields.at(close[0])}: unknown field; did you mean {name!r}?"
        if section and not fields.data:  # the whole section is absent: misspelt in its parent?
            return _typo_of(section)
    # Another field of the section took its default because its key is misspelt (``knid`` for
    # ``kind``), and this one fails against that default.
    for key in unknown:
        close = difflib.get_close_matches(key, fields.defaulted(), n=1)
        if close:
            return f"{fields.at(key)}: unknown field; did you mean {close[0]!r}?"
    return None


class Fields:
    """Typed, path-aware access to one mapping of a plan."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, Mapping):
            fail(path or "plan", "must be a mapping", data)
        self.data = dict(data)
        self.path = path
        self._seen: set[str] = set()
        self._asked: set[str] = set()  # keys looked at with has(): known, even if not read
        self._former: dict[str, str] = {}  # a renamed field given by its former name: new -> old
        _open_fields()[path] = self

    def at(self, key: str) -> str:
        """The path of ``key`` in this mapping, for messages (``sources[2].weight``); a field
        given by its former name says so (:meth:`renamed`)."""
        path = f"{self.path}.{key}" if self.path else key
        return f"{path} (given as {self._former[key]})" if key in self._former else path

    def has(self, key: str) -> bool:
        """Whether ``key`` is given and not null (does not mark it as read)."""
        self._asked.add(key)
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` unchecked (``default`` when absent or null); marks it as read."""
        self._seen.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def renamed(self, old: str, new: str) -> None:
        """Accept ``old``, a field's former name, for ``new``: it is read as ``new`` with a
        logged warning naming the new field; both given is an error (which one would count?)."""
        self._asked.add(old)
        if old not in self.data or self.data[old] is None:
            return
        if new in self.data and self.data[new] is not None:
            raise PlanError(
                f"{self.at(old)}: renamed to {new!r}, and both are given "
                f"({old}={self.data[old]!r}, {new}={self.data[new]!r}); keep {new!r} only"
            )
        logger.warning("%s is deprecated: name it %s (same meaning)", self.at(old), self.at(new))
        self.data[new] = self.data.pop(old)
        self._former[new] = old

    def required(self, key: str) -> Any:
        """The value of ``key`` unchecked; a PlanError when it is absent or null."""
        self._seen.add(key)
        if self.data.get(key) is None:
            fail(self.at(key), "is required")
        return self.data[key]

    def text(
        self,
        key: str,
        default: str | None = None,
        *,
        pattern: str | None = None,
        choices: Sequence[str] | None = None,
    ) -> str:
        """A non-empty string, one of ``choices`` or matching ``pattern`` when given.

        Without a ``default`` the field is required.
        """
        value = self.required(key) if default is None else self.raw(key, default)
        if not isinstance(value, str) or not value:
            fail(self.at(key), "must be a non-empty string", value)
        if choices is not None and value not in choices:
            fail(self.at(key), f"must be one of {', '.join(map(repr, choices))}", value)
        if pattern is not None and not re.fullmatch(pattern, value):
            fail(self.at(key), f"must match {pattern}", value)
        return value

    def choice(self, key: str, default: C | None, choices: tuple[C, ...]) -> C:
        """One of ``choices`` (a ``Literal``'s values, :mod:`.choices`), typed as that
        ``Literal``; required without a ``default``."""
        value = self.text(key, default, choices=choices)
        return next(c for c in choices if c == value)

    def flag(self, key: str, default: bool) -> bool:
        """A ``true``/``false`` field."""
        value = self.raw(key, default)
        if not isinstance(value, bool):
            fail(self.at(key), "must be true or false", value)
        return value

    def integer(
        self,
        key: str,
        default: int | None = None,
        *,
        min: int | None = None,
        max: int | None = None,
    ) -> int:
        """An integer (not a bool) within ``[min, max]``; required without a ``default``."""
        value = self.required(key) if default is None else self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            fail(self.at(key), "must be an integer", value)
        if min is not None and value < min:
            fail(self.at(key), f"must be >= {min}", value)
        if max is not None and value > max:
            fail(self.at(key), f"must be <= {max}", value)
        return value

    def optional_int(
        self, key: str, *, min: int | None = None, max: int | None = None
    ) -> int | None:
        """An integer within ``[min, max]``, or None when the field is absent."""
        if not self.has(key):
            self._seen.add(key)
            return None
        return self.integer(key, min=min, max=max)

    def number(
        self,
        key: str,
        default: float | None = None,
        *,
        min: float | None = None,
        exclusive_min: bool = False,
        max: float | None = None,
    ) -> float:
        """A finite number ``>= min`` (``> min`` with ``exclusive_min``) and ``<= max``;
        required without a ``default``."""
        value = self.required(key) if default is None else self.raw(key, default)
        return check_number(self.at(key), value, min=min, exclusive_min=exclusive_min, max=max)

    def size(self, key: str, default: int, *, min: int = 1, max: int | None = None) -> int:
        """A byte size within ``[min, max]``: an integer or a string such as ``4MiB``."""
        value = self.raw(key, default)
        size = parse_size(self.at(key), value)
        if size < min:
            fail(self.at(key), f"must be at least {min} byte{'s' if min != 1 else ''}", value)
        if max is not None and size > max:
            fail(self.at(key), f"must be at most {max} bytes", value)
        return size

    def mapping(self, key: str) -> Fields:
        """A nested section as its own :class:`Fields` (empty when absent)."""
        return Fields(self.raw(key, {}), self.at(key))

    def plain_mapping(self, key: str) -> dict[str, Any]:
        """A mapping taken whole, its keys unchecked (``storage_options``, weights)."""
        value = self.raw(key, {})
        if not isinstance(value, Mapping):
            fail(self.at(key), "must be a mapping", value)
        return dict(value)

    def storage_options(self, key: str = "storage_options") -> StorageOptions:
        """fsspec options, taken whole; ``${env:...}`` references checked, not resolved.

        Errors never show a value here: it may be a credential.
        """
        value = self.raw(key, {})
        if not isinstance(value, Mapping):
            fail(self.at(key), f"must be a mapping of fsspec options, got a {type(value).__name__}")
        for name, item in value.items():
            if not isinstance(name, str):
                fail(self.at(key), f"option names must be strings, got {name!r}")
            if isinstance(item, str) and item.startswith("${env:") and not is_reference(item):
                fail(
                    f"{self.at(key)}.{name}",
                    "an environment reference is ${env:NAME}, NAME made of letters, digits "
                    "and _ (not starting with a digit)",
                )
        return StorageOptions(value)

    def sequence(self, key: str) -> list[Any]:
        """A required, non-empty list (its items are checked by the caller)."""
        value = self.required(key)
        if not isinstance(value, (list, tuple)) or not value:
            fail(self.at(key), "must be a non-empty list", value)
        return list(value)

    def unknown(self) -> list[str]:
        """The keys given (not null) that no getter has read so far, in order."""
        return [str(k) for k, v in self.data.items() if k not in self._seen and v is not None]

    def defaulted(self) -> list[str]:
        """The fields read so far that are absent (or null): those that took their default."""
        return sorted(k for k in self._seen if self.data.get(k) is None)

    def done(self) -> None:
        """Reject keys that no getter asked for, suggesting the closest known field."""
        known = sorted(self._seen | self._asked)
        for key in self.unknown():
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PlanError(f"{self.at(key)}: unknown field (known: {', '.join(known)}){hint}")


def check_number(
    path: str,
    value: Any,
    *,
    min: float | None = None,
    exclusive_min: bool = False,
    max: float | None = None,
) -> float:
    """``value`` as a finite float ``>= min`` (``> min`` with ``exclusive_min``) and ``<=
    max``, or a PlanError naming ``path``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail(path, "must be a number", value)
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        fail(path, "must be a finite number", value)
    if not math.isfinite(number):
        fail(path, "must be a finite number", value)
    if min is not None and (number <= min if exclusive_min else number < min):
        fail(path, f"must be {'>' if exclusive_min else '>='} {min:g}", value)
    if max is not None and number > max:
        fail(path, f"must be <= {max:g}", value)
    return number


def parse_size(path: str, value: Any) -> int:
    """A byte size in bytes: an integer, or a number with a unit (``4MiB``, ``512 KB``, ``1g``)."""
    if isinstance(value, bool):
        fail(path, "must be a byte size such as 4MiB", value)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        unit = (m.group(2) or "").lower()
        if unit not in _UNITS:
            fail(path, "must be a byte size such as 4MiB", value)
        scaled = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(scaled) or scaled >= 2**63:
            fail(path, "must be a byte size below 2**63", value)
        size = int(scaled)
    else:
        fail(path, "must be a byte size such as 4MiB", value)
    if size < 0:
        fail(path, "must not be negative", value)
    return size


def resolve_path(path: str, base_dir: str | os.PathLike[str] | None, field: str = "path") -> str:
    """Expand ``${VAR}`` / ``${VAR:-default}``; make relative local paths absolute."""

    def expand(m: re.Match[str]) -> str:
        value = os.environ.get(m.group(1))
        if value is None:
            if m.group(2) is None:
                fail(field, f"environment variable {m.group(1)} is not set", path)
            value = m.group(2)
        return value

    out = _ENV.sub(expand, path)
    check_path(field, out)
    if "://" in out or "::" in out or os.path.isabs(out) or base_dir is None:
        return out
    return str(Path(base_dir) / out)


_PROTOCOL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_NO_HOST = ("file", "local", "memory")  # protocols whose URLs need no bucket or host


def check_path(field: str, path: str) -> None:
    """A path or URL that fsspec can open: a PlanError naming ``field`` otherwise.

    Chained URLs (``simplecache::s3://bucket/key``) are checked link by link.
    """
    if not path:
        fail(field, "must be a non-empty path or URL", path)
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        fail(field, "must not contain control characters", path)
    links = path.split("::")
    for i, link in enumerate(links):
        if not link:
            fail(field, "is not a path or URL (an empty part between '::')", path)
        protocol, sep, rest = link.partition("://")
        if not sep:
            if i < len(links) - 1:  # a bare protocol in a chain, such as simplecache::
                if not _PROTOCOL.fullmatch(link):
                    fail(field, f"has no valid protocol before '::' ({link!r})", path)
                _known_protocol(field, link, path)
            continue
        if not _PROTOCOL.fullmatch(protocol):
            fail(field, f"has no valid protocol before '://' ({protocol!r})", path)
        _known_protocol(field, protocol, path)
        if protocol.lower() not in _NO_HOST and (not rest or rest.startswith("/")):
            fail(field, f"names no bucket or host after '{protocol}://'", path)
        try:
            urlsplit(link)
        except ValueError as exc:
            fail(field, f"is not a valid URL ({exc})", path)


def _known_protocol(field: str, protocol: str, path: str) -> None:
    """Fail unless fsspec (or a package that registered with it) knows ``protocol``.

    fsspec is imported here, when a plan names a URL, and only to ask which protocols exist:
    importing the plan package stays free of it.
    """
    from fsspec.registry import known_implementations, registry

    name = protocol.lower()
    if name in known_implementations or name in registry:
        return
    close = difflib.get_close_matches(name, sorted(known_implementations), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    fail(field, f"unknown protocol {protocol!r} (fsspec has no filesystem for it){hint}", path)
