from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omniload_dask.batching.mixing import HORIZON_BATCHES, Mixer, NeedMore, Selection


def draw_many(mixer: Mixer, weights, lengths_of, steps: int, **budget) -> np.ndarray:
    """Draw ``steps`` batches from endless sources; return tokens (or docs) per source."""
    pos = [0] * len(weights)
    got = np.zeros(len(weights))
    for _ in range(steps):
        cands = [lengths_of[i][pos[i] : pos[i] + 400] for i in range(len(weights))]
        sel = mixer.select(np.asarray(weights, float), cands, [True] * len(weights), **budget)
        assert isinstance(sel, Selection)
        mixer.commit(sel)
        for i, (s, k) in enumerate(sel.order.tolist()):
            del i
            got[s] += cands[s][k] if mixer.by == "tokens" else 1
        for s, c in enumerate(sel.counts.tolist()):
            pos[s] += c
    return got


def streams(seed: int, n: int = 3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, [50, 400, 2000][i % 3], 200_000) for i in range(n)]


@pytest.mark.parametrize("by", ["tokens", "documents"])
def test_realised_shares_track_weights_within_half_a_point(by):
    weights = [0.5, 0.3, 0.2]
    mixer = Mixer(3, by)
    got = draw_many(mixer, weights, streams(0), 300, budget_tokens=8192)
    share = got / got.sum()
    assert np.abs(share - np.asarray(weights)).max() < 0.005


def test_documents_budget_takes_exactly_n_documents():
    mixer = Mixer(2, "documents")
    cands = [np.full(100, 5), np.full(100, 7)]
    sel = mixer.select(np.array([3.0, 1.0]), cands, [True, True], budget_documents=8)
    assert isinstance(sel, Selection)
    assert sel.counts.tolist() == [6, 2]


def test_worked_example_from_the_docstring():
    mixer = Mixer(2, "documents")
    sel = mixer.select(
        np.array([3.0, 1.0]), [np.ones(10), np.ones(10)], [True, True], budget_documents=4
    )
    assert sel.order.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0]]


def test_token_budget_stops_at_first_document_that_does_not_fit():
    mixer = Mixer(1, "tokens")
    sel = mixer.select(np.array([1.0]), [np.array([40, 40, 30, 5])], [True], budget_tokens=100)
    assert sel.counts.tolist() == [2]  # 40 + 40, then 30 does not fit: it leads the next batch


def test_needs_more_when_a_truncated_source_could_change_the_batch():
    mixer = Mixer(2, "documents")
    sel = mixer.select(
        np.array([1.0, 1.0]), [np.ones(2), np.ones(100)], [True, True], budget_documents=10
    )
    assert isinstance(sel, NeedMore) and sel.sources == (0,)
    sel = mixer.select(
        np.array([1.0, 1.0]), [np.zeros(0), np.ones(100)], [True, True], budget_documents=10
    )
    assert isinstance(sel, NeedMore) and sel.sources == (0,)


def test_zero_weight_sources_are_never_drawn():
    mixer = Mixer(2, "tokens")
    sel = mixer.select(
        np.array([1.0, 0.0]), [np.ones(50), np.ones(50)], [True, True], budget_tokens=20
    )
    assert sel.counts.tolist() == [20, 0]


def test_selection_is_deterministic_and_state_round_trips():
    a, b = Mixer(3, "tokens"), Mixer(3, "tokens")
    s = streams(1)
    draw_many(a, [1, 2, 3], s, 20, budget_tokens=4096)
    b.load_state_dict(a.state_dict())
    cands = [x[:300] for x in s]
    ra = a.select(np.array([1.0, 2, 3]), cands, [True] * 3, budget_tokens=4096)
    rb = b.select(np.array([1.0, 2, 3]), cands, [True] * 3, budget_tokens=4096)
    assert np.array_equal(ra.order, rb.order)


def test_a_document_that_does_not_fit_closes_only_its_source():
    # web's 90 does not fit after 80 tokens of code: code fills the last 20 tokens instead of
    # leaving them as padding, and web's 90 leads the next batch.
    mixer = Mixer(2, "tokens")
    cands = [np.array([90, 5, 80]), np.full(20, 10)]
    sel = mixer.select(np.array([1.0, 1.0]), cands, [True, True], budget_tokens=100)
    assert isinstance(sel, Selection)
    assert sel.counts.tolist() == [0, 10]
    mixer.commit(sel)
    nxt = mixer.select(
        np.array([1.0, 1.0]), [cands[0], cands[1][10:]], [True, True], budget_tokens=100
    )
    assert isinstance(nxt, Selection) and nxt.order[0].tolist() == [0, 0]


@settings(max_examples=150, deadline=None)
@given(
    weights=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    budget=st.integers(64, 3000),
    shown=st.lists(st.integers(0, 60), min_size=4, max_size=4),
    mode=st.sampled_from(["fill", "cut", "chunks"]),
)
def test_token_batches_are_maximal_and_independent_of_how_much_is_shown(
    weights, seed, budget, shown, mode
):
    rng = np.random.default_rng(seed)
    n = len(weights)
    w = np.asarray(weights)
    full = [rng.integers(1, 64 if i % 2 else budget + 1, 400) for i in range(n)]
    how = {"cut": mode != "fill", "chunk": 100 if mode == "chunks" else None}
    ref = Mixer(n, "tokens").select(w, full, [True] * n, budget_tokens=budget, **how)
    assert isinstance(ref, Selection)
    taken = ref.taken.tolist() if ref.taken is not None else None
    got_tokens = 0
    for row, (s, k) in enumerate(ref.order.tolist()):
        here = taken[row] if taken is not None else int(full[s][k])
        assert 0 < here <= full[s][k]
        if here < full[s][k]:  # only a source's last document may be cut
            assert k == ref.counts[s] - 1 and ref.cut.get(s) == here
        got_tokens += here
    assert got_tokens <= budget
    tags = [np.cumsum(f) / x for f, x in zip(full, w, strict=True)]
    next_tag = [tags[s][ref.counts[s] - (1 if s in ref.cut else 0)] for s in range(n)]
    horizon = min(next_tag) + HORIZON_BATCHES * budget / w.sum()
    for s in range(n):  # each source gives a prefix of its stream, in stream order
        assert sorted(k for src, k in ref.order.tolist() if src == s) == list(
            range(int(ref.counts[s]))
        )
        if mode != "fill":  # split: the batch is exactly full, what did not fit continues
            assert got_tokens == budget
        else:  # maximal: every source's next document is too long for the room left, or
            # beyond the horizon the fill may reach
            assert full[s][ref.counts[s]] > budget - got_tokens or next_tag[s] > horizon
    # Showing fewer candidates, and more of those named by NeedMore (as the coordinator does),
    # ends in the same batch.
    shown = shown[:n]
    while True:
        part = [full[i][: shown[i]] for i in range(n)]
        got = Mixer(n, "tokens").select(w, part, [True] * n, budget_tokens=budget, **how)
        if isinstance(got, Selection):
            break
        assert got.sources and all(shown[i] < 400 for i in got.sources)
        for i in got.sources:
            shown[i] = min(400, 2 * shown[i] + 1)
    assert np.array_equal(got.order, ref.order)
    assert (got.taken is None) == (ref.taken is None)
    assert got.taken is None or np.array_equal(got.taken, ref.taken)


def test_an_exactly_full_batch_needs_no_more_candidates_than_its_own():
    # Tags: source 0 at 50, 99, 104; source 1 at 1, then 101. 1 + 50 + 49 tokens fill the
    # budget exactly, so the batch is settled once every source is known past tag 99 (the last
    # document taken): source 1's unseen documents come after 101. Nothing after 99 can fit, so
    # the document at 104 need not be preceded by known ones.
    mixer = Mixer(2, "tokens")
    cands = [np.array([50, 49, 5]), np.array([1])]
    sel = mixer.select(np.array([1.0, 1.0]), cands, [True, True], budget_tokens=100)
    assert isinstance(sel, NeedMore) and sel.sources == (1,)  # source 1 could still precede 99
    cands = [np.array([50, 49, 5]), np.array([1, 100])]
    sel = mixer.select(np.array([1.0, 1.0]), cands, [True, True], budget_tokens=100)
    assert isinstance(sel, Selection) and sel.counts.tolist() == [2, 1]


def _merge_by_document(chunks, chosen, taken, tags, num_sources):
    """What ``_Chunks.selection`` must give, written the plain way (a loop over the pieces)."""
    rows: dict[int, list] = {}
    for i, item in enumerate(chosen.tolist()):
        d = int(chunks.item_doc[item])
        if d not in rows:
            rows[d] = [int(chunks.srcs[item]), int(chunks.docs[item]), 0, -np.inf]
        rows[d][2] += int(taken[i])
        rows[d][3] = max(rows[d][3], float(tags[i]))
    counts = np.bincount([r[0] for r in rows.values()], minlength=num_sources)
    cut = {r[0]: r[2] for d, r in rows.items() if r[2] < chunks.doc_lengths[d]}
    tags_of = [r[3] for r in rows.values()]
    return [r[:2] for r in rows.values()], [r[2] for r in rows.values()], tags_of, counts, cut


@pytest.mark.parametrize("in_tag_order", [True, False])
def test_pieces_of_a_document_merge_into_one_row_where_it_first_appears(in_tag_order):
    # In tag order every piece follows its document's first piece (the path without a sort);
    # any other order of the chosen pieces takes the sorted path; both must agree with a loop.
    from omniload_dask.batching.mixing import _Chunks

    rng = np.random.default_rng(7)
    for _ in range(200):
        shown = [(i, rng.integers(1, 30_000, int(rng.integers(1, 30)))) for i in range(3)]
        going = [bool(rng.random() < 0.3) for _ in shown]
        chunks = _Chunks.of(shown, going, 8192, by_documents=False)
        tags = chunks.within / np.asarray([1.0, 0.5, 2.0])[chunks.srcs]
        order = np.lexsort((chunks.srcs, tags)) if in_tag_order else rng.permutation(len(tags))
        chosen = order[: int(rng.integers(1, len(order) + 1))]
        taken = chunks.lengths[chosen].copy()
        taken[-1] = max(1, taken[-1] // 2)  # the last piece may be cut
        sel = chunks.selection(chosen, taken, tags[chosen], 3)
        rows, row_taken, row_tags, counts, cut = _merge_by_document(
            chunks, chosen, taken, tags[chosen], 3
        )
        assert sel.order.tolist() == rows
        assert sel.taken.tolist() == row_taken
        assert sel.tags.tolist() == row_tags  # a document's tag is its last piece's
        assert sel.counts.tolist() == counts.tolist()
        assert sel.cut == cut


def test_documents_mix_under_a_token_budget_draws_the_same_whatever_each_source_shows(
    tmp_path, monkeypatch
):
    """With ``mixing.by: documents`` and a token budget, the draw asks each source for its
    expected share of the tokens (from its documents' mean length); what it shows the mixer
    must not change the stream: the same batches as asking by weight alone."""
    from omniload_dask.core.draw import Drawer
    from omniload_dask.plan import parse_plan
    from omniload_dask.testing import InlineDataPlane, batch_digest

    from .datagen import plan_dict, texts, write_jsonl

    for i in range(2):
        write_jsonl(tmp_path / "short" / f"{i}.jsonl", texts(300, seed=i, mean_words=3))
        write_jsonl(tmp_path / "long" / f"{i}.jsonl", texts(20, seed=10 + i, mean_words=300))
    sources = [{"name": n, "format": "jsonl", "path": str(tmp_path / n / "*.jsonl"),
                "weight": w} for n, w in (("short", 0.8), ("long", 0.2))]  # fmt: skip
    plan = parse_plan(plan_dict(sources, mixing={"by": "documents"}))

    def digests() -> list[list[tuple[int, ...]]]:
        plane = InlineDataPlane(plan)
        return [batch_digest(b) for _, batches in plane.stream(12) for b in batches.values()]

    asked: list[float] = []
    shares = Drawer._token_shares

    def record(self, weights):  # type: ignore[no-untyped-def]
        out = shares(self, weights)
        asked.append(float(out[1]))
        return out

    monkeypatch.setattr(Drawer, "_token_shares", record)
    by_length = digests()
    # the long source's share of the tokens is far above its 0.2 of the documents
    assert max(asked) > 0.5
    monkeypatch.setattr(Drawer, "_token_shares", lambda self, w: w / w.sum())
    assert digests() == by_length
