"""The stream of every plan in ``plans/`` is pinned by a stored digest.

A refactor must not change which samples form a batch, how they are packed or split among the
DP groups. Each plan runs on the demo data (written into a temporary folder) through the pure
data plane for ``STEPS`` steps; every DP group's batch of every step goes into one SHA-256.

A change that is *meant* to change a stream updates ``stream_digests.json`` with::

    python -m tests.test_stream_digest --update

and says in its commit message why the stream changed.

A second digest pins only *which* samples form each step: per step, the sorted multiset of
(source, epoch, sample id, tokens of it in the step), over all the DP groups together
(``step_documents.json``). How a step is split among the groups and packed into micro-batches
may change it never (DESIGN.md: the DP size only changes how a global batch is split); only a
change to the draw itself (the mixer, the streams) may, with::

    python -m tests.test_stream_digest --update-documents
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from omniload_dask.plan import load_plan
from omniload_dask.testing import InlineDataPlane, batch_digest

PLANS = Path(__file__).resolve().parent.parent / "plans"
DIGESTS = Path(__file__).resolve().parent / "stream_digests.json"
DOCUMENTS = Path(__file__).resolve().parent / "step_documents.json"
STEPS = 24
NAMES = sorted(p.name for p in PLANS.glob("*.yaml"))


def stream_digests(plan_file: Path, folder: Path, together: int = 1) -> tuple[str, str]:
    """SHA-256 over the first ``STEPS`` steps of ``plan_file`` run on demo data in ``folder``:
    of every group's batches, and of the documents of each step (module doc). ``together``:
    steps dealt side by side (as the scheduler plugin's dealing thread does)."""
    from omniload_dask.demo import make_demo_data

    make_demo_data(folder / "demo-data")
    copy = folder / plan_file.name
    shutil.copy(plan_file, copy)
    plan = load_plan(copy)
    if plan.checkpoint is not None:  # the digest is of the stream, not of a checkpoint
        plan = type(plan)(**{**vars(plan), "checkpoint": None})
    h = hashlib.sha256()
    docs = hashlib.sha256()
    for t, batches in InlineDataPlane(plan, together=together).stream(STEPS):
        tokens: Counter[tuple[int, int, int]] = Counter()
        for g in sorted(batches):
            h.update(json.dumps([t, g, batch_digest(batches[g])]).encode())
            for mb in batches[g].micro_batches:
                sizes = np.diff(mb["cu_seqlens"]).tolist()
                keys = zip(mb["doc_source"].tolist(), mb["doc_epoch"].tolist(),
                           mb["doc_id"].tolist(), strict=True)  # fmt: skip
                for key, n in zip(keys, sizes, strict=True):
                    tokens[key] += n
        docs.update(json.dumps([t, sorted([*k, n] for k, n in tokens.items())]).encode())
    return h.hexdigest(), docs.hexdigest()


_SEEN: dict[str, tuple[str, str]] = {}


def _digests(name: str, folder: Path) -> tuple[str, str]:
    if name not in _SEEN:  # both tests read one run of each plan
        _SEEN[name] = stream_digests(PLANS / name, folder)
    return _SEEN[name]


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("digest")


@pytest.mark.parametrize("name", NAMES)
def test_every_plan_streams_exactly_as_the_stored_digest(name: str, demo_folder: Path) -> None:
    stored = json.loads(DIGESTS.read_text())
    assert name in stored, f"no stored digest for plans/{name}: run with --update"
    assert _digests(name, demo_folder)[0] == stored[name]


@pytest.mark.parametrize("name", NAMES)
def test_steps_dealt_together_stream_as_the_stored_digest(name: str, demo_folder: Path) -> None:
    # The scheduler plugin draws up to dealing.STEPS_AT_ONCE steps and deals them together.
    from omniload_dask.cluster.dealing import STEPS_AT_ONCE

    stored = json.loads(DIGESTS.read_text())
    assert stream_digests(PLANS / name, demo_folder / "together", STEPS_AT_ONCE)[0] == stored[name]


@pytest.mark.parametrize("name", NAMES)
def test_every_step_holds_the_same_samples_however_it_is_split(
    name: str, demo_folder: Path
) -> None:
    stored = json.loads(DOCUMENTS.read_text())
    assert name in stored, f"no stored digest for plans/{name}: run with --update-documents"
    assert _digests(name, demo_folder)[1] == stored[name]


if __name__ == "__main__":
    import tempfile

    which = {"--update": (0, DIGESTS), "--update-documents": (1, DOCUMENTS)}
    if len(sys.argv) != 2 or sys.argv[1] not in which:
        sys.exit("usage: python -m tests.test_stream_digest --update | --update-documents")
    index, target = which[sys.argv[1]]
    with tempfile.TemporaryDirectory() as tmp:
        out = {name: stream_digests(PLANS / name, Path(tmp))[index] for name in NAMES}
    target.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps(out, indent=2))
