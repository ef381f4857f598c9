"""The framework versions each adapter supports, checked when the adapter is imported.

An adapter leans on a framework's behaviour (how ``accelerate`` shards an iterable, where
Lightning keeps a data module's state, the fields a model's loss takes); outside the range it
was written and tested for, that behaviour may differ without an error. So importing an adapter
with a version outside its range fails at once, naming the package, the version found and the
range::

    require("transformers", "4.56", "6")   # ok for 4.56 <= version < 6
"""

from __future__ import annotations

import importlib.metadata
import re

from omniload_dask.errors import JobError

__all__ = ["parse_version", "require"]


def parse_version(text: str) -> tuple[int, ...]:
    """The leading numeric release of ``text``: ``"2.6.0rc1+cpu"`` -> ``(2, 6, 0)``."""
    match = re.match(r"\d+(\.\d+)*", text.strip())
    if match is None:
        raise JobError(f"cannot read a version number from {text!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def require(package: str, minimum: str, below: str, *, version: str | None = None) -> str:
    """The installed version of ``package`` if ``minimum <= version < below``, else a JobError.

    ``version`` overrides what is installed (for tests of the check itself).
    """
    if version is None:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            raise JobError(
                f"{package} is not installed; this integration supports "
                f"{package} >= {minimum}, < {below} (pip install '{package}>={minimum},<{below}')"
            ) from None
    found = parse_version(version)
    if not parse_version(minimum) <= found < parse_version(below):
        raise JobError(
            f"{package} {version} is not supported by this integration: it supports "
            f"{package} >= {minimum}, < {below} (pip install '{package}>={minimum},<{below}')"
        )
    return version
