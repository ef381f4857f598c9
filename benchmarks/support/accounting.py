"""How the head-to-head benchmark counts memory, processes, open files and state bytes.

Memory is PSS (proportional set size, ``/proc/PID/smaps_rollup`` through psutil): a page shared
by k processes counts 1/k in each, so the PSS of a set of processes adds up to the physical
memory they use together, shared libraries and copy-on-write pages of forked workers included,
each counted once. A process tree is a process and all its descendants::

    sample = tree_sample([rank_pid, ...], data_prefix=str(data_folder))
    sample.pss        bytes, summed over every process of every tree
    sample.processes  how many processes the trees hold
    sample.open_files regular files under data_prefix that they hold open

No torch or Dask imports here: this module also runs inside the scheduler's process.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

__all__ = [
    "TreeSample",
    "cpu_with_reaped",
    "deep_sizeof",
    "kill_tree",
    "pss",
    "tree",
    "tree_sample",
]


def deep_sizeof(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of ``obj`` and what it refers to: containers, objects' ``__dict__`` and numpy
    buffers (``nbytes``, through ``sys.getsizeof``); objects met twice count once. Put the ids
    of objects to leave out in ``seen``."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    size = sys.getsizeof(obj)
    if isinstance(obj, np.ndarray):
        return size if obj.base is None else size + deep_sizeof(obj.base, seen)
    if isinstance(obj, dict):
        size += sum(deep_sizeof(k, seen) + deep_sizeof(v, seen) for k, v in obj.items())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        size += sum(deep_sizeof(x, seen) for x in obj)
    elif hasattr(obj, "__dict__"):
        size += deep_sizeof(vars(obj), seen)
    return size


def tree(pid: int) -> list[psutil.Process]:
    """The process ``pid`` and all its descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pss(proc: psutil.Process) -> int:
    """PSS of one process in bytes (0 if it has gone)."""
    return _memory(proc)[0]


def _memory(proc: psutil.Process) -> tuple[int, int]:
    """(PSS, USS) of one process in bytes, (0, 0) if it has gone."""
    try:
        info = proc.memory_full_info()
    except psutil.Error:  # gone, a zombie, or not ours
        return 0, 0
    return int(info.pss), int(info.uss)


@dataclass
class TreeSample:
    pss: int = 0
    root_pss: int = 0  # of the root processes alone
    uss: int = 0  # pages private to one process (a lower bound of what the trees add)
    processes: int = 0
    open_files: int = 0


def tree_sample(pids: list[int], data_prefix: str | None = None) -> TreeSample:
    """PSS, process count and open data files of the trees rooted at ``pids``."""
    out = TreeSample()
    for pid in pids:
        for i, proc in enumerate(tree(pid)):
            size, private = _memory(proc)
            if size == 0:
                continue
            out.pss += size
            out.uss += private
            out.processes += 1
            if i == 0:
                out.root_pss += size
            if data_prefix is not None:
                with contextlib.suppress(psutil.Error):
                    out.open_files += sum(
                        1 for f in proc.open_files() if f.path.startswith(data_prefix)
                    )
    return out


def cpu_with_reaped(pids: list[int]) -> dict[int, tuple[float, float]]:
    """For every process in the trees rooted at ``pids``: its own user + system CPU seconds,
    and those of its children that ended and that it reaped (the kernel adds a child's CPU,
    with its own reaped children's, to its parent when the parent waits for it)."""
    out = {}
    for pid in pids:
        for proc in tree(pid):
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                out[proc.pid] = (t.user + t.system, t.children_user + t.children_system)
    return out


def stop_processes(procs: list[Any], timeout: float = 30) -> None:
    """Terminate ``subprocess.Popen`` processes (all at once), wait up to ``timeout`` seconds
    for each, and kill the tree of any still running."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)


def kill_tree(pid: int) -> None:
    """Kill the process ``pid`` and its descendants, children first (only our own trees)."""
    procs = tree(pid)
    for proc in reversed(procs):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)
