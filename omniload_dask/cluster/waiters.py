"""Fetching agents waiting in a long-poll, each on the one thing it needs next.

An agent's request for steps ``s..`` that nothing is ready for waits for either step ``s`` to
be dealt, or one block key to reach memory. Waking every waiting agent whenever anything
moved would cost O(agents) per event, thousands of wake-ups a step at scale; here an event
wakes only the agents it concerns::

    agent A waits for step 41 to be dealt       waiters.wait(41, timeout)
    agent B waits for block "...-40-3"          waiters.wait("omniload-batch-...-40-3", ...)
    step 41 dealt                               waiters.dealt(42)        -> A wakes
    block "...-40-3" in memory                  waiters.key_ready(key)   -> B wakes
    the job ended, failed or stopped            waiters.wake_all()

A woken agent looks again and replies or waits anew; a wait that times out takes itself out.
Runs on the scheduler's event loop only.
"""

from __future__ import annotations

import asyncio

__all__ = ["Waiters"]


class Waiters:
    """Waiting agents by the step they wait to be dealt, or by the key they wait for."""

    def __init__(self) -> None:
        self._steps: dict[int, list[asyncio.Future[None]]] = {}
        self._keys: dict[str, list[asyncio.Future[None]]] = {}
        self._dealt = 0

    def __len__(self) -> int:
        return sum(map(len, self._steps.values())) + sum(map(len, self._keys.values()))

    async def wait(self, blocker: int | str, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until step ``blocker`` is dealt, or key ``blocker``
        is in memory, or everyone is woken."""
        if isinstance(blocker, int) and blocker < self._dealt:
            return  # dealt meanwhile: look again at once
        table: dict = self._steps if isinstance(blocker, int) else self._keys
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        table.setdefault(blocker, []).append(fut)
        # A timer that ends the wait, not ``wait_for(shield(...))``: that makes two tasks per
        # wait, and every agent waits about once a step.
        timer = loop.call_later(max(0.0, timeout), _wake, [fut])
        try:
            await fut
        finally:
            timer.cancel()
            waiting = table.get(blocker)
            if waiting is not None and fut in waiting:
                waiting.remove(fut)
                if not waiting:
                    del table[blocker]

    def dealt(self, dealt: int) -> None:
        """Every step below ``dealt`` is dealt now."""
        self._dealt = dealt
        for step in [s for s in self._steps if s < dealt]:
            _wake(self._steps.pop(step))

    def key_ready(self, key: str) -> None:
        """``key`` reached memory."""
        waiting = self._keys.pop(key, None)
        if waiting:
            _wake(waiting)

    def wake_all(self) -> None:
        """Wake every waiting agent (the job ended, failed, stopped or lost its client)."""
        steps, keys = self._steps, self._keys
        self._steps, self._keys = {}, {}
        for waiting in [*steps.values(), *keys.values()]:
            _wake(waiting)


def _wake(waiting: list[asyncio.Future[None]]) -> None:
    for fut in waiting:
        if not fut.done():
            fut.set_result(None)
