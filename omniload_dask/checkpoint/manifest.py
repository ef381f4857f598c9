"""The checkpoint folder's manifest: what ``MANIFEST.json`` holds, its digests and checks.

The manifest lists every base and delta file with its size and sha256, and carries the sha256
of its own other fields (as canonical JSON), so an edit that leaves valid JSON is refused
rather than resumed at the wrong step (see :mod:`.store`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from omniload_dask.core.state import STATE_VERSION
from omniload_dask.errors import CheckpointError
from omniload_dask.plan import parse_plan

__all__ = ["FORMAT", "MANIFEST", "READABLE_VERSIONS", "SELF_DIGEST", "VERSION", "Manifest",
           "digest", "manifest_digest"]  # fmt: skip

FORMAT = "omniload-checkpoint"
VERSION = 2  # 2: the manifest carries its own sha256; 1 (read too) did not
READABLE_VERSIONS = (1, 2)
MANIFEST = "MANIFEST.json"
SELF_DIGEST = "manifest_sha256"


def digest(data: bytes) -> str:
    """The sha256 the manifest lists for a file's bytes."""
    return hashlib.sha256(data).hexdigest()


def manifest_digest(fields: dict[str, Any]) -> str:
    """The sha256 of a manifest's fields (all but its own digest), as canonical JSON: the same
    whatever the file's indentation or key order."""
    body = {k: v for k, v in fields.items() if k != SELF_DIGEST}
    return digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class Manifest:
    """What ``MANIFEST.json`` holds: the plan, the files with their digests, the positions."""

    plan: dict[str, Any]
    bases: list[dict[str, Any]] = field(default_factory=list)  # {step, file, bytes, sha256}
    segments: list[dict[str, Any]] = field(default_factory=list)  # + first, last
    latest_step: int = 0
    positions: dict[str, int] = field(default_factory=dict)
    written_at: float = 0.0

    def to_json(self) -> bytes:
        """The manifest file's bytes (with the plan's stream fingerprint, for ``inspect``, and
        the manifest's own sha256)."""
        fields: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "state_version": STATE_VERSION,
            "plan": self.plan,
            "plan_fingerprint": parse_plan(self.plan).stream_fingerprint(),
            "bases": self.bases,
            "segments": self.segments,
            "latest_step": self.latest_step,
            "positions": self.positions,
            "written_at": self.written_at,
        }
        fields[SELF_DIGEST] = manifest_digest(fields)
        return json.dumps(fields, indent=1).encode()

    def check(self, url: str) -> None:
        """Refuse a manifest whose entries contradict each other (CheckpointError)."""
        where = f"checkpoint {url!r}: {MANIFEST}"
        steps = [int(b["step"]) for b in self.bases]
        if not self.bases:
            raise CheckpointError(f"{where} lists no base snapshot")
        if steps != sorted(set(steps)) or steps[-1] > self.latest_step or steps[0] < 0:
            raise CheckpointError(
                f"{where}: base steps {steps} are not increasing up to latest_step "
                f"{self.latest_step}"
            )
        for seg in self.segments:
            if not 0 <= int(seg["first"]) <= int(seg["last"]) <= self.latest_step:
                raise CheckpointError(
                    f"{where}: segment {seg['file']!r} holds steps {seg['first']} to "
                    f"{seg['last']}, past latest_step {self.latest_step}"
                )
