"""From a feeder's options to its supply of steps: one small factory per fan-out.

:func:`wire` is the one way a :class:`~omniload_dask.trainer.feeder.Feeder` is built; what it
returns (:class:`Wired`) holds everything the feeder keeps, so the feeder sets each of its
fields once, in its ``__init__``::

    wire(options, waits)
      a further stream?   the pass's job, first step and end (one short call)
      fanout "node"       node(...)        the node's agent fetches; no connection of our own
      otherwise           the job's info over this rank's own Link, then by the fanout given
                          or else the plan's ``loader.fanout``:
        "none"            direct(...)      this rank fetches its own part
        "broadcast"       broadcast(...)   the DP group's lowest rank fetches and broadcasts
        "node"            node(...)        (the link is closed first)

The batches a rank yields are the same whichever supply it gets (:mod:`.fanout`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omniload_dask.core.blocks import fetch_depth
from omniload_dask.errors import JobError
from omniload_dask.plan import Plan, parse_plan
from omniload_dask.plan.choices import Fanout
from omniload_dask.plan.streams import TRAIN
from omniload_dask.trainer.fanout import BroadcastSupply, DirectSupply, StepSupply
from omniload_dask.trainer.fetch import wait_report
from omniload_dask.trainer.link import Link
from omniload_dask.trainer.options import FeederOptions
from omniload_dask.trainer.ranks import resolve_rank

__all__ = ["NODE_PREFETCH", "STREAM_START_WAIT", "Place", "Wired", "ask_job", "wire"]

NODE_PREFETCH = 8  # steps a node agent keeps ahead unless the feeder says
STREAM_START_WAIT = 120.0  # seconds a pass's job may take to start (its sources are listed)

Report = Callable[[int], dict[str, Any]]


@dataclass(frozen=True)
class Place:
    """Where a rank stands in its job: the plan, its sources, this rank and its coordinates,
    how many steps it keeps fetched ahead, and the count of live stage changes the plan's
    batch shows (:mod:`.jobcopy`)."""

    plan: Plan
    sources: tuple[str, ...]
    rank: int
    dp_rank: int
    cp_rank: int
    prefetch: int
    stages_version: int = 0

    @classmethod
    def of(cls, info: dict[str, Any], options: FeederOptions, prefetch: int | None) -> Place:
        """The place from the job's ``info``; ``prefetch`` None: two blocks of steps or more
        (:func:`~omniload_dask.core.blocks.fetch_depth`)."""
        plan = parse_plan(info["plan"])
        rank = resolve_rank(plan.layout, **options.ranks)
        coords = plan.layout.coords(rank)
        depth = prefetch or fetch_depth(plan)
        if depth < 1:
            raise JobError(f"Feeder: prefetch must be >= 1, got {depth}")
        version = int(info.get("stages_version", 0))
        return cls(plan, tuple(info["sources"]), rank, coords["dp"], coords["cp"], depth, version)


@dataclass(frozen=True)
class Wired:
    """A rank's feed, built: the options as resolved (a further stream's pass: its job,
    first step and end), the fan-out, the place, this rank's own link (None where an agent
    or the group's leader fetches) and the supply of steps, from step ``start``."""

    options: FeederOptions
    fanout: Fanout
    place: Place
    link: Link | None
    supply: StepSupply
    start: int


def wire(options: FeederOptions, waits: deque[float]) -> Wired:
    """Build the supply of steps ``options`` ask for (module docstring); ``waits`` are the
    rank's recent waits, reported with each request."""
    if options.stream != TRAIN:
        options = _pass_of(options)
    if options.fanout == "node":
        return node(options, waits)
    link = Link(options.address, options.security)
    try:
        info = link.call("info", job=options.job)
        place = Place.of(info, options, options.prefetch)
        fanout = options.fanout or place.plan.loader.fanout
        if fanout == "node":
            link.close()
            return node(options, waits)
        start = options.start_step if options.start_step is not None else _start_of(info)
        link.salt = place.rank
        link.warm(info.get("workers", ()))  # (comms open while the first batch is built)
        if fanout == "none":
            return direct(options, place, link, start, waits)
        return broadcast(options, place, link, start, waits)
    except BaseException:
        link.close()  # (idempotent)
        raise


def direct(
    options: FeederOptions, place: Place, link: Link, start: int, waits: deque[float]
) -> Wired:
    """Fan-out ``"none"``: this rank fetches its own part over its own link."""
    supply = DirectSupply(
        link,
        options.job,
        [place.rank],
        [(place.dp_rank, place.cp_rank)],
        start,
        place.prefetch,
        _reporter(waits, place.prefetch),
        max_steps=options.max_steps,
        reconnect_timeout=options.reconnect_timeout,
    )
    return Wired(options, "none", place, link, supply, start)


def broadcast(
    options: FeederOptions, place: Place, link: Link, start: int, waits: deque[float]
) -> Wired:
    """Fan-out ``"broadcast"``: the DP group's leader fetches every cp slice and broadcasts
    them over a gloo group (``FeederOptions.group``, made if None); the others keep no link."""
    from omniload_dask.trainer.broadcast import GroupShare

    layout = place.plan.layout
    share = GroupShare(layout, place.rank, options.group)
    fetcher = None
    own: Link | None = link
    if share.is_leader:
        fetcher = DirectSupply(
            link,
            options.job,
            share.members,
            [(place.dp_rank, c) for c in range(layout.cp)],
            start,
            place.prefetch,
            _reporter(waits, place.prefetch),
            pick=None,
            max_steps=options.max_steps,
            reconnect_timeout=options.reconnect_timeout,
        )
    else:  # the group's leader fetches: no connection of this rank's own
        link.close()
        own = None
    supply = BroadcastSupply(share, place.cp_rank, fetcher, lambda: ask_job(own, options))
    return Wired(options, "broadcast", place, own, supply, start)


def node(options: FeederOptions, waits: deque[float]) -> Wired:
    """Fan-out ``"node"``: steps from this node's agent (started here if this is the node's
    first rank), which also gives the job's info; no connection of this rank's own."""
    from omniload_dask.trainer.node_supply import NodeSupply

    prefetch = options.prefetch or NODE_PREFETCH
    supply = NodeSupply.for_rank(
        options.job,
        options.address,
        options.rank,
        _reporter(waits, prefetch),
        security=options.security,
        max_steps=options.max_steps,
        node_ranks=options.node_ranks,
        prefetch=prefetch,
        start=options.start_step,
        reconnect_timeout=options.reconnect_timeout,
    )
    try:
        place = Place.of(supply.job_info, options, prefetch)
    except BaseException:
        supply.close()
        raise
    return Wired(options, "node", place, None, supply, supply.start)


def ask_job(link: Link | None, options: FeederOptions, handler: str = "info") -> dict[str, Any]:
    """The reply of the job's ``handler`` (``info``, ``stats``...) over ``link``, or over a
    short connection of its own where the rank keeps none."""
    if link is not None:
        return dict(link.call(handler, job=options.job))
    return _ask_once(options, handler)


def _reporter(waits: deque[float], prefetch: int) -> Report:
    """This rank's figures for the data plane's monitoring, at ``buffered`` steps held."""
    return lambda buffered: wait_report(waits, buffered, prefetch)


def _pass_of(options: FeederOptions) -> FeederOptions:
    """Pass ``pass_index`` over stream ``FeederOptions.stream``, started or joined: the options
    for its job, first step and end."""
    index = options.pass_index
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise JobError(f"Feeder: pass_index must be an integer >= 0, got {index!r}")
    reply = _ask_once(
        options, "stream_pass", wait=STREAM_START_WAIT, stream=options.stream, index=index
    )
    end = int(reply["end"]) if reply["end"] is not None else None
    return options.for_pass(str(reply["job"]), int(reply["first"]), end)


def _ask_once(options: FeederOptions, handler: str, **kwargs: Any) -> dict[str, Any]:
    """The reply of the job's ``handler`` over a short connection of its own."""
    link = Link(options.address, options.security)
    try:
        return dict(link.call(handler, job=options.job, **kwargs))
    finally:
        link.close()


def _start_of(info: dict[str, Any]) -> int:
    """Where a feeder starts by default: where the job started (or resumed)."""
    return int(info.get("start_step") or 0)
