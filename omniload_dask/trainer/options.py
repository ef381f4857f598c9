"""What a feeder is asked for: its keyword arguments, checked once, as a frozen object.

:class:`~omniload_dask.trainer.feeder.Feeder` takes its arguments as keywords (the documented
``Feeder("job", address=..., dp_rank=0)`` and ``job.feeder(...)``) and turns them into one
:class:`FeederOptions` before it opens anything; :mod:`.wiring` builds the rank's supply of
steps from it. A bad argument is refused here, with its name and value, before any connection::

    FeederOptions.of("job", address="tcp://scheduler:8786", dp_rank=0, fanout="node")
    FeederOptions(job='job', address='tcp://scheduler:8786', ..., fanout='node', ...)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from omniload_dask.errors import JobError
from omniload_dask.plan.choices import FANOUTS, Fanout
from omniload_dask.plan.streams import TRAIN

__all__ = ["OUTPUTS", "FeederOptions", "Output"]

Output = Literal["torch", "numpy"]
OUTPUTS: tuple[Output, ...] = ("torch", "numpy")


@dataclass(frozen=True)
class FeederOptions:
    """A feeder's arguments (see :class:`~omniload_dask.trainer.feeder.Feeder`), checked.

    ``fanout`` None takes the plan's ``loader.fanout``; ``prefetch`` None (or 0) the job's
    default depth; ``start_step`` None where the job started; ``rank`` and the ``*_rank`` and
    ``dp_size`` arguments are resolved against the plan's layout once it is known
    (:func:`~omniload_dask.trainer.ranks.resolve_rank`).
    """

    job: str
    address: str
    security: Any = None
    rank: int | None = None
    dp_rank: int | None = None
    dp_size: int | None = None
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    prefetch: int | None = None
    output: Output = "numpy"
    max_steps: int | None = None
    start_step: int | None = None
    reconnect_timeout: float = 300.0
    fanout: Fanout | None = None
    group: Any = None  # a broadcast's gloo group (made if None)
    node_ranks: tuple[int, ...] | None = None
    stream: str = TRAIN
    pass_index: int = 0

    @classmethod
    def of(
        cls,
        job: str,
        *,
        address: str | None,
        output: str | None,
        fanout: str | None,
        node_ranks: Sequence[int] | None = None,
        stream: str | None = None,
        **rest: Any,
    ) -> FeederOptions:
        """The options of ``Feeder(job, ...)``: ``output`` None is torch where torch is
        installed, else numpy; JobError on a missing address or an unknown fanout or output."""
        if address is None:
            raise JobError("Feeder: give a client or a scheduler address")
        if fanout is not None and fanout not in FANOUTS:
            raise JobError(f"Feeder: fanout must be one of {', '.join(FANOUTS)}, got {fanout!r}")
        if output is None:
            from omniload_dask.trainer.ranks import torch_available

            output = "torch" if torch_available() else "numpy"
        if output not in OUTPUTS:
            raise JobError(f"Feeder: output must be 'torch' or 'numpy', got {output!r}")
        return cls(
            job=job,
            address=address,
            output=cast(Output, output),
            fanout=cast(Fanout | None, fanout),
            node_ranks=None if node_ranks is None else tuple(node_ranks),
            stream=stream or TRAIN,
            **rest,
        )

    @property
    def ranks(self) -> dict[str, Any]:
        """The rank arguments, as :func:`~omniload_dask.trainer.ranks.resolve_rank` takes them."""
        return dict(
            rank=self.rank,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
            cp_rank=self.cp_rank,
        )

    def for_pass(self, job: str, start: int | None, end: int | None) -> FeederOptions:
        """These options for a pass over a further stream: its job, first step and end (each
        where the caller gave none)."""
        return dataclasses.replace(
            self,
            job=job,
            start_step=start if self.start_step is None else self.start_step,
            max_steps=end if self.max_steps is None else self.max_steps,
        )
