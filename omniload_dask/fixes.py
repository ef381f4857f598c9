"""What a user reads of an error: omniload's own message, once, with the fix where one is known.

:func:`own_error` makes an error that came through Dask (raised in a worker's task or a
scheduler handler, re-raised here with those processes' frames) a fresh one of its class,
raised from the caller's frame: its message is the whole story. :func:`with_fix` adds the fix
to a message where one is known. One is, so far: the demo data.

The plans in ``plans/`` read their data from ``plans/demo-data``, which the quickstart writes.
A plan run before that fails on a missing file or an empty glob inside that folder; the error
names the file, and :func:`with_fix` adds the command that writes it::

    source 'web': glob '/repo/plans/demo-data/web/*.jsonl' matched no files
    -> ... matched no files; run `omniload demo-data plans/demo-data` to write the demo data
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from omniload_dask.errors import OmniloadError

__all__ = ["demo_data_fix", "error_names", "own_error", "own_message", "with_fix"]

FOLDER = "demo-data"
_QUOTED = re.compile(r"'([^']+)'")
_REPR = re.compile(r"^(\w+)\((.*)\)$", re.DOTALL)


def demo_data_fix(text: str) -> str | None:
    """The command that writes the missing demo-data folder a path quoted in ``text`` lies in,
    or None when ``text`` names no such path (or the folder exists)."""
    for quoted in _QUOTED.findall(text):
        if "://" in quoted or "::" in quoted:
            continue
        parts = Path(quoted).parts
        if FOLDER not in parts:
            continue
        folder = Path(*parts[: parts.index(FOLDER) + 1])
        if not folder.exists():
            return f"run `omniload demo-data {_shown(folder)}` to write the demo data"
    return None


def with_fix(message: str) -> str:
    """``message``, with the fix appended where one is known."""
    fix = demo_data_fix(message)
    return f"{message}; {fix}" if fix and fix not in message else message


def own_error(exc: OmniloadError) -> OmniloadError:
    """``exc`` as a fresh error of its class, its message with the fix where one is known
    (raise it ``from None``: the frames it came through say nothing the message does not)."""
    try:
        fresh = type(exc)(with_fix(str(exc)))
    except Exception:  # a class whose constructor takes more than the message
        return exc
    return fresh


def own_message(text: str) -> str:
    """The message of one of omniload's errors, from Dask's ``repr`` of it (a failed task's
    exception text, ``SourceError("source 'web': ...")``); any other text as it is."""
    match = _REPR.match(text)
    if match is None or match.group(1) not in error_names():
        return text
    try:
        message = ast.literal_eval(match.group(2))
    except (ValueError, SyntaxError):
        return text
    return message if isinstance(message, str) else text


def error_names() -> set[str]:
    """The names of omniload's error classes (the tree below OmniloadError)."""
    names, todo = set(), [OmniloadError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _shown(folder: Path) -> str:
    """``folder`` relative to the working directory when it lies below it (as a user types it)."""
    try:
        shown = os.path.relpath(folder)
    except ValueError:  # another drive (Windows)
        return str(folder)
    return str(folder) if shown.startswith("..") else shown
