"""Standby copies through Dask's Active Memory Manager (its policy classes are Dask internals,
kept in this package).

:func:`install_standby` adds a policy that asks for a second replica of each registered key,
and wraps Dask's ``ReduceReplicas`` so that it leaves those replicas alone;
:func:`run_memory_manager` runs the policies once, now. :mod:`omniload_dask.cluster.standby`
decides which keys are covered and when.
"""

from __future__ import annotations

from typing import Any

__all__ = ["install_standby", "run_memory_manager"]


def install_standby(scheduler: Any, is_standby: Any) -> Any:
    """Keep a second in-memory copy of the keys ``is_standby(key)`` accepts, on another worker.

    Uses the Active Memory Manager's policy API: a policy that asks for a second replica of
    each registered key, and Dask's ReduceReplicas wrapped so that it leaves those replicas
    alone (unwrapped, it would drop them a few seconds later). Returns the policy, whose
    ``keys`` set the caller fills and empties, or None without an AMM.
    """
    from distributed.active_memory_manager import (
        ActiveMemoryManagerPolicy,
        ReduceReplicas,
        Suggestion,
    )

    amm = getattr(scheduler, "extensions", {}).get("amm")
    if amm is None:
        return None

    class SparingReduceReplicas(ReduceReplicas):
        """Dask's ReduceReplicas, minus our standby copies."""

        def run(self) -> Any:
            inner = super().run()
            reply = None
            while True:
                try:
                    suggestion = inner.send(reply)
                except StopIteration:
                    return
                if is_standby(suggestion.ts.key):
                    reply = None
                    continue
                reply = yield suggestion

    class Standby(ActiveMemoryManagerPolicy):
        """A second copy of each registered in-memory key, so one worker's loss costs nothing."""

        def __init__(self) -> None:
            self.keys: set[str] = set()

        def run(self) -> Any:
            if len(self.manager.scheduler.workers) < 2:
                return
            for key in list(self.keys):
                ts = self.manager.scheduler.tasks.get(key)
                if ts is None or ts.state != "memory":
                    continue
                if len(ts.who_has or ()) < 2:
                    yield Suggestion("replicate", ts)

    for policy in list(amm.policies):
        if type(policy) is ReduceReplicas:
            amm.policies.discard(policy)
            amm.add_policy(SparingReduceReplicas())
    standby = Standby()
    amm.add_policy(standby)
    return standby


def run_memory_manager(scheduler: Any) -> None:
    """Run the Active Memory Manager's policies once now (creates standby copies promptly)."""
    amm = getattr(scheduler, "extensions", {}).get("amm")
    if amm is not None:
        amm.run_once()
