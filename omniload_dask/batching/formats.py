"""What travels between tasks: shards (tokenized read units) and constructed batches.

A :class:`Shard` is the output of one read task and stays in worker memory until the data plane
releases it. A :class:`Recipe` is the data plane's instruction for one (step, DP group): which
token ranges of which shard rows go into which micro-batch. :func:`build` turns a recipe and its
shards into a :class:`GroupBatch` in the packed ("varlen") layout::

    documents a=[5 6 7], b=[8 9] packed in one micro-batch
    input_ids    [5 6 7 8 9]
    labels       [6 7 -100 9 -100]      next token inside the document, -100 at its end
    position_ids [0 1 2 0 1]
    cu_seqlens   [0 3 5]                 (int32)
    seq_len      the micro-batch's capacity (its context bucket's sequence length)

Chat sources give each shard a per-token ``target`` mask (:mod:`omniload_dask.preprocess.
chat_encode`): a label counts only where the token it predicts is a target. Two documents, a
plain one and a chat whose tokens ``8 9 10`` are targets only from 9 on::

    input_ids        [5 6 7 | 8 9 10]          target (chat)  [. . .  F T T]
    labels           [6 7 -100 9 10 -100]       (plain text: every token after the first)
    num_loss_tokens  4                          labels that are not -100
    global_loss_tokens                          the sum of num_loss_tokens over every DP group
                                                and micro-batch of the step (the dealer's
                                                count: :mod:`omniload_dask.core.loss_tokens`)

With images (plans with image-text sources) a micro-batch also carries the pixel patches of every
image whose tokens it holds, and where those tokens sit. Patch size 14, merge 2, one 28 x 56
image (a 2 x 4 grid: 8 patches, 2 tokens) before the text ``a b``::

    input_ids          [BOS I I a b EOS]                I = the image placeholder token
    labels             [-100 -100 a b EOS -100]         placeholders are never targets
    pixel_patches      uint8 (8, 14, 14, 3)             all images' patches, in order
    image_grid_hw      [[2 4]]                          int32 (images, 2): patch rows, columns
    image_cu_patches   [0 8]                            int32: image i has patches [cu[i], cu[i+1])
    image_cu_tokens    [0 2]                            int32: its tokens in the encoder output
    image_token_map    [-1 0 1 -1 -1 -1]                int64 per position: -1 for text, else the
                                                        index into the concatenated (merged)
                                                        encoder output of this micro-batch
    image_positions    [1]                              first position of each image's tokens
    image_doc          [0]                              int32: its document (row of cu_seqlens)
    image_index        [0]                              int32: which image of its record

A model scatters with ``embeds[map >= 0] = encoder_out[map[map >= 0]]``; patches of a merge
window are contiguous, so ``merge**2`` consecutive encoder outputs form one token. A document cut
between micro-batches may cut an image's tokens: every micro-batch holding some of them carries
the whole image and maps only the tokens it holds.

Their sizes for the cluster's memory accounting are registered with ``dask.sizeof`` on the
cluster side (:mod:`omniload_dask.cluster.sizeof`), so this module stays free of Dask.

Constructor tasks build micro-batches in *wire form* (``build(..., wire=True)``), which
:mod:`omniload_dask.batching.wire` describes, with the packed form in which workers hold and
send a part and :func:`~omniload_dask.batching.wire.expand`, which restores the full layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from omniload_dask.batching.labels import IGNORE_INDEX, derived, loss_positions
from omniload_dask.batching.packing import packed_reduce
from omniload_dask.batching.sorting import first_use, ranges

__all__ = [
    "IGNORE_INDEX",
    "IMAGE_FIELDS",
    "GroupBatch",
    "ImageTable",
    "Recipe",
    "RecipeTable",
    "Shard",
    "build",
]

IMAGE_FIELDS = (
    "pixel_patches",
    "image_grid_hw",
    "image_cu_patches",
    "image_cu_tokens",
    "image_token_map",
    "image_positions",
    "image_doc",
    "image_index",
)


@dataclass
class ImageTable:
    """The images of a shard's records: patches, and where each image's tokens sit.

    Images are in record order (then in their order within the record). Image i belongs to
    record ``record[i]``, has patches ``patches[cu_patches[i]:cu_patches[i + 1]]`` on a
    ``grid[i]`` (rows, columns) grid, and ``tokens[i]`` placeholder tokens from offset
    ``token_start[i]`` inside its record's document.
    """

    patches: np.ndarray  # uint8 (patches, p, p, 3)
    cu_patches: np.ndarray  # int64 (images + 1)
    grid: np.ndarray  # int32 (images, 2)
    record: np.ndarray  # int64 (images)
    token_start: np.ndarray  # int64 (images)
    tokens: np.ndarray  # int64 (images)

    def __len__(self) -> int:
        return len(self.record)

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (what it adds to a shard's size in worker memory)."""
        return sum(
            int(a.nbytes)
            for a in (self.patches, self.cu_patches, self.grid, self.record, self.token_start)
        ) + int(self.tokens.nbytes)

    def of_record(self, record: int) -> range:
        """Indices of record ``record``'s images."""
        lo = int(np.searchsorted(self.record, record, side="left"))
        hi = int(np.searchsorted(self.record, record, side="right"))
        return range(lo, hi)

    def select(self, records: np.ndarray) -> ImageTable:
        """The images of the kept ``records`` (a boolean mask), records renumbered."""
        keep_img = records[self.record]
        new_index = np.cumsum(records) - 1
        spans = [
            np.arange(self.cu_patches[i], self.cu_patches[i + 1])
            for i in np.flatnonzero(keep_img).tolist()
        ]
        take = np.concatenate(spans) if spans else np.zeros(0, np.int64)
        sizes = np.diff(self.cu_patches)[keep_img]
        cu = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=cu[1:])
        return ImageTable(
            patches=self.patches[take],
            cu_patches=cu,
            grid=self.grid[keep_img],
            record=new_index[self.record[keep_img]],
            token_start=self.token_start[keep_img],
            tokens=self.tokens[keep_img],
        )


@dataclass
class Shard:
    """Tokenized records of one read unit, in file order (with their images, if any)."""

    source: int
    tokens: np.ndarray  # uint32, all documents concatenated
    offsets: np.ndarray  # int64, len(documents) + 1
    sample_ids: np.ndarray  # int64 global sample ids
    skipped: int = 0
    bad: list[str] = field(default_factory=list)  # the first few reasons, for messages
    images: ImageTable | None = None
    target: np.ndarray | None = None  # bool per token (chat sources); None: every token
    filtered: int = 0  # records the source's filter or transform dropped

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each record, in file order (what the read task reports)."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.sample_ids)


@dataclass(frozen=True)
class Recipe:
    """How to build one DP group's batch of one step.

    ``pieces`` rows are ``(micro_step, shard slot, row, token start, token stop)`` in output
    order; the shard slot indexes the shards passed to :func:`build`. Micro-step m holds up to
    ``micro_seq_lens[m]`` tokens (context buckets), or ``seq_len`` when that is empty.
    ``global_loss_tokens`` is the step's count of loss tokens over all groups (-1: unknown);
    ``stage`` the step's training stage where the job's batch has stages (-1: none);
    ``stages_version`` the count of live stage changes the step was cut after (0: none).
    """

    step: int
    group: int
    num_micro_steps: int
    pieces: np.ndarray
    seq_len: int
    slot_epochs: tuple[int, ...] = ()  # the source epoch each shard slot was drawn in
    pad_to_seq_len: bool = False
    pad_id: int = 0
    micro_seq_lens: tuple[int, ...] = ()
    patch_size: int = 0  # > 0: the plan has images; micro-batches carry the image fields
    global_loss_tokens: int = -1
    stage: int = -1
    stages_version: int = 0

    def capacity(self, micro_step: int) -> int:
        """Token capacity of micro-step ``micro_step``."""
        return self.micro_seq_lens[micro_step] if self.micro_seq_lens else self.seq_len

    @classmethod
    def per_group(
        cls, pieces: list[np.ndarray], slot_epochs: list[tuple[int, ...]], **shared: Any
    ) -> list[Recipe]:
        """The recipes of groups 0, 1, ...: ``pieces[g]`` and ``slot_epochs[g]`` for group g,
        the other fields ``shared``. The same as calling the class for each group, at a fifth
        of the cost (a step at DP 1,024 has 1,024 of them; a frozen dataclass sets each field
        through ``object.__setattr__``)."""
        base = vars(cls(group=0, pieces=np.zeros((0, 5), np.int64), **shared))
        out = []
        for g, (rows, epochs) in enumerate(zip(pieces, slot_epochs, strict=True)):
            recipe = object.__new__(cls)
            fields = vars(recipe)
            fields.update(base)
            fields["group"], fields["pieces"], fields["slot_epochs"] = g, rows, epochs
            out.append(recipe)
        return out


@dataclass(frozen=True)
class RecipeTable:
    """The recipes of several DP groups of one step, packed into a few arrays.

    What dealing hands back and what a block's construction task gets: pickling a handful of
    arrays costs a fraction of pickling one :class:`Recipe` per group, at thousands of groups
    a step. Recipe i is group ``groups[i]``: its pieces are rows ``piece_bounds[i]:
    piece_bounds[i + 1]`` of ``pieces`` and its shard slots entries ``slot_bounds[i]:
    slot_bounds[i + 1]`` of ``slot_reads`` (which read each slot is, an index into a list of
    reads kept beside the table) and ``slot_epochs``::

        groups [0 1]  piece_bounds [0 2 3]  slot_bounds [0 2 3]  slot_reads [4 1 1]
        -> recipe 0: pieces rows 0-1, slots 0, 1 = reads 4, 1;  recipe 1: row 2, slot 0 = read 1
    """

    step: int
    groups: np.ndarray  # int64 (n,)
    piece_bounds: np.ndarray  # int64 (n + 1,)
    pieces: np.ndarray  # int64 (pieces, 5), as Recipe.pieces
    slot_bounds: np.ndarray  # int64 (n + 1,)
    slot_reads: np.ndarray  # int64 (slots,)
    slot_epochs: np.ndarray  # int64 (slots,)
    num_micro_steps: int
    seq_len: int
    pad_to_seq_len: bool = False
    micro_seq_lens: tuple[int, ...] = ()
    patch_size: int = 0
    global_loss_tokens: int = -1  # the step's, over all its groups (not only these)
    stage: int = -1  # the step's training stage (-1: the job's batch has no stages)
    stages_version: int = 0  # live stage changes the step was cut after (see Recipe)

    def __len__(self) -> int:
        return len(self.groups)

    ARRAYS = ("groups", "piece_bounds", "pieces", "slot_bounds", "slot_reads", "slot_epochs")

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # one frame to Dask, not six
        return packed_reduce(self, self.ARRAYS)

    def recipe(self, i: int) -> Recipe:
        """Recipe i (its shard slots numbered from 0, as :func:`build` takes them)."""
        lo, hi = int(self.slot_bounds[i]), int(self.slot_bounds[i + 1])
        return Recipe(
            step=self.step,
            group=int(self.groups[i]),
            num_micro_steps=self.num_micro_steps,
            pieces=self.pieces[int(self.piece_bounds[i]) : int(self.piece_bounds[i + 1])],
            seq_len=self.seq_len,
            slot_epochs=tuple(self.slot_epochs[lo:hi].tolist()),
            pad_to_seq_len=self.pad_to_seq_len,
            micro_seq_lens=self.micro_seq_lens,
            patch_size=self.patch_size,
            global_loss_tokens=self.global_loss_tokens,
            stage=self.stage,
            stages_version=self.stages_version,
        )

    def reads_of(self, i: int) -> np.ndarray:
        """Recipe i's reads, one per shard slot in order (indices into the reads list)."""
        return self.slot_reads[int(self.slot_bounds[i]) : int(self.slot_bounds[i + 1])]

    def select(self, rows: np.ndarray) -> RecipeTable:
        """The recipes ``rows`` (ascending) alone, their reads renumbered 0.. in order of first
        use (:meth:`used_reads` gives the old numbers in that order)."""
        return self.select_reads(rows)[0]

    def used_reads(self, rows: np.ndarray) -> np.ndarray:
        """The reads recipes ``rows`` use, in the order :meth:`select` numbers them."""
        return self.select_reads(rows)[1]

    def select_reads(self, rows: np.ndarray) -> tuple[RecipeTable, np.ndarray]:
        """:meth:`select` and :meth:`used_reads` at once (a block's construction needs both).

        A block's groups are usually a run of consecutive recipes: their rows are one slice
        of each array; any other choice is gathered in one index per array, never a loop
        over the recipes."""
        rows = np.asarray(rows, dtype=np.int64)
        pieces_at, piece_bounds = ranges(self.piece_bounds, rows)
        slots_at, slot_bounds = ranges(self.slot_bounds, rows)
        used, renumbered = first_use(self.slot_reads[slots_at])
        table = replace(
            self,
            groups=self.groups[rows],
            piece_bounds=piece_bounds,
            pieces=self.pieces[pieces_at],
            slot_bounds=slot_bounds,
            slot_reads=renumbered,
            slot_epochs=self.slot_epochs[slots_at],
        )
        return table, used

    def select_runs(self, bounds: np.ndarray) -> list[tuple[RecipeTable, np.ndarray]]:
        """:meth:`select_reads` of each run of recipes ``bounds[b]:bounds[b + 1]`` (a step's
        blocks; empty runs skipped), numbering every run's reads in one pass over all their
        slots: ``bounds [0 2 4]  ->  [select_reads([0 1]), select_reads([2 3])]``."""
        bounds = np.asarray(bounds, dtype=np.int64)
        slot_at = self.slot_bounds[bounds]
        slots = self.slot_reads[int(slot_at[0]) : int(slot_at[-1])]
        runs = len(bounds) - 1
        width = int(slots.max(initial=-1)) + 1
        run_of = np.repeat(np.arange(runs, dtype=np.int64), np.diff(slot_at))
        used, renumbered = first_use(run_of * width + slots)
        # (first uses are in slot order, so the used reads come run by run)
        used_at = np.searchsorted(used // max(width, 1), np.arange(runs + 1))
        used = used % max(width, 1)
        out = []
        base = int(slot_at[0])
        rows, slot_list = bounds.tolist(), slot_at.tolist()
        piece_list, used_list = self.piece_bounds[bounds].tolist(), used_at.tolist()
        for b in range(runs):
            lo, hi = rows[b], rows[b + 1]
            if hi <= lo:
                continue
            s_lo, s_hi = slot_list[b], slot_list[b + 1]
            p_lo, p_hi = piece_list[b], piece_list[b + 1]
            # (the numbers of the reads count from the runs before: less their reads)
            table = replace(
                self,
                groups=self.groups[lo:hi],
                piece_bounds=self.piece_bounds[lo : hi + 1] - p_lo,
                pieces=self.pieces[p_lo:p_hi],
                slot_bounds=self.slot_bounds[lo : hi + 1] - s_lo,
                slot_reads=renumbered[s_lo - base : s_hi - base] - used_list[b],
                slot_epochs=self.slot_epochs[s_lo:s_hi],
            )
            out.append((table, used[used_list[b] : used_list[b + 1]]))
        return out


@dataclass
class GroupBatch:
    """The micro-batches of one DP group for one step (numpy arrays)."""

    step: int
    group: int
    micro_batches: list[dict[str, Any]]

    @property
    def num_tokens(self) -> int:
        """Tokens in all its micro-batches (padding not counted)."""
        return sum(int(mb["num_tokens"]) for mb in self.micro_batches)


def build(recipe: Recipe, shards: list[Shard], wire: bool = False) -> GroupBatch:
    """Pack the recipe's document pieces into micro-batches (pure numpy, no I/O); in wire form
    (see the module docstring) if ``wire``."""
    micro_batches = []
    pieces = recipe.pieces
    for m in range(recipe.num_micro_steps):
        rows = pieces[pieces[:, 0] == m]
        micro_batches.append(_micro_batch(recipe, m, rows, shards, wire))
    return GroupBatch(step=recipe.step, group=recipe.group, micro_batches=micro_batches)


def _micro_batch(
    recipe: Recipe, m: int, rows: np.ndarray, shards: list[Shard], wire: bool
) -> dict[str, Any]:
    n = len(rows)
    lengths = (rows[:, 4] - rows[:, 3]).astype(np.int64)
    cu = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    total = int(cu[-1])
    width = recipe.capacity(m) if recipe.pad_to_seq_len else total
    compact = wire and 0 <= recipe.pad_id < 2**32
    input_ids = np.full(width, recipe.pad_id, dtype=np.uint32 if compact else np.int64)
    doc_source = np.empty(n, dtype=np.int32)
    doc_id = np.empty(n, dtype=np.int64)
    doc_epoch = np.zeros(n, dtype=np.int32)
    masked = any(shards[slot].target is not None for slot in set(rows[:, 1].tolist()))
    target = np.ones(width, dtype=bool) if masked else None
    for j, (_, slot, row, lo, hi) in enumerate(rows.tolist()):
        shard = shards[slot]
        base = int(shard.offsets[row])
        input_ids[cu[j] : cu[j + 1]] = shard.tokens[base + lo : base + hi]
        if target is not None and shard.target is not None:
            target[cu[j] : cu[j + 1]] = shard.target[base + lo : base + hi]
        doc_source[j] = shard.source
        doc_id[j] = shard.sample_ids[row]
        if recipe.slot_epochs:
            doc_epoch[j] = recipe.slot_epochs[slot]
    images = _images(recipe, rows, shards, cu, width) if recipe.patch_size else {}
    extra: dict[str, Any] = {}
    if recipe.global_loss_tokens >= 0:
        extra["global_loss_tokens"] = recipe.global_loss_tokens
    if recipe.stage >= 0:
        extra["stage"] = recipe.stage
    if recipe.stages_version:  # (a job whose stages never changed live: no field)
        extra["stages_version"] = recipe.stages_version
    token_map = images.get("image_token_map")
    if not compact:
        position_ids, labels = derived(input_ids, cu, total, token_map, target)
        extra.update(labels=labels, position_ids=position_ids)
    elif target is not None:
        extra["target_bits"] = np.packbits(target)
    return {
        "input_ids": input_ids,
        **extra,
        "cu_seqlens": cu,
        "max_seqlen": int(lengths.max()) if n else 0,
        "num_tokens": total,
        "num_loss_tokens": int(loss_positions(cu, total, token_map, target).sum()),
        "doc_source": doc_source,
        "doc_id": doc_id,
        "doc_offset": rows[:, 3].astype(np.int64),
        "doc_epoch": doc_epoch,
        "seq_len": recipe.capacity(m),
        "step": recipe.step,
        "micro_step": m,
        "num_micro_steps": recipe.num_micro_steps,
        "dp_rank": recipe.group,
        **images,
    }


def _images(
    recipe: Recipe, rows: np.ndarray, shards: list[Shard], cu: np.ndarray, width: int
) -> dict[str, Any]:
    """The image fields of one micro-batch (module docstring): every image with tokens here."""
    p = recipe.patch_size
    token_map = np.full(width, -1, dtype=np.int64)
    patches: list[np.ndarray] = []
    grid: list[np.ndarray] = []
    n_patches: list[int] = []
    n_tokens: list[int] = []
    positions: list[int] = []
    docs: list[int] = []
    index: list[int] = []
    total_tokens = 0  # tokens of the images so far: where the next one's start in the output
    for j, (_, slot, row, lo, hi) in enumerate(rows.tolist()):
        table = shards[slot].images
        if table is None:
            continue
        found = table.of_record(row)
        for i in found:
            start = int(table.token_start[i])
            stop = start + int(table.tokens[i])
            here_lo, here_hi = max(start, lo), min(stop, hi)
            if here_lo >= here_hi:
                continue
            base = total_tokens + here_lo - start
            at = int(cu[j]) + here_lo - lo
            token_map[at : at + here_hi - here_lo] = np.arange(base, base + here_hi - here_lo)
            patches.append(table.patches[table.cu_patches[i] : table.cu_patches[i + 1]])
            grid.append(table.grid[i])
            n_patches.append(int(table.cu_patches[i + 1] - table.cu_patches[i]))
            n_tokens.append(stop - start)
            total_tokens += stop - start
            positions.append(at)
            docs.append(j)
            index.append(i - found.start)
    return {
        "pixel_patches": (
            np.concatenate(patches) if patches else np.zeros((0, p, p, 3), dtype=np.uint8)
        ),
        "image_grid_hw": np.asarray(grid, dtype=np.int32).reshape(-1, 2),
        "image_cu_patches": _cumulative(n_patches),
        "image_cu_tokens": _cumulative(n_tokens),
        "image_token_map": token_map,
        "image_positions": np.asarray(positions, dtype=np.int64),
        "image_doc": np.asarray(docs, dtype=np.int32),
        "image_index": np.asarray(index, dtype=np.int32),
    }


def _cumulative(sizes: list[int]) -> np.ndarray:
    out = np.zeros(len(sizes) + 1, dtype=np.int32)
    np.cumsum(sizes, out=out[1:])
    return out
