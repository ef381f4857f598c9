"""The trainer side: a Feeder per trainer rank yields its micro-batches, prefetched.

A task on the links' event loop (a background thread) asks the data plane for the next steps
(one RPC for several steps, which also reports how far this rank has fetched), gathers those
batches straight from the workers that built them (one round trip: :mod:`.fetch`, over a
:class:`~.link.Link`: Dask's comms, no ``Client``), and keeps them in a small local buffer;
iterating only takes from that buffer. It
refills with hysteresis: when at most ``prefetch - refill`` steps are left, it asks for enough
to fill up again (``refill`` is half the prefetch), so with a deep prefetch one call brings
several steps. Each item is one micro-batch in the
packed form (see :mod:`omniload_dask.batching.formats`), as torch tensors when torch is
installed, else numpy arrays::

    feeder = job.feeder(dp_rank=0)
    for mb in feeder:
        loss = model(mb["input_ids"], position_ids=mb["position_ids"], ...)
        if mb["micro_step"] == mb["num_micro_steps"] - 1:
            optimizer.step()

``state_dict()`` is two numbers (step and micro-step), because the data plane can rebuild any
recent step exactly; ``load_state_dict()`` resumes there.

At scale the ranks of a model-parallel group, or of a node, share one fetch
(``fanout``, see :mod:`.fanout`): ``"broadcast"`` (the group's lowest rank fetches and
broadcasts over torch.distributed) or ``"node"`` (a node-local agent fetches and hands
batches over shared memory). What each rank yields is the same as with its own fetch.

A plan's further streams (``streams``, e.g. validation) are read with ``stream="validation"``:
the feeder yields pass ``pass_index`` over that stream, the same batches whenever that pass is
asked for (or the plan's rotation), this rank's share of each step, and ends with the pass.
Every rank asks for the same ``pass_index`` (e.g. the count of evaluations so far); the
training stream's batches and position do not change::

    for mb in job.feeder(dp_rank=0, stream="validation", pass_index=evals):
        ...

With training stages (``batch.stages``: a batch ramp-up, a long-context stage) the budget,
``seq_len`` and micro-batch count change at declared steps. Each micro-batch then says its
step's ``stage`` (a number; with ``seq_len`` and ``num_micro_steps`` it already carries), and
``Feeder.stage`` gives the stage of the next step whole (:func:`stage_of`), so a trainer sees
a change before the step it rules. A live change of the stages (``Job.update_plan``) is
counted, and each step cut after it carries the count (``stages_version``): the feeder reads
the job's batch again with the first micro-batch of such a step (:mod:`.jobcopy`), so
``Feeder.stage`` shows the change from there on, before any step of a later stage it altered
(even one whose start it kept), and after a resume (the count is replayed with the job's log).
Only a change taking effect at the very step it alters is seen with that step's first
micro-batch. The micro-batches always carry the stage, ``seq_len`` and count they were built
with.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from omniload_dask.batching.formats import GroupBatch
from omniload_dask.batching.wire import expand
from omniload_dask.errors import JobError, OmniloadError
from omniload_dask.fixes import own_error
from omniload_dask.internals import comms as _comms
from omniload_dask.trainer.fanout import StepSupply
from omniload_dask.trainer.jobcopy import JobCopy, output_of, stage_of
from omniload_dask.trainer.options import FeederOptions
from omniload_dask.trainer.ranks import resolve_rank
from omniload_dask.trainer.wiring import ask_job, wire

__all__ = ["Feeder", "resolve_rank", "stage_of"]

STATE_VERSION = 1
REPORT_WAITS = 1024  # recent waits behind the p50/p99 a feeder reports to the data plane


class Feeder:
    """Iterator over one trainer rank's micro-batches of a running job.

    Give the rank as ``rank`` (global), as ``dp_rank`` (+ ``tp_rank``/``pp_rank``/``cp_rank``),
    or neither, to read it from torch.distributed or the ``RANK``/``WORLD_SIZE`` environment.
    Give the scheduler as ``address`` (with ``security``, a ``distributed.Security``, for TLS;
    default: Dask's config) or as a ``client`` whose address and security it takes; the
    feeder opens its own connections (none at all under a node agent).

    ``fanout`` (default: the plan's ``loader.fanout``) shares fetches: ``"broadcast"`` within
    each DP group (torch.distributed must be initialised; ``group``: this rank's gloo group,
    made if not given) or ``"node"`` through a node agent (``node_ranks``: the ranks of this
    node, default from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``). Every rank of a group (or node)
    must then use the same ``fanout``, ``max_steps`` and states. ``stream``/``pass_index``:
    a pass over a further stream; :attr:`stage`: the batch's shape now (module docstring).

    The arguments become one frozen :class:`~.options.FeederOptions` (:attr:`options`, checked
    before anything opens); :func:`~.wiring.wire` builds this rank's supply of steps from it,
    one small factory per fan-out, and every field is set here from what it returns.
    """

    def __init__(
        self,
        job: str,
        *,
        client: Any = None,
        address: str | None = None,
        security: Any = None,
        rank: int | None = None,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        tp_rank: int = 0,
        pp_rank: int = 0,
        cp_rank: int = 0,
        prefetch: int | None = None,
        output: str | None = None,
        max_steps: int | None = None,
        start_step: int | None = None,
        reconnect_timeout: float = 300.0,
        fanout: str | None = None,
        group: Any = None,
        node_ranks: Sequence[int] | None = None,
        stream: str | None = None,
        pass_index: int = 0,
    ) -> None:
        if client is not None:
            address = _comms.scheduler_address(client)
            security = security if security is not None else _comms.security_of(client)
        asked = FeederOptions.of(
            job,
            address=address,
            security=security,
            rank=rank,
            dp_rank=dp_rank,
            dp_size=dp_size,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            cp_rank=cp_rank,
            prefetch=prefetch,
            output=output,
            max_steps=max_steps,
            start_step=start_step,
            reconnect_timeout=reconnect_timeout,
            fanout=fanout,
            group=group,
            node_ranks=node_ranks,
            stream=stream,
            pass_index=pass_index,
        )
        self.waits: deque[float] = deque(maxlen=100_000)
        self._recent_waits: deque[float] = deque(maxlen=REPORT_WAITS)
        wired = wire(asked, self._recent_waits)  # the one construction path (.wiring)
        self.options = wired.options  # (a further stream's pass: its job, start and end)
        self.job, self.address = self.options.job, self.options.address
        self.stream, self.pass_index = self.options.stream, self.options.pass_index
        self.output, self.max_steps = self.options.output, self.options.max_steps
        self.fanout = wired.fanout
        place = wired.place
        self._job = JobCopy(place.plan, place.sources, place.stages_version)
        self.plan, self.layout = place.plan, place.plan.layout
        self.source_names = list(place.sources)
        self.rank, self.dp_rank, self.cp_rank = place.rank, place.dp_rank, place.cp_rank
        self.prefetch = place.prefetch
        self._link = wired.link
        self._supply = wired.supply
        self.micro_batches = 0
        self.tokens = 0
        self._step = wired.start
        self._micro = 0
        self._current: GroupBatch | None = None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.max_steps is not None and self._step >= self.max_steps:
            raise StopIteration
        t0 = time.perf_counter()
        if self._current is None:
            self._current = _take(self._supply, self._step)
        batch = self._current
        waited = time.perf_counter() - t0
        self.waits.append(waited)
        self._recent_waits.append(waited)
        mb = batch.micro_batches[self._micro]
        self._micro += 1
        if self._micro >= len(batch.micro_batches):
            self._supply.done(self._step)
            self._current = None
            self._step += 1
            self._micro = 0
        self.micro_batches += 1
        self.tokens += int(mb["num_tokens"])
        return self._convert(mb)

    def steps(self) -> Iterator[list[dict[str, Any]]]:
        """Iterate whole steps: the list of this rank's micro-batches of each step."""
        while True:
            try:
                first = next(self)
            except StopIteration:
                return
            out = [first]
            while out[-1]["micro_step"] < out[-1]["num_micro_steps"] - 1:
                out.append(next(self))
            yield out

    def as_torch_dataset(self) -> Any:
        """This feeder as a ``torch.utils.data.IterableDataset`` (use ``batch_size=None``)."""
        from omniload_dask.trainer.torch_dataset import FeederDataset

        return FeederDataset(self)

    @classmethod
    def dataset(cls, job: str, **kwargs: Any) -> Any:
        """A ``torch.utils.data.IterableDataset`` whose ``Feeder(job, **kwargs)`` (``address``,
        ``security``...) is made where it is first used: it pickles (into DataLoader workers)."""
        from omniload_dask.trainer.torch_dataset import FeederDataset

        return FeederDataset(make=functools.partial(cls, job, **kwargs))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: the next step and micro-step it will yield."""
        return {
            "version": STATE_VERSION,
            "job": self.job,
            "rank": self.rank,
            "step": self._step,
            "micro_step": self._micro,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s step and micro-step (batches already fetched are dropped)."""
        for key in ("version", "step", "micro_step"):
            if key not in state:
                raise JobError(f"Feeder.load_state_dict: state has no {key!r}")
        if state["version"] != STATE_VERSION:
            raise JobError(f"Feeder.load_state_dict: unknown state version {state['version']!r}")
        step, micro = int(state["step"]), int(state["micro_step"])
        if step < 0 or micro < 0:
            raise JobError(
                f"Feeder.load_state_dict: step and micro_step must be >= 0, got {step}, {micro}"
            )
        self._supply.reset(step)
        self._step, self._micro, self._current = step, micro, None

    @property
    def stage(self) -> dict[str, Any]:
        """The training stage of the next step this rank yields (:func:`stage_of`)."""
        return stage_of(self.plan.batch, self._step)

    # ------------------------------------------------------------------ figures
    @property
    def calls(self) -> int:
        """Round trips this rank made to the data plane (or its node agent)."""
        return self._supply.calls

    @property
    def reconnects(self) -> int:
        """Round trips retried after a lost connection or a missing job."""
        return self._supply.reconnects

    def stats(self) -> dict[str, Any]:
        """This rank's wait times and counts, plus the job's counters (records skipped...)."""
        return _stats(self, self._step, self._ask("stats"))

    def _ask(self, handler: str = "info") -> dict[str, Any]:
        """The job's ``info`` (or ``stats``), over this feeder's connection or a short one."""
        return ask_job(self._link, self.options, handler)

    def close(self) -> None:
        """Stop fetching (it ends within one poll) and close the connections."""
        self._supply.close()
        if self._link is not None:
            self._link.close()

    def __enter__(self) -> Feeder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _convert(self, mb: dict[str, Any]) -> dict[str, Any]:
        """A micro-batch as the trainer gets it: full form, source names, torch or numpy."""
        mb = expand(mb)  # the wire form carries neither labels nor position_ids
        self._job = self._job.seen(mb, self._supply.info)  # (live changes: .jobcopy)
        self.source_names, self.plan = list(self._job.names), self._job.plan
        return output_of(mb, self._job, self.output)


def _stats(feeder: Feeder, step: int, job: dict[str, Any]) -> dict[str, Any]:
    """:meth:`Feeder.stats`: this rank's figures at ``step`` and the ``job``'s."""
    waits = np.asarray(feeder.waits, dtype=np.float64)
    return {
        "rank": feeder.rank,
        "step": step,
        "micro_batches": feeder.micro_batches,
        "tokens": feeder.tokens,
        "wait_p50_ms": float(np.percentile(waits, 50) * 1e3) if len(waits) else None,
        "wait_p99_ms": float(np.percentile(waits, 99) * 1e3) if len(waits) else None,
        "skipped": {s["name"]: s["skipped"] for s in job["sources"]},
        "job": job,
    }


def _take(supply: StepSupply, step: int) -> GroupBatch:
    """``supply.take(step)``; the job's own error raised from here, with its message only."""
    try:
        return supply.take(step)
    except OmniloadError as exc:  # it came with the frames of the fetch loop and the scheduler
        raise own_error(exc) from None
