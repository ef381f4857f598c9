"""Parsers of how steps are cut and split: ``batch`` (with context ``buckets``) and ``layout``.

The layout comes first: a bucket's ``share`` of ``global_tokens`` becomes micro-batches per DP
rank, ``ceil(share * global_tokens / (dp * seq_len))``. Which sources a bucket names is checked
once the sources are known (:func:`check_bucket_sources`).
"""

from __future__ import annotations

import math

from omniload_dask.plan.choices import BALANCE_EFFORTS, LONG_DOCUMENTS
from omniload_dask.plan.fields import Fields, fail
from omniload_dask.plan.limits import (
    MAX_BUCKETS,
    MAX_MICRO_BATCHES,
    MAX_SEQ_LEN,
    MAX_STEP_DOCUMENTS,
    MAX_STEP_MICRO_BATCHES,
    MAX_STEP_TOKENS,
    MAX_WORLD_SIZE,
)
from omniload_dask.plan.specs import BatchSpec, BucketSpec, LayoutSpec

__all__ = ["check_bucket_sources", "pool_budgets", "read_batch", "read_layout"]


def read_layout(f: Fields) -> LayoutSpec:
    """The ``layout`` section: axis sizes and an ``order`` or an explicit ``rank_map``, and
    how hard the groups are balanced (``balance``)."""
    axes = {axis: f.integer(axis, 1, min=1, max=65536) for axis in ("dp", "tp", "pp", "cp")}
    if f.has("rank_map") and f.has("order"):
        fail(f.at("order"), "give order or rank_map, not both", f.raw("order"))
    order_raw = f.text("order", "tp-cp-dp-pp")
    order = tuple(order_raw.split("-"))
    if sorted(order) != ["cp", "dp", "pp", "tp"]:
        fail(f.at("order"), "must name dp, tp, pp and cp once each, joined by '-'", order_raw)
    world = axes["dp"] * axes["tp"] * axes["pp"] * axes["cp"]
    if world > MAX_WORLD_SIZE:
        fail(f.path, f"dp * tp * pp * cp must be <= {MAX_WORLD_SIZE} ranks", world)
    rank_map = _rank_map(f, axes) if f.has("rank_map") else ()
    balance = f.choice("balance", "full", BALANCE_EFFORTS)
    f.done()
    return LayoutSpec(order=order, rank_map=rank_map, balance=balance, **axes)


def _rank_map(f: Fields, axes: dict[str, int]) -> tuple[tuple[int, int, int, int], ...]:
    """``layout.rank_map``: one distinct ``[dp, tp, pp, cp]`` per rank of the world."""
    raw = f.raw("rank_map")
    world = axes["dp"] * axes["tp"] * axes["pp"] * axes["cp"]
    if not isinstance(raw, (list, tuple)) or len(raw) != world:
        fail(
            f.at("rank_map"),
            f"must list [dp, tp, pp, cp] for each of the {world} ranks (dp*tp*pp*cp)",
            raw if not isinstance(raw, (list, tuple)) else f"{len(raw)} entries",
        )
    seen: dict[tuple[int, ...], int] = {}
    out = []
    for r, entry in enumerate(raw):
        where = f"{f.at('rank_map')}[{r}]"
        if (
            not isinstance(entry, (list, tuple))
            or len(entry) != 4
            or any(isinstance(v, bool) or not isinstance(v, int) for v in entry)
        ):
            fail(where, "must be [dp, tp, pp, cp], four integers", entry)
        for value, axis in zip(entry, ("dp", "tp", "pp", "cp"), strict=True):
            if not 0 <= value < axes[axis]:
                fail(where, f"{axis} must be in [0, {axes[axis]})", list(entry))
        coords = tuple(entry)
        if coords in seen:
            fail(where, f"duplicates rank_map[{seen[coords]}]", list(entry))
        seen[coords] = r
        out.append((coords[0], coords[1], coords[2], coords[3]))
    return tuple(out)


def read_batch(f: Fields, layout: LayoutSpec) -> BatchSpec:
    """The ``batch`` section: one ``seq_len`` or context buckets, and the global budget."""
    tokens = f.optional_int("global_tokens", min=1, max=MAX_STEP_TOKENS)
    docs = f.optional_int("global_documents", min=1, max=MAX_STEP_DOCUMENTS)
    if tokens is not None and docs is not None:
        fail(f.at("global_documents"), "give global_tokens or global_documents, not both", docs)
    if f.has("buckets"):
        for key in ("seq_len", "micro_batches"):
            if f.has(key):
                fail(f.at(key), "give it in each of batch.buckets instead (not both)", f.raw(key))
        buckets = _buckets(f, layout, tokens)
        seq_len = max(b.seq_len for b in buckets)
        micro = sum(b.micro_batches for b in buckets)
        capacity = layout.dp * sum(b.micro_batches * b.seq_len for b in buckets)
    else:
        buckets = ()
        seq_len = f.integer("seq_len", min=8, max=MAX_SEQ_LEN)
        micro = f.integer("micro_batches", 1, min=1, max=MAX_MICRO_BATCHES)
        capacity = layout.dp * micro * seq_len
    where = f.at("buckets" if buckets else "micro_batches")
    if layout.dp * micro > MAX_STEP_MICRO_BATCHES:
        fail(
            where,
            f"dp ({layout.dp}) x micro_batches per rank must be <= {MAX_STEP_MICRO_BATCHES} "
            "micro-batches a step",
            layout.dp * micro,
        )
    if capacity > MAX_STEP_TOKENS:
        fail(
            where,
            f"dp ({layout.dp}) x micro_batches x seq_len must be <= {MAX_STEP_TOKENS} tokens "
            "a step",
            capacity,
        )
    if tokens is None and docs is None:
        tokens = capacity
    long_docs = f.choice("long_documents", "split", LONG_DOCUMENTS)
    max_doc = f.optional_int("max_document_tokens", min=1, max=MAX_STEP_TOKENS)
    if max_doc is not None and long_docs == "truncate":
        fail(f.at("max_document_tokens"), "only applies with long_documents: split", max_doc)
    if tokens is not None and tokens < seq_len and long_docs == "truncate":
        fail(f.at("global_tokens"), f"must be >= seq_len ({seq_len}) so any document fits", tokens)
    if tokens is not None and max_doc is not None and max_doc <= seq_len and tokens < max_doc:
        # (documents capped at or under seq_len are kept whole: see BatchSpec.whole_documents)
        fail(
            f.at("global_tokens"),
            f"must be >= max_document_tokens ({max_doc}): documents are kept whole, so any "
            "document must fit a global batch",
            tokens,
        )
    pad = f.flag("pad_to_seq_len", False)
    pool = _pack_pool(f, tokens, long_docs, max_doc, seq_len, buckets, layout.dp)
    f.raw("stages")  # (read by parse_stages, once this batch is known)
    f.done()
    return BatchSpec(
        seq_len=seq_len,
        micro_batches=micro,
        global_tokens=tokens,
        global_documents=docs,
        long_documents=long_docs,
        max_document_tokens=max_doc,
        pad_to_seq_len=pad,
        buckets=buckets,
        pack_pool=pool,
    )


def _pack_pool(
    f: Fields, tokens: int | None, long_docs: str, max_doc: int | None, seq_len: int,
    buckets: tuple[BucketSpec, ...], dp: int,
) -> int:  # fmt: skip
    """``batch.pack_pool``: documents a step's draw may hold back (0: none); it needs whole
    documents and a token budget, and with buckets each bucket's part of the budget
    (:func:`pool_budgets`) must hold a whole document of its ``seq_len`` (else a document
    could wait for ever)."""
    pool = f.integer("pack_pool", 0, min=0, max=MAX_STEP_DOCUMENTS)
    if not pool:
        return 0
    whole = long_docs == "truncate" or (max_doc is not None and max_doc <= seq_len)
    why = (
        "needs whole documents (long_documents: truncate, or max_document_tokens <= seq_len)"
        if not whole
        else "needs a token budget (global_tokens), not global_documents"
        if tokens is None
        else ""
    )
    if why:
        fail(f.at("pack_pool"), why, pool)
    if len(buckets) > 1:
        for i, (b, part) in enumerate(zip(buckets, pool_budgets(buckets, tokens, dp), strict=True)):
            if part < b.seq_len:
                fail(
                    f.at("pack_pool"),
                    f"with buckets, each bucket's part of global_tokens must hold a document "
                    f"of its seq_len: batch.buckets[{i}] gets {part} tokens, under its seq_len "
                    f"{b.seq_len} (raise global_tokens or the bucket's share)",
                    pool,
                )
    return pool


def pool_budgets(buckets: tuple[BucketSpec, ...], tokens: int | None, dp: int) -> list[int]:
    """Each bucket's part of the step's token budget under ``batch.pack_pool``: its ``share``
    of ``global_tokens`` (given ``micro_batches``, its part of the buckets' tokens), scaled
    down where the parts add up past ``global_tokens``, and never above the tokens of its
    micro-batches (``dp * micro_batches * seq_len``). The parts add up to at most the budget,
    so a step that fills each bucket within its part stays within ``global_tokens``."""
    caps = [dp * b.micro_batches * b.seq_len for b in buckets]
    if tokens is None:
        return caps
    wants = [
        b.share * tokens if b.share is not None else float(cap)
        for b, cap in zip(buckets, caps, strict=True)
    ]
    scale = min(1.0, tokens / sum(wants))
    return [min(cap, int(w * scale)) for w, cap in zip(wants, caps, strict=True)]


def _buckets(f: Fields, layout: LayoutSpec, tokens: int | None) -> tuple[BucketSpec, ...]:
    """``batch.buckets``: each gives seq_len and either share (of global_tokens) or micro_batches."""
    raw_buckets = f.sequence("buckets")
    if len(raw_buckets) > MAX_BUCKETS:
        fail(f.at("buckets"), f"at most {MAX_BUCKETS} buckets", len(raw_buckets))
    entries = [Fields(raw, f"{f.at('buckets')}[{i}]") for i, raw in enumerate(raw_buckets)]
    by_share = entries[0].has("share")
    out = []
    for e in entries:
        seq_len = e.integer("seq_len", min=8, max=MAX_SEQ_LEN)
        if e.has("share") and e.has("micro_batches"):
            fail(
                e.at("micro_batches"),
                "give share or micro_batches, not both",
                e.raw("micro_batches"),
            )
        if e.has("share") != by_share:
            fail(
                e.at("micro_batches" if by_share else "share"),
                "give share in every bucket or micro_batches in every bucket",
                e.raw("micro_batches" if by_share else "share"),
            )
        share = None
        if by_share:
            share = e.number("share", exclusive_min=True, min=0)
            if share > 1:
                fail(e.at("share"), "must be <= 1", share)
            if tokens is None:
                fail(e.at("share"), "needs batch.global_tokens (or give micro_batches)", share)
            micro = max(1, math.ceil(share * tokens / (layout.dp * seq_len) - 1e-9))
        else:
            micro = e.integer("micro_batches", 1, min=1, max=MAX_MICRO_BATCHES)
        raw_sources = e.raw("sources", [])
        if not isinstance(raw_sources, (list, tuple)) or not all(
            isinstance(x, str) and x for x in raw_sources
        ):
            fail(e.at("sources"), "must be a list of source names", raw_sources)
        e.done()
        out.append(BucketSpec(seq_len, micro, share, tuple(raw_sources)))
    if by_share:
        total = sum(b.share or 0.0 for b in out)
        if abs(total - 1.0) > 1e-6:
            fail(f.at("buckets"), "shares must add up to 1", [b.share for b in out])
    free = [b.seq_len for b in out if not b.sources]
    for i, b in enumerate(out):
        if not b.sources and free.count(b.seq_len) > 1:
            fail(
                f"{f.at('buckets')}[{i}].seq_len",
                "two buckets without sources have this seq_len (which one gets a document?)",
                b.seq_len,
            )
    return tuple(out)


def check_bucket_sources(batch: BatchSpec, names: list[str]) -> None:
    """Buckets' ``sources`` name known sources, each at most once, and leave none without a bucket."""
    pinned: dict[str, str] = {}
    for i, bucket in enumerate(batch.buckets):
        for j, name in enumerate(bucket.sources):
            where = f"batch.buckets[{i}].sources[{j}]"
            if name not in names:
                fail(where, f"no source named {name!r} (have {', '.join(names)})", name)
            if name in pinned:
                fail(where, f"source already in {pinned[name]}", name)
            pinned[name] = f"batch.buckets[{i}]"
    if batch.buckets and all(b.sources for b in batch.buckets):
        loose = [n for n in names if n not in pinned]
        if loose:
            fail(
                "batch.buckets",
                "every bucket lists its sources, so these sources have none "
                "(list them or add a bucket without sources)",
                loose,
            )
