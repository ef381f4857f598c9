"""Data plans: YAML in, validated and frozen plan objects out.

A plan says what to read (sources, with formats, paths and weights), how to turn it into tokens
(the tokenizer), how to cut global batches (sequence length, micro-batches, budget), the trainer's
parallel layout, and what to do with bad records. Example::

    version: 1
    name: demo
    seed: 7
    tokenizer: {kind: byte}
    batch: {seq_len: 1024, micro_batches: 2}
    layout: {dp: 2}
    sources:
      - {name: web, format: jsonl, path: data/web/*.jsonl.zst, weight: 3}
      - {name: books, format: parquet, path: data/books/*.parquet, text: body, weight: 1}

Optional sections, each described on its spec class::

    batch:                      # context buckets instead of one seq_len (BatchSpec, BucketSpec)
      global_tokens: 1048576
      buckets:                  # each: share of global_tokens (or micro_batches per rank)
        - {seq_len: 4096, share: 0.6}                      # short documents, by length
        - {seq_len: 32768, share: 0.2}                     # documents over 4096 tokens
        - {seq_len: 32768, share: 0.2, sources: [books]}   # books, whatever their length
    layout: {dp: 4, tp: 2, cp: 2}           # or an explicit rank_map (LayoutSpec)
    cost: {model: {hidden: 4096, layers: 32, heads: 32, kv_heads: 8, ffn: 14336, gated: true}}

Mixing can follow a schedule (piecewise constant or linear, over steps or consumed tokens)::

    mixing:
      by: tokens                 # shares of tokens (or: documents)
      over: steps                # schedule positions are steps (or: tokens)
      interpolate: linear        # or constant
      schedule:
        - {at: 0, weights: {web: 3, books: 1}}
        - {at: 10000, weights: {web: 1, books: 1}}

Image-text sources (Parquet with an image column, or WebDataset-style tar shards) name their
images with ``image``; the ``images`` section says how images become patches and tokens::

    images: {patch_size: 14, merge: 2, min_pixels: 3136, max_pixels: 1003520}
    sources:
      - {name: captions, format: parquet, path: data/cap/*.parquet, image: jpeg, text: caption}
      - {name: laion, format: webdataset, path: data/laion/*.tar, image: [jpg, png], text: txt}

A source with ``epochs: N`` stops after N passes; without it, it starts a new epoch with a fresh
shuffle. Every error names the field path and the value (``sources[1].weight: must be >= 0, got -1``).
Relative local paths are resolved against the plan file's folder; ``${VAR}`` and
``${VAR:-default}`` are expanded from the environment in paths. Credentials in
``storage_options`` are best given as ``${env:NAME}``, resolved only where storage is opened;
every output shows a plan without them (:meth:`Plan.redacted`, :mod:`.credentials`).

The modules: ``specs`` (the frozen section specs), ``plan`` (:class:`Plan`: the whole plan, its
plain-data form, resume key and stream fingerprint), ``parse`` (:func:`load_plan`,
:func:`parse_plan`: the top level) with one parser module per group of sections
(``parse_sources``, ``parse_batch``, ``parse_mixing``, ``parse_cost``), ``cost`` (what a
document piece costs, from the ``cost`` section: the one home of that arithmetic, which the
balancer calls), and ``fields`` (field by
field validation that names the path), ``credentials`` (what counts as one, redaction,
resolution). Import the names below from this package.
"""

from omniload_dask.plan.parse import load_plan, parse_plan
from omniload_dask.plan.parse_mixing import check_weights
from omniload_dask.plan.parse_sources import parse_source
from omniload_dask.plan.plan import Plan
from omniload_dask.plan.spec_data import source_dict, tokenizer_dict
from omniload_dask.plan.specs import (
    BYTE_IMAGE_TOKEN,
    NO_CAP,
    READ_SLOTS_PER_THREAD,
    BatchSpec,
    BucketSpec,
    CheckpointSpec,
    CostSpec,
    ImageSpec,
    LayoutSpec,
    LoaderSpec,
    MixingSpec,
    SchedulePoint,
    SourceSpec,
    StageSpec,
    TokenizerSpec,
    TokenMaskSpec,
)

__all__ = [
    "BYTE_IMAGE_TOKEN",
    "NO_CAP",
    "READ_SLOTS_PER_THREAD",
    "BatchSpec",
    "BucketSpec",
    "CheckpointSpec",
    "CostSpec",
    "ImageSpec",
    "LayoutSpec",
    "LoaderSpec",
    "MixingSpec",
    "Plan",
    "SchedulePoint",
    "SourceSpec",
    "StageSpec",
    "TokenMaskSpec",
    "TokenizerSpec",
    "check_weights",
    "load_plan",
    "parse_plan",
    "parse_source",
    "source_dict",
    "tokenizer_dict",
]
