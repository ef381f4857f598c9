"""Differential checkpoints of the data plane on any fsspec URL.

A checkpoint is a folder::

    MANIFEST.json                   format, version, plan, file list with sizes and sha256,
                                    and the sha256 of the manifest itself
    base-000000001000-<run>.json.zst     a full snapshot at step 1000 (see core.state)
    delta-000000001000-000000001087-<run>-<n>.jsonl.zst   a line per drawn step / live change
    ...

The manifest is written last, to a temporary name and then moved over the old one, so a crash
mid-write leaves the previous checkpoint whole. Every file is verified against the manifest's
sha256 when read, and the manifest against its own ``manifest_sha256`` (of its other fields,
as canonical JSON), so an edit that leaves valid JSON (a position, ``latest_step``, a segment
entry removed) is refused rather than resumed at the wrong step; restoring a step also checks
that the deltas hold every step from the base to it. Every ``compact_every`` steps a new base
is written; the newest
``keep_bases`` bases and the deltas after the oldest of them are kept, so any step from the
oldest kept base to the latest flushed step can be restored exactly.

Writing is split so that nothing blocks the data plane: :meth:`CheckpointWriter.add` only
appends to memory (on the scheduler's loop); :meth:`CheckpointWriter.flush` does the I/O and
runs in a thread.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

import zstandard
from fsspec.core import url_to_fs

from omniload_dask.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    READABLE_VERSIONS,
    SELF_DIGEST,
    VERSION,
    Manifest,
    digest,
    manifest_digest,
)
from omniload_dask.core.state import READABLE_VERSIONS as STATE_READABLE
from omniload_dask.core.state import apply_deltas
from omniload_dask.errors import CheckpointError
from omniload_dask.plan import Plan, parse_plan
from omniload_dask.plan.credentials import redact, redact_url, resolve

__all__ = ["FORMAT", "VERSION", "Checkpoint", "CheckpointWriter"]

logger = logging.getLogger(__name__)


def _filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec filesystem and root path of ``url``; a CheckpointError if it cannot be opened."""
    resolved = resolve(options, "checkpoint.storage_options")
    try:
        return url_to_fs(url, **resolved)
    except (ImportError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {redact_url(url)!r}: cannot open it: {exc}") from None


class Checkpoint:
    """A checkpoint read back and verified; :meth:`state_at` rebuilds any kept step."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, unverified: bool = False
    ) -> None:
        """Read and verify the checkpoint at ``url``.

        A manifest that carries no digest of its own (format version 1, or one whose digest was
        taken out) cannot show that it was not edited by hand: it is refused unless
        ``unverified`` (``Job.start(..., resume_unverified=True)``), which is logged.
        """
        self.url = url
        self.fs, self.root = _filesystem(url, dict(storage_options or {}))
        path = f"{self.root}/{MANIFEST}"
        try:
            blob = self.fs.cat_file(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {url!r}: no {MANIFEST} (not a checkpoint, or none written yet)"
            ) from None
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {url!r}: cannot read {MANIFEST}: {type(exc).__name__}: {exc}"
            ) from None
        try:
            data = json.loads(blob)
        except ValueError as exc:
            raise CheckpointError(
                f"checkpoint {url!r}: {MANIFEST} is corrupt or truncated ({exc})"
            ) from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(
                f"checkpoint {url!r}: {MANIFEST} is not an omniload checkpoint manifest"
            )
        if (
            data.get("version") not in READABLE_VERSIONS
            or data.get("state_version") not in STATE_READABLE
        ):
            raise CheckpointError(
                f"checkpoint {url!r}: format version {data.get('version')!r} (state "
                f"{data.get('state_version')!r}); this omniload-dask reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))} (state "
                f"{', '.join(map(str, STATE_READABLE))})"
            )
        claimed = data.get(SELF_DIGEST)
        if claimed is None and not unverified:
            raise CheckpointError(
                f"checkpoint {url!r}: {MANIFEST} carries no {SELF_DIGEST} (format version "
                f"{data['version']}), so nothing shows that it was not edited by hand; if you "
                "trust it, resume with resume_unverified=True (Job.start), which is logged"
            )
        if claimed is None:
            logger.warning(
                "checkpoint %r: resuming from a %s without its %s (format version %s), as "
                "resume_unverified=True asks: its steps and positions are taken on trust",
                url,
                MANIFEST,
                SELF_DIGEST,
                data["version"],
            )
        elif claimed != manifest_digest(data):
            raise CheckpointError(
                f"checkpoint {url!r}: {MANIFEST} was changed after it was written (its "
                f"{SELF_DIGEST} does not match its content); it cannot be trusted to say "
                "which step each file holds. Restore the file from a copy, or start afresh "
                "with another checkpoint.url"
            )
        try:
            self.plan: Plan = parse_plan(data["plan"])
            self.manifest = Manifest(
                plan=data["plan"],
                bases=list(data["bases"]),
                segments=list(data["segments"]),
                latest_step=int(data["latest_step"]),
                positions=dict(data.get("positions") or {}),
                written_at=float(data.get("written_at") or 0),
            )
            self.manifest.check(url)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {url!r}: {MANIFEST} is incomplete ({exc})") from None

    @property
    def first_step(self) -> int:
        """The oldest step that can be restored (the oldest kept base's)."""
        return int(self.manifest.bases[0]["step"])

    @property
    def latest_step(self) -> int:
        """The newest step the state can be restored at (every step before it is flushed)."""
        return self.manifest.latest_step

    def _read(self, entry: dict[str, Any]) -> bytes:
        """A listed file's bytes, verified against its size and sha256, decompressed."""
        path = f"{self.root}/{entry['file']}"
        try:
            blob = self.fs.cat_file(path)
        except FileNotFoundError:
            raise CheckpointError(
                f"checkpoint {self.url!r}: file {entry['file']!r} listed in {MANIFEST} is missing"
            ) from None
        if len(blob) != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint {self.url!r}: file {entry['file']!r} is corrupt or truncated: "
                f"{len(blob)} bytes, {MANIFEST} lists {entry['bytes']}"
            )
        if digest(blob) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {self.url!r}: file {entry['file']!r} is corrupt: its bytes have "
                f"changed since it was written (its sha256 is not the one {MANIFEST} lists; "
                f"the size, {len(blob)} bytes, is)"
            )
        if entry["file"].endswith(".zst"):
            try:
                return zstandard.ZstdDecompressor().decompress(blob)
            except zstandard.ZstdError as exc:
                raise CheckpointError(
                    f"checkpoint {self.url!r}: file {entry['file']!r} does not decompress ({exc})"
                ) from None
        return bytes(blob)

    def state_at(self, step: int | None = None) -> dict[str, Any]:
        """The data-plane state at ``step`` (default: the latest flushed step)."""
        step = self.latest_step if step is None else int(step)
        if not self.first_step <= step <= self.latest_step:
            raise CheckpointError(
                f"checkpoint {self.url!r} can restore steps {self.first_step} to "
                f"{self.latest_step}, not {step}"
            )
        base = max((b for b in self.manifest.bases if b["step"] <= step), key=lambda b: b["step"])
        state = json.loads(self._read(base))
        if int(state["step"]) != int(base["step"]):
            raise CheckpointError(
                f"checkpoint {self.url!r}: base {base['file']!r} holds step {state['step']}, "
                f"{MANIFEST} says {base['step']}"
            )
        deltas: list[dict[str, Any]] = []
        for seg in self.manifest.segments:  # later ones too: they may hold logged changes
            if seg["last"] >= base["step"]:
                for line in self._read(seg).splitlines():
                    deltas.append(json.loads(line))
        drawn = [d["step"] for d in deltas if "step" in d and base["step"] <= d["step"] < step]
        if drawn != list(range(base["step"], step)):
            missing = sorted(set(range(base["step"], step)) - set(drawn))
            what = (
                f"lack steps {_ranges(missing)}" if missing else "repeat steps or mix their order"
            )
            raise CheckpointError(
                f"checkpoint {self.url!r}: cannot restore step {step}: its delta files {what} "
                f"(from the base at step {base['step']}; {MANIFEST} lists "
                f"{len(self.manifest.segments)} delta files up to step {self.latest_step})"
            )
        return apply_deltas(state, deltas, step)

    def summary(self) -> dict[str, Any]:
        """What ``omniload checkpoint inspect`` shows."""
        state = self.state_at()
        files = self.manifest.bases + self.manifest.segments
        return {
            "url": self.url,
            "plan": self.plan.name,
            "plan_fingerprint": self.plan.stream_fingerprint(),
            "restorable_steps": [self.first_step, self.latest_step],
            "bases": [b["step"] for b in self.manifest.bases],
            "segments": len(self.manifest.segments),
            "bytes": sum(int(f["bytes"]) for f in files),
            "written_at": self.manifest.written_at,
            "rank_positions": self.manifest.positions,
            "sources": [
                {
                    "name": s["spec"]["name"],
                    **(
                        dict(
                            zip(
                                (
                                    "epoch",
                                    "position",
                                    "row",
                                    "documents",
                                    "tokens",
                                    "skipped",
                                    "truncated_tokens",
                                    "retired",
                                    "offset",
                                    "filtered",
                                ),
                                s["state"],
                                strict=False,  # (a state written before "filtered": 9 values)
                            )
                        )
                        if s["state"] is not None
                        else {"joins_later": True}
                    ),
                }
                for s in state["sources"]
            ],
            "log": state["log"],
        }


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``3-5, 9`` (for messages)."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


class CheckpointWriter:
    """Appends deltas in memory; :meth:`flush` writes them (call it from a thread)."""

    def __init__(
        self,
        url: str,
        plan: Plan,
        *,
        compact_every: int = 1000,
        keep_bases: int = 3,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.fs, self.root = _filesystem(url, dict(storage_options or {}))
        self.compact_every = compact_every
        self.keep_bases = keep_bases
        self.manifest = Manifest(plan=plan.redacted())  # no credentials: see credentials.py
        self._buffer: list[dict[str, Any]] = []
        self._lock = threading.Lock()  # one flush at a time
        self._token = uuid.uuid4().hex[:6]  # this writer's file names never reuse old ones
        self._seq = 0
        self.bytes_written = 0
        self.steps_written = 0
        self.flush_seconds = 0.0
        self.last_flush: float | None = None

    def exists(self) -> bool:
        """Whether the URL already holds a checkpoint (a manifest)."""
        return bool(self.fs.exists(f"{self.root}/{MANIFEST}"))

    def start(self, state: dict[str, Any], resume: Checkpoint | None = None) -> None:
        """Begin with a base at ``state``; continue ``resume``'s files if given.

        A fresh start refuses a URL that already holds a checkpoint (nothing is overwritten).
        """
        if resume is None and self.exists():
            raise CheckpointError(
                f"checkpoint {self.url!r} already holds a checkpoint; resume from it "
                "(Job.start(..., resume=True), omniload run --resume) or give the plan another "
                "checkpoint.url"
            )
        superseded: list[str] = []
        if resume is not None:
            # Keep what is there (older steps stay restorable); the new timeline starts with a
            # base at the restored step, and what the old one wrote after it is superseded.
            start = int(state["step"])
            old = resume.manifest
            self.manifest.bases = [b for b in old.bases if b["step"] < start]
            self.manifest.segments = [
                s if s["last"] < start else self._cut_before(resume, s, start)
                for s in old.segments
                if s["first"] < start
            ]
            superseded = [
                f["file"]
                for f in old.bases + old.segments
                if f not in self.manifest.bases + self.manifest.segments
            ]
        self.fs.makedirs(self.root, exist_ok=True)
        self._write_base(state)
        self._write_manifest()
        for name in superseded:  # only once the new manifest no longer lists them
            self.fs.rm(f"{self.root}/{name}")

    def add(self, records: list[dict[str, Any]], positions: dict[int, int] | None = None) -> None:
        """Queue deltas (cheap; on the data plane's loop)."""
        self._buffer.extend(records)
        if positions:
            self.manifest.positions = {str(k): int(v) for k, v in positions.items()}

    def pending(self) -> int:
        """Deltas queued and not yet flushed."""
        return len(self._buffer)

    def flush(self, state_now: dict[str, Any] | None = None) -> int:
        """Write queued deltas (and a new base from ``state_now`` when compaction is due).

        Returns the bytes written. Thread-safe against itself; never called on the loop.
        """
        with self._lock:
            records, self._buffer = self._buffer, []
            steps = [r["step"] for r in records if "step" in r]
            if not records:
                return 0
            t0 = time.perf_counter()
            first = min(steps) if steps else self.manifest.latest_step
            last = max(steps) if steps else self.manifest.latest_step
            segment = self._write_segment(records, first, last)
            self.manifest.segments.append(segment)
            written = segment["bytes"]
            if steps:
                self.manifest.latest_step = last + 1
                self.steps_written += len(steps)
            base_step = self.manifest.bases[-1]["step"] if self.manifest.bases else 0
            if (
                state_now is not None
                and state_now["step"] >= self.manifest.latest_step
                and state_now["step"] - base_step >= self.compact_every
            ):
                written += self._write_base(state_now)
            dropped = self._compact()
            written += self._write_manifest()
            for name in dropped:
                self.fs.rm(f"{self.root}/{name}")
            self.bytes_written += written
            self.flush_seconds += time.perf_counter() - t0
            self.last_flush = time.time()
            return written

    def _write_segment(
        self, records: list[dict[str, Any]], first: int, last: int
    ) -> dict[str, Any]:
        """Write ``records`` (deltas of steps ``first`` to ``last``) as a new delta file; its
        manifest entry."""
        lines = b"".join(
            json.dumps(redact(r), separators=(",", ":")).encode() + b"\n" for r in records
        )
        blob = zstandard.ZstdCompressor(level=3).compress(lines)
        self._seq += 1
        name = f"delta-{first:012d}-{last:012d}-{self._token}-{self._seq:06d}.jsonl.zst"
        self._put(name, blob)
        return {
            "file": name,
            "first": first,
            "last": last,
            "bytes": len(blob),
            "sha256": digest(blob),
        }

    def _cut_before(self, resume: Checkpoint, segment: dict[str, Any], step: int) -> dict[str, Any]:
        """A copy of ``resume``'s delta file ``segment`` (which runs past ``step``) holding
        what it recorded before step ``step`` was drawn: the old timeline's steps stay
        restorable when a resume starts a new one at ``step``."""
        records = []
        for line in resume._read(segment).splitlines():
            record = json.loads(line)
            if record.get("step", -1) >= step:
                break
            records.append(record)
        return self._write_segment(records, int(segment["first"]), step - 1)

    def _put(self, name: str, blob: bytes) -> None:
        """Write one file of the checkpoint; storage errors become a CheckpointError."""
        try:
            self.fs.pipe_file(f"{self.root}/{name}", blob)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.url!r}: cannot write {name}: {type(exc).__name__}: {exc}"
            ) from None

    def _write_base(self, state: dict[str, Any]) -> int:
        """Write a base snapshot of ``state`` and list it (replacing one at the same step)."""
        blob = zstandard.ZstdCompressor(level=3).compress(  # sources' specs, without credentials
            json.dumps(redact(state), separators=(",", ":")).encode()
        )
        name = f"base-{int(state['step']):012d}-{self._token}.json.zst"
        self._put(name, blob)
        self.manifest.bases = [b for b in self.manifest.bases if b["step"] != state["step"]]
        self.manifest.bases.append(
            {"file": name, "step": int(state["step"]), "bytes": len(blob), "sha256": digest(blob)}
        )
        self.manifest.latest_step = max(self.manifest.latest_step, int(state["step"]))
        return len(blob)

    def _compact(self) -> list[str]:
        """Forget bases beyond ``keep_bases`` and the deltas before the oldest kept base."""
        bases = sorted(self.manifest.bases, key=lambda b: b["step"])
        drop = bases[: max(0, len(bases) - self.keep_bases)]
        self.manifest.bases = bases[len(drop) :]
        oldest = self.manifest.bases[0]["step"]
        old_segments = [s for s in self.manifest.segments if s["last"] < oldest]
        self.manifest.segments = [s for s in self.manifest.segments if s["last"] >= oldest]
        return [b["file"] for b in drop] + [s["file"] for s in old_segments]

    def _write_manifest(self) -> int:
        """Replace the manifest atomically: write a temporary file, then move it over the old."""
        self.manifest.written_at = time.time()
        blob = self.manifest.to_json()
        tmp = f"{self.root}/{MANIFEST}.tmp"
        try:
            self.fs.pipe_file(tmp, blob)
            self.fs.mv(tmp, f"{self.root}/{MANIFEST}")
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {self.url!r}: cannot write {MANIFEST}: {type(exc).__name__}: {exc}"
            ) from None
        return len(blob)

    def stats(self) -> dict[str, Any]:
        """Figures for the job's status: steps and bytes written, cost per step, pending deltas."""
        return {
            "url": redact_url(self.url),
            "latest_step": self.manifest.latest_step,
            "bases": [b["step"] for b in self.manifest.bases],
            "bytes_written": self.bytes_written,
            "steps_written": self.steps_written,
            "bytes_per_step": self.bytes_written / self.steps_written
            if self.steps_written
            else None,
            "flush_seconds_per_step": self.flush_seconds / self.steps_written
            if self.steps_written
            else None,
            "time": self.last_flush,
            "step": self.manifest.latest_step,
            "pending": len(self._buffer),
        }
