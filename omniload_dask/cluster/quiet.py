"""Dask's logs of omniload's own errors, moved to debug level (the embedded cluster's).

An error in a read, tokenize or construction task (a missing file, a bad record under
``on_error: raise``) reaches the user once, as omniload's one-line error raised by
:meth:`Job.start` or the Feeder. Dask logs it before that, where it happens: the worker that
ran the task logs a "Compute Failed" block with the task's traceback, and the scheduler logs a
traceback ("Exception while handling op omniload_start") when a handler raises. A new user then
reads the same error up to five times, in Dask's words, before omniload's line.

:func:`install` keeps these records, when the error is an
:class:`~omniload_dask.errors.OmniloadError` of an omniload task or handler, off the terminal:
a filter on the stream handlers those two loggers write through (stderr) drops them. They stay
in Dask's own logs (``client.get_worker_logs()``, the dashboard's logs page) and in any file a
user logs to, and are logged again at DEBUG on ``omniload_dask.cluster.quiet`` (with the
traceback), so whoever turns debug logging on sees them. Any other error (a bug, another
library's task) stays as Dask prints it. The embedded cluster installs it in its scheduler
(this process) and, through :class:`QuietTaskErrors`, in its workers; a cluster given by
address keeps Dask's output.
"""

from __future__ import annotations

import logging
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from omniload_dask.core.keys import PREFIX
from omniload_dask.errors import OmniloadError
from omniload_dask.fixes import error_names

__all__ = ["QuietTaskErrors", "install"]

logger = logging.getLogger(__name__)

# Where Dask logs a failed task (worker) and a failed handler (scheduler, any server).
LOGGERS = ("distributed.worker", "distributed.core")


class _Echo(logging.Filter):
    """On Dask's logger: logs Dask's record of one of omniload's errors again at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _is_own_error(record):
            logger.debug("%s", record.getMessage(), exc_info=record.exc_info)
        return True


class _OffTerminal(logging.Filter):
    """On a stream handler: drops Dask's records of omniload's own errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _is_own_error(record)


def _is_own_error(record: logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    if not args or not isinstance(record.msg, str):
        return False
    if record.msg.startswith("Compute Failed"):  # key, state, task, exception text, traceback
        key, text = str(args[0]), str(args[3]) if len(args) > 3 else ""
        return PREFIX in key and text.startswith(tuple(f"{n}(" for n in error_names()))
    if record.msg.startswith("Exception while handling op"):
        exc = record.exc_info[1] if record.exc_info else None
        return str(args[0]).startswith("omniload_") and isinstance(exc, OmniloadError)
    return False


def install() -> None:
    """Keep Dask's records of omniload's own errors off this process's terminal (idempotent)."""
    for name in LOGGERS:
        target = logging.getLogger(name)
        _add(target, _Echo)
        for handler in _terminal_handlers(target):
            _add(handler, _OffTerminal)


def _add(where: logging.Filterer, kind: type[logging.Filter]) -> None:
    if not any(isinstance(f, kind) for f in where.filters):
        where.addFilter(kind())


def _terminal_handlers(log: logging.Logger) -> list[logging.Handler]:
    """The stream handlers (not files, not Dask's in-memory log) a record of ``log`` reaches."""
    found: list[logging.Handler] = []
    current: logging.Logger | None = log
    while current is not None:
        found += [
            h
            for h in current.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        ]
        current = current.parent if current.propagate else None
    return found


class QuietTaskErrors(WorkerPlugin):
    """:func:`install` in every worker of the cluster, present and future."""

    name = "omniload-quiet-task-errors"

    def setup(self, worker: Any) -> None:
        """Filter the worker process's Dask loggers (:func:`install`)."""
        install()
