"""Text that every view of a job prints the same way (the page, ``omniload status``).

Each function takes figures from ``stats()`` and returns a phrase::

    checkpoint_text({"step": 5, "time": t - 10}, t)   -> "step 5, 10 s ago"
    format_si(1234567)                                 -> "1.23M"
    fetched_text(stats)                                -> "every rank fetched through step 228"
    efficiency_text(stats, " · ")                      -> "last 0.9981 · mean 0.9912 · min 0.9520"
    held_back_text(stats["held_back"])                 -> "held back at step 24 by rank 1 (not
                                                           fetched it; never connected: 1)"
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "checkpoint_text",
    "efficiency_text",
    "fetched_text",
    "format_si",
    "held_back_text",
    "milliseconds",
]


def checkpoint_text(checkpoint: Mapping[str, Any] | None, now: float) -> str:
    """What the views say about the data plane's last checkpoint (``stats()["checkpoint"]``)."""
    if not checkpoint or checkpoint.get("time") is None:
        return "none yet"
    age = max(0.0, now - float(checkpoint["time"]))
    return f"step {checkpoint.get('step', '?')}, {age:.0f} s ago"


def format_si(value: float | None, digits: int = 3) -> str:
    """``1234567 -> '1.23M'``; None -> '-'."""
    if value is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.{digits}g}{unit}"
    return f"{value:.{digits}g}"


def milliseconds(seconds: float | None) -> str:
    """A wait in seconds as milliseconds, three decimals below 1 ms; None -> '-'."""
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3f} ms" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def fetched_text(stats: Mapping[str, Any]) -> str:
    """The last step every rank has fetched, or that none has been yet."""
    if not stats["steps_fetched"]:
        return "no step fetched by every rank yet"
    return f"every rank fetched through step {stats['start_step'] + stats['steps_fetched'] - 1}"


def held_back_text(held: Mapping[str, Any]) -> str:
    """Which ranks hold the job back (``stats()["held_back"]``, or a feeder's reply)."""
    ranks, count = list(held["ranks"]), int(held["count"])
    listed = ", ".join(str(r) for r in ranks) + (
        f" and {count - len(ranks)} more" if count > len(ranks) else ""
    )
    text = f"held back at step {held['step']} by rank{'s' if count > 1 else ''} {listed} (not fetched it"
    never, never_count = list(held.get("never_seen") or ()), int(held.get("never_seen_count") or 0)
    if never_count:
        more = f" and {never_count - len(never)} more" if never_count > len(never) else ""
        text += "; never connected: " + ", ".join(str(r) for r in never) + more
    return text + ")"


def efficiency_text(stats: Mapping[str, Any], sep: str) -> str:
    """Balance efficiency of the last step, mean and lowest, joined by ``sep``; '-' before
    the first step."""
    if not stats.get("efficiency_recent"):
        return "-"
    return sep.join(
        (
            f"last {stats['efficiency_recent'][-1]:.4f}",
            f"mean {stats['efficiency_mean']:.4f}",
            f"min {stats['efficiency_min']:.4f}",
        )
    )
