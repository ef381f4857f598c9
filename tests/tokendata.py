"""Token corpora written by the tools their users write them with (megatron-core's
``IndexedDatasetBuilder``, ``datasets``' ``save_to_disk`` and ``to_parquet``, ``streaming``'s
``MDSWriter``, numpy for nanoGPT-style flat arrays), and what each tool wrote, to compare.

Ids stay below 256 so the byte tokenizer's vocabulary (258) is the plan's; 257 is its EOS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
VOCAB = {"size": 258, "eos_id": 257}


def documents(n: int, seed: int, longest: int = 120) -> list[np.ndarray]:
    """``n`` documents of 1..``longest`` ids in [0, 256)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, rng.integers(1, longest + 1)) for _ in range(n)]


def write_megatron(prefix: Path, docs: list[np.ndarray], dtype: type = np.uint16) -> Path:
    """An IndexedDataset pair; every third document of two sequences (``add_document``)."""
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = indexed.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for i, doc in enumerate(docs):
        if i % 3 == 2 and len(doc) > 1:
            cut = len(doc) // 2
            builder.add_document(torch.tensor(doc), [cut, len(doc) - cut])
        else:
            builder.add_item(torch.tensor(doc))
            builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return Path(str(prefix) + ".idx")


def megatron_documents(prefix: Path) -> list[np.ndarray]:
    """Every document as megatron-core's own IndexedDataset reads it back."""
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    ds = indexed.IndexedDataset(str(prefix))
    out = []
    bounds = ds.document_indices
    for d in range(len(bounds) - 1):
        seqs = [np.asarray(ds[s]) for s in range(int(bounds[d]), int(bounds[d + 1]))]
        out.append(np.concatenate(seqs) if seqs else np.zeros(0, np.int64))
    return out


def write_arrow(folder: Path, docs: list[np.ndarray], shard: str = "8KB") -> Path:
    """A ``save_to_disk`` folder: ``input_ids`` (token lists) and ``text`` columns."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [d.tolist() for d in docs],
            "text": [f"document {i}: " + "x" * (i % 17) for i in range(len(docs))],
        }
    )
    ds.save_to_disk(str(folder), max_shard_size=shard)
    return folder


def arrow_documents(folder: Path) -> tuple[list[list[int]], list[str]]:
    """What ``load_from_disk`` gives back: the token lists and texts in order."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.load_from_disk(str(folder))
    return list(ds["input_ids"]), list(ds["text"])


def write_token_parquet(path: Path, docs: list[np.ndarray]) -> Path:
    """Parquet written by ``datasets``' ``to_parquet`` with an ``input_ids`` column."""
    datasets = pytest.importorskip("datasets")
    path.parent.mkdir(parents=True, exist_ok=True)
    ds = datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]})
    ds.to_parquet(str(path), batch_size=40)
    return path


def import_streaming():  # type: ignore[no-untyped-def]
    """``streaming`` as the benchmarks import it (installed by setup-thirdparty.sh)."""
    for where in (BENCH / ".thirdparty", BENCH):
        if str(where) not in sys.path:
            sys.path.insert(0, str(where))
    try:
        from support.baselines import import_streaming as load
    except ImportError as exc:  # pragma: no cover - the bench helpers are in the repository
        pytest.skip(f"benchmarks/support/baselines.py: {exc}")
    try:
        return load()[0]
    except ImportError as exc:
        pytest.skip(
            f"mosaicml-streaming not importable ({exc}); run benchmarks/setup-thirdparty.sh"
        )


def write_mds(
    folder: Path, docs: list[np.ndarray], encoding: str = "ndarray:uint16", **kw: object
) -> Path:
    """An MDS dataset by ``MDSWriter``: a ``tokens`` and a ``text`` column, small shards."""
    streaming = import_streaming()
    dtype = encoding.split(":")[1] if ":" in encoding else "uint16"
    with streaming.MDSWriter(
        out=str(folder),
        columns={"tokens": encoding, "text": "str"},
        size_limit=kw.pop("size_limit", 4096),
        **kw,
    ) as writer:
        for i, doc in enumerate(docs):
            writer.write({"tokens": doc.astype(dtype), "text": f"sample {i} " + "y" * (i % 11)})
    return folder


def mds_documents(folder: Path) -> list[np.ndarray]:
    """Every sample's tokens as ``streaming``'s own reader decodes them (no download)."""
    streaming = import_streaming()
    ds = streaming.StreamingDataset(local=str(folder), shuffle=False, batch_size=1)
    return [np.asarray(ds.get_item(i)["tokens"]) for i in range(ds.num_samples)]


def write_flat(path: Path, docs: list[np.ndarray], eod: int, dtype: str = "uint16") -> Path:
    """A nanoGPT-style array: each document then ``eod``; ``.npy`` by ``np.save``, else raw."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ids = np.concatenate([np.append(d, eod) for d in docs]).astype(dtype)
    if path.suffix == ".npy":
        np.save(path, ids)
    else:
        ids.tofile(path)
    return path
