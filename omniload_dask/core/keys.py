"""The names of the data plane's tasks: deterministic within a run, unique across runs.

::

    read unit   omniload-read-{run}-{source}-{epoch}-{position}   (read in portions: ...-p{p})
    block       omniload-batch-{run}-{step}-{block}               the batches of a block of DP
                                                                  groups of one step
    steps       omniload-batch-{run}-{first}-k{k}                 every group's batches of the k
                                                                  steps from first on
    rebuild     omniload-batch-{run}-{step}-g{group}-r{n}         one group's batch, built again
    discovery   omniload-discover-{run}-{source}[-{n}]            a source's catalog (n: added live)
    tokenizer   omniload-tokenizer-{run}                          the tokenizer's check

A run id holds no ``-`` (hex digits), so a key is taken apart at its dashes: :func:`parse`
gives its kind, run and fields; :func:`run_of`, :func:`read_source` and the ``is_*`` tests are
what the Dask adapter asks of a key. This module is the one place that builds or reads a key.

A block task builds the batches of ``groups_per_task`` consecutive DP groups (block b holds
groups ``b * size .. (b + 1) * size - 1``); a fetcher asks the worker holding it for its own
*part*: part ``group * cp + c`` is group ``group``'s batch, or with context parallelism its
slice ``c``::

    dp=4, groups_per_task=2, cp=2     block 0 = groups 0, 1   parts 0, 1 (group 0), 2, 3
                                      block 1 = groups 2, 3   parts 4, 5, 6, 7

A block of several steps numbers its parts step by step: part ``offset * dp * cp + group * cp
+ c`` is step ``first + offset``'s.

The scheduler plugin relies on the ``omniload-`` prefix to tell the data plane's tasks apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "BATCH",
    "DISCOVER",
    "PREFIX",
    "READ",
    "TOKENIZER",
    "KeyName",
    "Keys",
    "is_batch",
    "is_data_key",
    "is_read",
    "parse",
    "read_source",
    "run_of",
]

PREFIX = "omniload-"  # every task key of the data plane starts with it
READ, BATCH, DISCOVER, TOKENIZER = "read", "batch", "discover", "tokenizer"  # the kinds
_READ_PREFIX = f"{PREFIX}{READ}-"
_BATCH_PREFIX = f"{PREFIX}{BATCH}-"


@dataclass(frozen=True)
class Keys:
    """Key names for one run (``run_id``) of a layout with ``cp`` context-parallel ranks."""

    run_id: str
    cp: int = 1

    def read(self, source: int, ref: tuple[int, int]) -> str:
        """The key of source ``source``'s read unit at ``ref`` = (epoch, position)."""
        return f"omniload-read-{self.run_id}-{source}-{ref[0]}-{ref[1]}"

    def block(self, step: int, block: int) -> str:
        """The key of block ``block``'s batches of ``step``."""
        return f"omniload-batch-{self.run_id}-{step}-{block}"

    def steps_block(self, first: int, steps: int) -> str:
        """The key of the block of every group's batches of ``steps`` steps from ``first``."""
        return f"omniload-batch-{self.run_id}-{first}-k{steps}"

    def rebuild(self, step: int, group: int, rebuild: int) -> str:
        """The key of the ``rebuild``-th rebuild of group ``group``'s batch of ``step``."""
        return f"omniload-batch-{self.run_id}-{step}-g{group}-r{rebuild}"

    @staticmethod
    def read_portion(unit_key: str, portion: int) -> str:
        """The key of portion ``portion`` of a read unit read in portions (``unit_key`` its
        own key)."""
        return f"{unit_key}-p{portion}"

    def discover(self, source: int | str, change: int | None = None) -> str:
        """The key of source ``source``'s discovery (``change``: the live change adding it)."""
        tail = "" if change is None else f"-{change}"
        return f"omniload-discover-{self.run_id}-{source}{tail}"

    def tokenizer(self) -> str:
        """The key of the tokenizer's check when the run starts."""
        return f"omniload-tokenizer-{self.run_id}"

    def part(self, group: int, cp_rank: int = 0) -> int:
        """The part of a block that DP group ``group``'s cp rank ``cp_rank`` fetches."""
        return group * self.cp + cp_rank


@dataclass(frozen=True)
class KeyName:
    """A data-plane key taken apart: ``omniload-{kind}-{run_id}-{fields joined by -}``."""

    kind: str
    run_id: str
    fields: tuple[str, ...]


def parse(key: Any) -> KeyName | None:
    """What ``key`` names, or None where it is not a data-plane key::

    parse("omniload-read-1a2b-0-3-17")  ->  KeyName("read", "1a2b", ("0", "3", "17"))
    """
    if not is_data_key(key):
        return None
    kind, _, rest = key[len(PREFIX) :].partition("-")
    run_id, *fields = rest.split("-")
    if not kind or not run_id:
        return None
    return KeyName(kind, run_id, tuple(fields))


def is_data_key(key: Any) -> bool:
    """Whether ``key`` is one of the data plane's task keys (every kind)."""
    return isinstance(key, str) and key.startswith(PREFIX)


def is_read(key: Any) -> bool:
    """Whether ``key`` is a read task's (a whole read unit or one portion of it)."""
    return isinstance(key, str) and key.startswith(_READ_PREFIX)


def is_batch(key: Any) -> bool:
    """Whether ``key`` is a construction task's (a block, a block of steps, a rebuild)."""
    return isinstance(key, str) and key.startswith(_BATCH_PREFIX)


def run_of(key: Any) -> str | None:
    """The run id in a data-plane key that has fields after it (every kind but the
    tokenizer's check, which runs before a job is known), or None."""
    name = parse(key)
    return name.run_id if name is not None and name.fields else None


def read_source(key: str) -> int:
    """The source of a read task's key (:meth:`Keys.read`, :meth:`Keys.read_portion`)."""
    name = parse(key)
    if name is None or name.kind != READ or not name.fields:
        raise ValueError(f"not a read task's key: {key!r}")
    return int(name.fields[0])
