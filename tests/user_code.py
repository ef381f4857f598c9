"""User functions that tests name in plans (``tests.user_code:...``), as a user's package would."""

from __future__ import annotations

from typing import Any

import numpy as np


def keep_long(record: dict[str, Any]) -> bool:
    """Filter: texts of 140 characters or more."""
    return len(record["text"]) >= 140


def drop_odd_ids(record: dict[str, Any]) -> dict[str, Any] | None:
    """Transform without randomness: drop records whose sample id is odd."""
    return None if record["id"] % 2 else record


def shuffle_tokens(record: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """Token transform that uses its generator: a permutation of the ids, and a coin flip that
    drops about one record in five."""
    if rng.random() < 0.2:
        return None  # type: ignore[return-value]
    return {**record, "tokens": rng.permutation(record["tokens"])}


def explode_on_marker(record: dict[str, Any]) -> dict[str, Any]:
    """Raises on texts that hold "boom"."""
    if "boom" in record["text"]:
        raise ValueError("found a boom")
    return record


def wrong_type(record: dict[str, Any]) -> Any:
    """Returns the text itself rather than the record."""
    return record["text"]


def past_the_vocabulary(record: dict[str, Any]) -> dict[str, Any]:
    """Puts an id outside the byte vocabulary into every token record."""
    return {**record, "tokens": np.append(record["tokens"], 4000)}


def drop_first_token(record: dict[str, Any]) -> dict[str, Any]:
    """A token transform that keeps the mask in step: the first id and its mask value go."""
    return {**record, "tokens": record["tokens"][1:], "mask": record["mask"][1:]}


def lose_the_mask(record: dict[str, Any]) -> dict[str, Any]:
    """Appends an id but leaves the mask as it was (one value short)."""
    return {**record, "tokens": np.append(record["tokens"], 1)}


def unseeded_shuffle(record: dict[str, Any]) -> dict[str, Any]:
    """Token transform that breaks the contract: it permutes the ids with numpy's global
    generator (seeded anew in every process), not with the one it is given."""
    return {**record, "tokens": np.random.permutation(record["tokens"])}
