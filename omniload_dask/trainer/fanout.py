"""Where a feeder's steps come from: its own fetch, its group's broadcast, or its node's agent.

A :class:`~omniload_dask.trainer.feeder.Feeder` takes each step's batch from a *step supply*
(:class:`StepSupply`); the batch a rank sees is the same whichever it is::

    fanout "none"       DirectSupply     the rank fetches its own part (one agent per rank)
    fanout "broadcast"  BroadcastSupply  the lowest rank of the DP group fetches the group's
                                         parts (every cp slice) and broadcasts them over a
                                         gloo group of torch.distributed; each rank takes its
                                         own: one fetch per model-parallel group
    fanout "node"       NodeSupply       a node-local agent (:mod:`.node`) fetches for the
                        (.node_supply)   node's ranks and hands batches over shared memory:
                                         one fetch per node and part

Only fetching agents connect to the data plane and the workers, so connections per worker
follow agents, not ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from omniload_dask.batching.formats import GroupBatch
from omniload_dask.errors import JobError
from omniload_dask.trainer.broadcast import GroupShare
from omniload_dask.trainer.fetch import StallWatch, afetch_steps
from omniload_dask.trainer.link import Link
from omniload_dask.trainer.prefetch import Prefetcher

__all__ = ["BroadcastSupply", "DirectSupply", "StepSupply"]


class StepSupply(Protocol):
    """A feeder's supply of steps: where it takes each step's batch from."""

    @property
    def calls(self) -> int:
        """Round trips to the data plane (or the agent)."""
        ...

    @property
    def reconnects(self) -> int:
        """Round trips retried."""
        ...

    def take(self, step: int) -> GroupBatch:
        """This rank's batch of ``step`` (waits); StopIteration where the stream ends."""
        ...

    def done(self, step: int) -> None:
        """The rank is through ``step``."""
        ...

    def reset(self, step: int) -> None:
        """Continue from ``step`` (a ``load_state_dict``)."""
        ...

    def buffered(self) -> int:
        """Steps fetched ahead."""
        ...

    def info(self) -> dict[str, Any]:
        """The job's info now (sources joined since the start)."""
        ...

    def close(self) -> None:
        """Stop, and close connections."""
        ...


class DirectSupply:
    """Steps fetched by this process for ``ranks``: the parts ``needs`` (group, cp) of each.

    ``pick`` is the need whose batch :meth:`take` returns (None: the list of all of them).
    ``report()`` gives the wait figures sent with each request.
    """

    def __init__(
        self,
        link: Link,
        job: str,
        ranks: Sequence[int],
        needs: Sequence[tuple[int, int]],
        start: int,
        prefetch: int,
        report: Callable[[int], dict[str, Any]],
        *,
        pick: int | None = 0,
        max_steps: int | None = None,
        reconnect_timeout: float = 300.0,
    ) -> None:
        self.link = link
        self._job = job
        self._ranks = list(ranks)
        self._needs = list(needs)
        self._pick = pick
        self._report = report
        ranks_text = ", ".join(str(r) for r in self._ranks[:8])
        self.stalls = StallWatch(f"rank{'s' if len(self._ranks) > 1 else ''} {ranks_text}")
        self.prefetcher = Prefetcher(
            self._fetch,
            start,
            prefetch,
            max_steps=max_steps,
            reconnect_timeout=reconnect_timeout,
            name=f"omniload-feeder-{self._ranks[0]}",
            describe=f"rank {self._ranks[0]}: fetching",
            loop=link.loop,  # prefetching runs where the round trips run: no thread of its own
        )

    @property
    def calls(self) -> int:
        """Round trips to the data plane."""
        return self.prefetcher.calls

    @property
    def reconnects(self) -> int:
        """Round trips retried after a lost connection or a missing job."""
        return self.prefetcher.reconnects

    async def _fetch(self, start: int, count: int) -> tuple[list[Any], int | None]:
        pre = self.prefetcher
        report = self._report(pre.buffered())
        reply, got = await afetch_steps(
            self.link, self._job, self._ranks, self._needs, start, count, report, pre.refill
        )
        self.stalls.note(start, reply)
        end = reply.get("end")
        return got, int(end) if end is not None else None

    def take(self, step: int) -> Any:
        """This rank's batch of ``step`` (the list of every need's with ``pick`` None)."""
        parts = self.prefetcher.take(step)
        return parts if self._pick is None else parts[self._pick]

    def done(self, step: int) -> None:
        """The rank is through ``step``."""
        self.prefetcher.done(step)

    def reset(self, step: int) -> None:
        """Continue from ``step``."""
        self.prefetcher.reset(step)

    def buffered(self) -> int:
        """Steps fetched ahead."""
        return self.prefetcher.buffered()

    def info(self) -> dict[str, Any]:
        """The job's info now."""
        return dict(self.link.call("info", job=self._job))

    def close(self) -> None:
        """Stop prefetching and close the connections."""
        self.prefetcher.close()
        self.link.close()


class BroadcastSupply:
    """Steps shared within a DP group: its lowest rank fetches every cp slice and broadcasts.

    Every rank of the group must iterate in step (a broadcast is collective): the group's
    ranks take the same steps, as a trainer's model-parallel ranks do.
    """

    def __init__(
        self,
        share: GroupShare,
        cp_rank: int,
        fetcher: DirectSupply | None,
        info: Callable[[], dict[str, Any]],
    ) -> None:
        self._share = share
        self._cp = cp_rank
        self._fetcher = fetcher  # the group leader's; None on the other ranks
        self._info = info
        self.source_names: list[str] | None = None  # as the leader last sent them

    @property
    def calls(self) -> int:
        """Round trips to the data plane (the leader's)."""
        return self._fetcher.calls if self._fetcher is not None else 0

    @property
    def reconnects(self) -> int:
        """Round trips the leader retried."""
        return self._fetcher.reconnects if self._fetcher is not None else 0

    def take(self, step: int) -> GroupBatch:
        """This rank's slice of the group's batch of ``step``, as the leader broadcast it."""
        message: Any = None
        failure: BaseException | None = None
        if self._fetcher is not None:
            try:
                message = ("batch", step, self._fetcher.take(step))
            except StopIteration:
                message = ("end", step, None)
            except BaseException as exc:  # the other ranks raise it too
                failure = exc
                message = ("error", step, f"{type(exc).__name__}: {exc}")
        kind, at, payload = self._share.exchange(message)
        if failure is not None:
            raise failure
        if kind == "end":
            raise StopIteration
        if kind == "error":
            raise JobError(f"the group's fetching rank failed: {payload}")
        if at != step:
            raise JobError(
                f"broadcast out of step: this rank is at step {step}, its group's fetching "
                f"rank sent step {at} (every rank of a DP group must iterate together)"
            )
        return payload[self._cp]

    def done(self, step: int) -> None:
        """The rank is through ``step``."""
        if self._fetcher is not None:
            self._fetcher.done(step)

    def reset(self, step: int) -> None:
        """Continue from ``step`` (every rank of the group loads the same state)."""
        if self._fetcher is not None:
            self._fetcher.reset(step)

    def buffered(self) -> int:
        """Steps the leader fetched ahead."""
        return self._fetcher.buffered() if self._fetcher is not None else 0

    def info(self) -> dict[str, Any]:
        """The job's info now."""
        return self._info()

    def close(self) -> None:
        """Stop the leader's fetching."""
        if self._fetcher is not None:
            self._fetcher.close()
