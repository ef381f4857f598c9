"""The exceptions omniload-dask raises.

One tree, so a training script can catch everything from the loader with one clause::

    OmniloadError
     ├── PlanError          a plan field is wrong: names the field path and the value
     ├── SourceError        a source cannot be read: names the source and the file
     │    └── RecordError   one record is bad (mid-stream); follows the plan's on_error policy
     ├── TokenizerError     the tokenizer file cannot be read or lacks a declared token
     ├── JobError           the job stopped or failed, or a rank asks for what it cannot have
     │    └── MissingJobError  no job of that name runs on the scheduler (feeders retry it)
     ├── CheckpointError    a checkpoint is missing, corrupt, of another plan or of an unknown version
     ├── CalibrationError   a calibration cannot run: the model cannot be loaded or fails, or too
     │                      few micro-batches were timed to fit the cost terms
     └── InternalError      "cannot happen": a bug in omniload-dask, please report it

Every class keeps its message as its only constructor argument, so instances pickle cleanly and
travel across Dask's RPC (a scheduler handler's exception is re-raised in the calling client).
"""

from __future__ import annotations

__all__ = [
    "CalibrationError",
    "CheckpointError",
    "InternalError",
    "JobError",
    "MissingJobError",
    "OmniloadError",
    "PlanError",
    "RecordError",
    "SourceError",
    "TokenizerError",
]


class OmniloadError(Exception):
    """Base class of every error omniload-dask raises on purpose."""


class PlanError(OmniloadError, ValueError):
    """A plan field is missing, of the wrong type or out of range.

    The message starts with the field path, e.g. ``sources[1].weight: must be > 0, got -1``.
    """


class SourceError(OmniloadError):
    """A source cannot be listed or read; the message names the source and the file."""


class RecordError(SourceError):
    """A single record is malformed (bad JSON, missing or non-text field, undecodable image)."""


class TokenizerError(OmniloadError):
    """The tokenizer cannot be loaded, or a declared special token is not in its vocabulary."""


class JobError(OmniloadError):
    """A job-level failure: unknown job, layout mismatch, a step no longer held, a failed source."""


class MissingJobError(JobError):
    """No job of that name runs on this scheduler (yet, or any more)."""


class CheckpointError(OmniloadError):
    """A checkpoint cannot be used: missing, corrupt, truncated, another plan, unknown version."""


class CalibrationError(OmniloadError):
    """A cost calibration cannot run or cannot fit: names the model, the option or the term."""


class InternalError(OmniloadError):
    """An invariant of omniload-dask was broken. This is a bug; please report it."""
