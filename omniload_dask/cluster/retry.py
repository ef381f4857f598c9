"""Which task errors are worth another try, and trying again inside the task.

Dask's own ``retries=`` runs a failed task again whatever the error, each failure logging a
"Compute Failed" block on its worker: a missing file or an undecodable record then fails the
job only after every retry, although each try fails the same way. Reads and discoveries are
submitted without Dask retries instead and call :func:`with_retries`, which tries again only
what may go away (a connection reset or timed out mid-read)::

    FileNotFoundError, PermissionError        deterministic: raised at once, the job fails
    ConnectionRefusedError (a dead endpoint)   with that error
    RecordError / SourceError / TokenizerError
    bad data (UnicodeDecodeError, ValueError, a corrupt stream)

    TimeoutError, ConnectionResetError,       transient: tried again (``retries`` times,
    BrokenPipeError, a storage client's read   backing off), then raised
    timeout or dropped stream

A worker lost mid-task is not an error of the task: Dask's scheduler runs it again elsewhere
(up to ``distributed.scheduler.allowed-failures``) whatever is set here. Storage clients
(s3fs, gcsfs) retry their own throttling and 5xx replies before an error reaches the task.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from omniload_dask.errors import OmniloadError

__all__ = ["is_transient", "with_retries"]

T = TypeVar("T")
FIRST_BACKOFF = 0.25  # seconds before the first retry, doubling
# Errors of storage clients (botocore, aiohttp, urllib3) that mean a read was cut short or
# timed out; matched by name, so that none of them needs to be installed.
_TRANSIENT_NAMES = frozenset(
    {
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "IncompleteReadError",
        "ServerDisconnectedError",
        "ClientPayloadError",
        "ProtocolError",
    }
)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` may not happen again on a second try (see the module docstring)."""
    if isinstance(exc, OmniloadError):
        return False
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return False
    if isinstance(exc, ConnectionRefusedError):
        return False
    if isinstance(exc, (TimeoutError, ConnectionResetError, ConnectionAbortedError)):
        return True
    if isinstance(exc, BrokenPipeError):
        return True
    return type(exc).__name__ in _TRANSIENT_NAMES


def with_retries(fn: Callable[..., T], retries: int, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, tried again up to ``retries`` times on a transient error."""
    attempt = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if attempt >= retries or not is_transient(exc):
                raise
            time.sleep(FIRST_BACKOFF * 2**attempt)
            attempt += 1
