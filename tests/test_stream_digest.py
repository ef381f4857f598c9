"""The stream of every plan in ``plans/`` is pinned by a stored digest.

A refactor must not change which samples form a batch, how they are packed or split among the
DP groups. Each plan runs on the demo data (written into a temporary folder) through the pure
data plane for ``STEPS`` steps; every DP group's batch of every step goes into one SHA-256.

A change that is *meant* to change a stream updates ``stream_digests.json`` with::

    python -m tests.test_stream_digest --update

and says in its commit message why the stream changed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from omniload_dask.plan import load_plan
from omniload_dask.testing import InlineDataPlane, batch_digest

PLANS = Path(__file__).resolve().parent.parent / "plans"
DIGESTS = Path(__file__).resolve().parent / "stream_digests.json"
STEPS = 24
NAMES = sorted(p.name for p in PLANS.glob("*.yaml"))


def stream_digest(plan_file: Path, folder: Path) -> str:
    """SHA-256 over the first ``STEPS`` steps of ``plan_file`` run on demo data in ``folder``."""
    from omniload_dask.demo import make_demo_data

    make_demo_data(folder / "demo-data")
    copy = folder / plan_file.name
    shutil.copy(plan_file, copy)
    plan = load_plan(copy)
    if plan.checkpoint is not None:  # the digest is of the stream, not of a checkpoint
        plan = type(plan)(**{**vars(plan), "checkpoint": None})
    h = hashlib.sha256()
    for t, batches in InlineDataPlane(plan).stream(STEPS):
        for g in sorted(batches):
            h.update(json.dumps([t, g, batch_digest(batches[g])]).encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("digest")


@pytest.mark.parametrize("name", NAMES)
def test_every_plan_streams_exactly_as_the_stored_digest(name: str, demo_folder: Path) -> None:
    stored = json.loads(DIGESTS.read_text())
    assert name in stored, f"no stored digest for plans/{name}: run with --update"
    assert stream_digest(PLANS / name, demo_folder) == stored[name]


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.test_stream_digest --update")
    with tempfile.TemporaryDirectory() as tmp:
        out = {name: stream_digest(PLANS / name, Path(tmp)) for name in NAMES}
    DIGESTS.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps(out, indent=2))
