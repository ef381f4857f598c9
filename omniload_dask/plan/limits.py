"""The largest (and smallest) values a plan may give, in one place.

Every number of a plan has a range, so a typo such as ``seq_len: 10**18`` is a
:class:`~omniload_dask.errors.PlanError` naming the field, not a job that runs with absurd
micro-batches, an ``OverflowError`` at start or a ``MemoryError`` inside the data plane. The
bounds are far beyond what training runs use today and well inside what the data plane's
int64 arithmetic and memory can hold::

    seq_len <= 2**24 (16M tokens a micro-batch), micro_batches <= 2**16 per rank
    dp x micro_batches            <= MAX_STEP_MICRO_BATCHES (2**22 micro-batches a step)
    dp x micro_batches x seq_len  <= MAX_STEP_TOKENS (2**31 tokens a step: 8 GiB as uint32)
"""

from __future__ import annotations

__all__ = [
    "MAX_BUCKETS",
    "MAX_COST",
    "MAX_EPOCHS",
    "MAX_INPUT_PIXELS",
    "MAX_MICRO_BATCHES",
    "MAX_PIXELS",
    "MAX_SCHEDULE_AT",
    "MAX_SEQ_LEN",
    "MAX_STEP_DOCUMENTS",
    "MAX_STEP_MICRO_BATCHES",
    "MAX_STEP_TOKENS",
    "MAX_TOKEN_ID",
    "MAX_UNIT_BYTES",
    "MAX_UNIT_RECORDS",
    "MAX_WEIGHT",
    "MAX_WORLD_SIZE",
    "MIN_UNIT_BYTES",
]

MAX_SEQ_LEN = 2**24  # tokens of one packed micro-batch
MAX_MICRO_BATCHES = 2**16  # micro-batches per rank and step
MAX_STEP_TOKENS = 2**31  # a step's token budget (and dp * micro_batches * seq_len)
MAX_STEP_MICRO_BATCHES = 2**22  # dp * micro_batches: micro-batches built per step
MAX_STEP_DOCUMENTS = 2**24  # a step's document budget
MAX_BUCKETS = 64
MAX_WORLD_SIZE = 2**20  # dp * tp * pp * cp
MAX_WEIGHT = 1e9  # a source's mixing weight (weights are relative)
MAX_SCHEDULE_AT = 2**62  # a schedule point, in steps or tokens
MIN_UNIT_BYTES = 1024  # smaller JSON Lines units make millions of reads of a big file
MAX_UNIT_BYTES = 2**34
MAX_UNIT_RECORDS = 2**24
MAX_EPOCHS = 2**31
MAX_PIXELS = 2**28  # an image after resizing (images.max_pixels)
MAX_INPUT_PIXELS = 2**32  # an image before resizing (images.max_input_pixels)
MAX_TOKEN_ID = 2**32 - 1  # tokens are uint32
MAX_COST = 1e30  # a cost coefficient: cost * length**2 stays finite in float64
