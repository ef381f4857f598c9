"""The functions that run on Dask workers: discover, read (+ tokenize), construct blocks.

They keep nothing between calls: a read task gets one unit, returns a :class:`Shard` that stays
in worker memory, and attaches the shard's sample lengths for the data plane to the task's
finished message (:class:`ReadReport` reads it back on the scheduler). A construct task gets
the :class:`Recipe` of each DP group of its block and the shards they name, and returns a
:class:`BatchBlock` (with context parallelism, of each group's slices), from which fetchers
take their own parts (:mod:`.serving`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from omniload_dask.batching.block import BatchBlock, shared_block
from omniload_dask.batching.context_parallel import slice_batch
from omniload_dask.batching.formats import (
    GroupBatch,
    ImageTable,
    Recipe,
    RecipeTable,
    Shard,
    build,
)
from omniload_dask.batching.labels import Holes
from omniload_dask.cluster import settings
from omniload_dask.cluster.image_reads import decode_images, place
from omniload_dask.cluster.retry import with_retries
from omniload_dask.cluster.sizeof import block_bytes  # (importing it registers batch sizes)
from omniload_dask.core.rereads import tokens_digest
from omniload_dask.errors import RecordError, SourceError
from omniload_dask.internals import server as _server
from omniload_dask.plan import READ_SLOTS_PER_THREAD, ImageSpec, SourceSpec, TokenizerSpec
from omniload_dask.preprocess.chat_encode import encode_chats
from omniload_dask.preprocess.chat_images import image_token_counts, placeholder_text
from omniload_dask.preprocess.tokenize import describe, image_token_id, own_threads, tokenize
from omniload_dask.preprocess.transforms import apply_user_code, resolve
from omniload_dask.preprocess.vocabulary import describe_vocabulary
from omniload_dask.sources import Catalog, encode_sample_ids
from omniload_dask.sources.registry import discover_source, read_records

__all__ = [
    "ReadReport",
    "check_tokenizer",
    "check_vocabulary",
    "construct",
    "construct_block",
    "discover",
    "group_parts",
    "holes_of",
    "read_unit",
    "report_of",
    "tokenizer_threads",
]

MAX_REASONS = 5


def discover(spec: SourceSpec, on_error: str = "raise", retries: int = 0) -> Catalog:
    """List one source's files and read units (start-up); ``on_error`` is the plan's.

    Transient errors are tried again ``retries`` times, others raised at once (:mod:`.retry`).
    The source's transform and filter are imported here, where reads will run them.
    """
    for key in ("transform", "filter"):
        name = getattr(spec, key)
        if name is not None:
            resolve(name, f"source {spec.name!r}: {key}")
    return with_retries(discover_source, retries, spec, on_error)


def check_tokenizer(spec: TokenizerSpec, images: ImageSpec | None = None) -> dict[str, Any]:
    """Load the tokenizer where the work will run; report vocabulary and special ids.

    With images, also check that Pillow is there to decode them.
    """
    if images is not None:
        try:
            import PIL  # noqa: F401
        except ImportError:
            raise SourceError(
                "the plan has image sources but Pillow is not installed where the workers run "
                "(pip install 'omniload-dask[images]')"
            ) from None
    _tokenizer_threads()
    return describe(spec, images.placeholder if images is not None else None)


def check_vocabulary(spec: TokenizerSpec) -> dict[str, Any]:
    """The plan's vocabulary (size, BOS/EOS ids) for a plan whose sources are all token
    sources, without building the tokenizer, which such a job never runs
    (:func:`~omniload_dask.preprocess.vocabulary.describe_vocabulary`): its first batch does
    not wait for a large BPE file to load."""
    return describe_vocabulary(spec)


def _tokenizer_threads() -> None:
    """Tokenizers in this worker on threads of their own
    (:func:`~omniload_dask.preprocess.tokenize.own_threads`), and no library thread pools."""
    settings.single_threaded_tokenizers()
    slots = _server.worker_read_slots()
    if slots is not None:
        own_threads(tokenizer_threads(slots))


def tokenizer_threads(read_slots: int) -> int:
    """A worker's tokenizing threads: one for each :data:`~omniload_dask.plan.READ_SLOTS_PER_THREAD`
    of the reads it runs at once (at least one), so that while a read tokenizes the next one
    reads and decodes its records instead of the tokenizer waiting for it."""
    return max(1, math.ceil(read_slots / READ_SLOTS_PER_THREAD))


def read_unit(
    spec: SourceSpec,
    source_index: int,
    tokenizer: TokenizerSpec,
    on_error: str,
    file_index: int,
    file_url: str,
    start: int,
    stop: int,
    images: ImageSpec | None = None,
    retries: int = 0,
    more: Sequence[tuple[int, str, int, int]] = (),
    seed: int = 0,
    epoch: int = 0,
) -> Shard:
    """Read, decode and tokenize one unit; bad records raise or are skipped and counted.

    A token source's records are token ids already: no tokenizer runs. The source's filter
    and transform (if any) run on each record first, with generators seeded from ``seed``,
    the source, the record's sample id and ``epoch`` (:mod:`~omniload_dask.preprocess.
    transforms`); the records they drop are counted as ``filtered``.

    ``more``: further ``(file index, file url, start, stop)`` reads of a unit of several small
    files (:func:`~omniload_dask.sources.catalog.merge_small_files`), after the first; the
    shard holds their records after its own, in that order.

    Image-text sources (``images``: the plan's image settings) decode every image on the way; a
    record with a bad image is a bad record. The data plane gets the records' token counts
    (image tokens included) and, for images, their patch counts, with the task's finished
    message. A transient error (a read cut short) is tried again ``retries`` times; anything
    else (a missing file, a bad record with ``on_error: raise``) is raised at once, so the job
    fails with it (:mod:`.retry`).
    """
    return with_retries(
        _read_unit,
        retries,
        spec,
        source_index,
        tokenizer,
        on_error,
        file_index,
        file_url,
        start,
        stop,
        images,
        tuple(more),
        seed,
        epoch,
    )


def _read_unit(
    spec: SourceSpec,
    source_index: int,
    tokenizer: TokenizerSpec,
    on_error: str,
    file_index: int,
    file_url: str,
    start: int,
    stop: int,
    images: ImageSpec | None,
    more: tuple[tuple[int, str, int, int], ...] = (),
    seed: int = 0,
    epoch: int = 0,
) -> Shard:
    _tokenizer_threads()  # before the tokenizer's first use in this process
    t0 = time.perf_counter()
    records, files, bad_urls = read_records(spec, [(file_index, file_url, start, stop), *more])
    filtered = 0
    if spec.transform or spec.filter:
        records, files, filtered, bad_files = apply_user_code(
            spec, source_index, records, files, seed, epoch
        )
        url_of = {file_index: file_url, **{f: url for f, url, _, _ in more}}
        bad_urls += [url_of[f] for f in bad_files]
    t1 = time.perf_counter()
    table = None
    bad_images = 0
    pixels: list[list[np.ndarray]] = []
    image_spec = images or ImageSpec()
    if spec.has_images:
        before = len(records.bad)
        records, pixels = decode_images(records, image_spec)
        bad_images = len(records.bad) - before
        bad_urls += [file_url] * bad_images  # (an image source's unit is one read)
        files = np.full(len(records.offsets), file_index, np.int64)
    t2 = time.perf_counter()
    chats = None
    if spec.chat is not None:  # render, tokenize and mask now: failures are bad records
        marks: dict[str, Any] = {}  # (conversations with images: their runs where they mark)
        if spec.has_images:
            marks = dict(images=image_token_counts(pixels, image_spec),
                         placeholder=image_token_id(tokenizer, image_spec.placeholder),
                         mark=placeholder_text(tokenizer, image_spec.placeholder))  # fmt: skip
        chats = encode_chats(spec.chat, tokenizer, spec.name, records.chats or [], **marks)
        pixels = [pixels[i] for i in chats.kept] if spec.has_images else pixels
        url_of = {file_index: file_url, **{f: url for f, url, _, _ in more}}
        for i, reason in chats.bad:
            records.bad.append((int(records.offsets[i]), reason))
            bad_urls.append(url_of[int(files[i])])
        records.offsets, files = records.offsets[chats.kept], files[chats.kept]
        records.texts, records.chats = [""] * len(chats.kept), None
    bad = [
        f"source {spec.name!r}: file {url!r}: record at offset {offset}: {reason}"
        for (offset, reason), url in zip(records.bad, bad_urls, strict=True)
    ]
    if bad and on_error == "raise":
        raise RecordError(bad[0] + " (set on_error: skip to skip and count such records)")
    target = None
    if chats is not None:
        tokens, offsets, target = chats.tokens, chats.offsets, chats.target
    elif records.tokens is not None:  # a token source: its ids (and mask) as they are
        assert records.lengths is not None
        tokens, target = records.tokens, records.mask
        offsets = np.zeros(len(records.lengths) + 1, np.int64)
        np.cumsum(records.lengths, out=offsets[1:])
    else:
        tokens, offsets = tokenize(tokenizer, records.texts)
    if spec.has_images:
        placeholder = image_token_id(tokenizer, image_spec.placeholder)
        runs = chats.image_starts if chats is not None else None
        tokens, offsets, table = place(
            tokens, offsets, pixels, image_spec, placeholder, tokenizer, runs
        )
    t3 = time.perf_counter()
    ids = encode_sample_ids(source_index, files, records.offsets)
    lengths = np.diff(offsets)
    empty = lengths == 0
    if empty.any():  # nothing to train on (empty text and no BOS/EOS): skip and count
        url_of = {file_index: file_url, **{f: url for f, url, _, _ in more}}
        bad += [
            f"source {spec.name!r}: file {url_of[int(f)]!r}: record at offset {int(o)}: empty"
            for f, o in zip(
                files[empty][:MAX_REASONS], records.offsets[empty][:MAX_REASONS], strict=True
            )
        ]
        keep = ~empty
        ids = ids[keep]
        offsets = np.concatenate([[0], np.cumsum(lengths[keep])]).astype(np.int64)
        lengths = lengths[keep]
        if table is not None:
            table = table.select(keep)
    skipped = len(records.bad) + int(empty.sum())
    shard = Shard(
        source=source_index,
        tokens=tokens,
        offsets=offsets,
        sample_ids=ids,
        skipped=skipped,
        bad=bad[:MAX_REASONS],
        images=table,
        target=target,
        filtered=filtered,
    )
    meta: dict[str, Any] = {
        "lengths": lengths.astype(np.int32).tobytes(),
        "skipped": skipped,
        "bad": bad[:MAX_REASONS],
        "tokens": len(tokens),
        "records": len(records.offsets) + len(records.bad) + filtered,
        "filtered": filtered,
        "read_seconds": t1 - t0,  # for monitoring: read+decode vs tokenize throughput
        "tokenize_seconds": t3 - t2,
    }
    if spec.transform or spec.filter:  # (a read made again is checked against it: .rereads)
        meta["digest"] = tokens_digest(tokens)
    holes = holes_of(shard)
    if holes is not None:
        meta["hole_counts"], meta["holes"] = holes.to_wire()
    if table is not None:
        p_sum, p_sq = patch_sums(table, len(lengths))
        meta.update(
            patches=p_sum.tobytes(),
            patches_sq=p_sq.tobytes(),
            images=len(table),
            bad_images=bad_images,
            image_seconds=t2 - t1,
        )
    _server.set_task_metadata(meta)
    return shard


@dataclass(frozen=True)
class ReadReport:
    """What a read task tells the data plane with its finished message (see :func:`read_unit`).

    ``lengths`` are the tokens of each record kept, in file order; ``records`` counts the
    records read, bad ones included (None from an older task); with images, ``patches`` and
    ``patches_sq`` are each record's patches and the sum of their squares; ``holes`` the
    tokens of its records that are not targets (chat sources and images: :func:`holes_of`).
    """

    lengths: np.ndarray
    skipped: int
    records: int | None
    tokens: int
    bad: list[str]
    read_seconds: float | None
    tokenize_seconds: float | None
    patches: np.ndarray | None = None
    patches_sq: np.ndarray | None = None
    images: int = 0
    bad_images: int = 0
    filtered: int = 0  # records the source's filter or transform dropped
    holes: Holes | None = None
    digest: int | None = None  # its tokens' CRC, where the source runs user code

    @classmethod
    def decode(cls, meta: Mapping[str, Any]) -> ReadReport:
        """The report in a task's metadata, as :func:`read_unit` attached it."""
        patches = meta.get("patches")
        return cls(
            lengths=np.frombuffer(meta["lengths"], dtype=np.int32),
            skipped=int(meta["skipped"]),
            records=meta.get("records"),
            tokens=int(meta.get("tokens", 0)),
            bad=list(meta.get("bad") or []),
            read_seconds=meta.get("read_seconds"),
            tokenize_seconds=meta.get("tokenize_seconds"),
            patches=np.frombuffer(patches, dtype=np.int64) if patches is not None else None,
            patches_sq=(
                np.frombuffer(meta["patches_sq"], dtype=np.int64) if patches is not None else None
            ),
            images=int(meta.get("images", 0)),
            bad_images=int(meta.get("bad_images", 0)),
            filtered=int(meta.get("filtered", 0)),
            holes=Holes.from_wire(meta["hole_counts"], meta["holes"]) if "holes" in meta else None,
            digest=meta.get("digest"),
        )


def report_of(shard: Shard) -> dict[str, Any]:
    """The image figures, records filtered and holes of a shard as
    :class:`~omniload_dask.core.events.ReadReported` takes them (inline runs)."""
    out: dict[str, Any] = {"holes": holes_of(shard)}
    if shard.filtered:
        out["filtered"] = shard.filtered
    if shard.images is not None:
        out["patches"], out["patches_sq"] = patch_sums(shard.images, len(shard))
    return out


def holes_of(shard: Shard) -> Holes | None:
    """The tokens of each of the shard's records that are not targets: where its chat mask
    says so, and image placeholders (None for plain text: every token is one)."""
    table = shard.images
    if shard.target is None and (table is None or not len(table)):
        return None
    target = np.ones(len(shard.tokens), dtype=bool) if shard.target is None else shard.target
    if table is not None and len(table):
        target = target.copy()
        start = shard.offsets[table.record] + table.token_start
        count = table.tokens.astype(np.int64)
        at = np.repeat(start - (np.cumsum(count) - count), count) + np.arange(int(count.sum()))
        target[at] = False
    return Holes.of(shard.offsets, target)


def patch_sums(table: ImageTable, records: int) -> tuple[np.ndarray, np.ndarray]:
    """Per record: its images' patches, and the sum of their squares (int64 each)."""
    p = np.diff(table.cu_patches).astype(np.int64)
    # bincount with weights sums per record in one pass (float64: exact below 2**53 patches);
    # minlength keeps records without images, at 0, so the arrays line up with the lengths.
    p_sum = np.bincount(table.record, weights=p, minlength=records).astype(np.int64)
    p_sq = np.bincount(table.record, weights=p * p, minlength=records).astype(np.int64)
    return p_sum, p_sq


def construct(recipe: Recipe, *shards: Shard) -> GroupBatch:
    """Build one DP group's micro-batches for one step, in wire form (``wire.expand``)."""
    return build(recipe, list(shards), wire=True)


def group_parts(whole: GroupBatch, group: int, cp: int) -> dict[int, GroupBatch]:
    """Group ``group``'s parts: its batch (wire form), or with ``cp`` > 1 each context-parallel
    rank's slice of it (full form), by part number (``group * cp + c``)."""
    if cp <= 1:
        return {group: whole}
    return {group * cp + c: slice_batch(whole, cp, c) for c in range(cp)}


def construct_block(
    recipes: Sequence[RecipeTable], cp: int, stride: int, *shards: Shard
) -> BatchBlock:
    """Build a block of DP groups' batches: each recipe from the shards it names; the parts
    of the block's ``i``-th step (``recipes[i]``) numbered from ``i * stride``.

    Each part is packed here, on the task thread, as the workers serve it, straight into the
    block's one buffer (:func:`~omniload_dask.batching.block.shared_block`): serving it then
    only sends it, and the block's standby copy pickles a few fields a part and sends that
    buffer once, out of band, instead of every array of every micro-batch (a block at DP 8
    has 64 parts of 6 arrays each).
    """
    parts: dict[int, Any] = {}
    for i, table in enumerate(recipes):
        for recipe, whole in built(table, shards):
            for part, batch in group_parts(whole, recipe.group, cp).items():
                parts[i * stride + part] = batch
    block = shared_block(parts)  # (packed into one buffer for the block: see batching.block)
    block.nbytes = block_bytes(block)  # (once here: Dask sizes a block many times)
    return block


def built(table: RecipeTable, shards: Sequence[Shard]) -> Iterator[tuple[Recipe, GroupBatch]]:
    """Each recipe of one step's ``table`` and its whole batch, built from the shards it
    names (indices into ``shards``)."""
    for i in range(len(table)):
        recipe = table.recipe(i)
        yield recipe, construct(recipe, *[shards[j] for j in table.reads_of(i).tolist()])
