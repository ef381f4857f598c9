"""Deterministic image-text demo data: synthetic pictures in JPEG, PNG and WebP, with captions.

Nothing is downloaded: every image is drawn from a seed (a colour gradient, a few rectangles and
discs, mild noise, so that it compresses like a photo rather than like a flat colour), so every
machine writes the same pixels. ``make_image_demo_data(folder)`` writes::

    images-parquet/captions-0000.parquet   columns image (encoded bytes), caption; row groups of 64
    images-tar/shard-0000.tar              WebDataset-style: 000000.jpg + 000000.txt, ...
    tokenizer-vlm.json                     the demo tokenizer (see demo.vocabulary) plus <image>

Tests and benchmarks use the pieces: :func:`synthetic_image`, :func:`encode_image`,
:func:`write_image_parquet` and :func:`write_image_tar`.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from omniload_dask.demo.vocabulary import VOCAB_SEED, vocabulary, write_tokenizer

__all__ = [
    "caption",
    "encode_image",
    "make_image_demo_data",
    "synthetic_image",
    "write_image_parquet",
    "write_image_tar",
]

MARKER = ".omniload-image-demo-complete"
FORMATS = ("jpeg", "png", "webp")
_WORDS = ["a", "red", "blue", "green", "square", "disc", "over", "under", "bright", "dark", "sky"]


def synthetic_image(seed: int, height: int, width: int) -> np.ndarray:
    """A ``height`` x ``width`` RGB uint8 picture drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 256, (3, 3)).astype(np.float32)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    img = corners[0] + (corners[1] - corners[0]) * x + (corners[2] - corners[0]) * y
    yy, xx = np.ogrid[:height, :width]
    for _ in range(int(rng.integers(2, 6))):
        color = rng.integers(0, 256, 3).astype(np.float32)
        cy, cx = rng.integers(0, height), rng.integers(0, width)
        ry, rx = (
            rng.integers(height // 10 + 1, height // 3 + 2),
            rng.integers(width // 10 + 1, width // 3 + 2),
        )
        if rng.random() < 0.5:
            mask = (np.abs(yy - cy) < ry) & (np.abs(xx - cx) < rx)
        else:
            mask = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
        img[mask] = color
    img += rng.normal(0.0, 6.0, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def encode_image(pixels: np.ndarray, fmt: str, quality: int = 85) -> bytes:
    """``pixels`` encoded as ``jpeg``, ``png`` or ``webp`` bytes."""
    from PIL import Image

    buf = io.BytesIO()
    kind = {"jpeg": "JPEG", "jpg": "JPEG", "png": "PNG", "webp": "WEBP"}[fmt]
    options = {"quality": quality} if kind in ("JPEG", "WEBP") else {"compress_level": 1}
    Image.fromarray(pixels).save(buf, kind, **options)
    return buf.getvalue()


def caption(seed: int, words: int = 12) -> str:
    """The caption of record ``seed``: ``words`` words about colours and shapes."""
    rng = np.random.default_rng([seed, 1])
    return " ".join(_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), words))


def _sizes(seed: int, n: int, lo: int, hi: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng([seed, 2])
    return [(int(rng.integers(lo, hi + 1)), int(rng.integers(lo, hi + 1))) for _ in range(n)]


def _records(
    seed: int, n: int, lo: int, hi: int, formats: Sequence[str]
) -> list[tuple[bytes, str, str]]:
    """``(image bytes, format, caption)`` of records ``seed * 1_000_000 + i``."""
    out = []
    for i, (h, w) in enumerate(_sizes(seed, n, lo, hi)):
        key = seed * 1_000_000 + i
        fmt = formats[i % len(formats)]
        out.append((encode_image(synthetic_image(key, h, w), fmt), fmt, caption(key)))
    return out


def write_image_parquet(
    path: Path,
    n: int,
    seed: int = 0,
    sizes: tuple[int, int] = (48, 160),
    formats: Sequence[str] = FORMATS,
    row_group_size: int = 64,
    bad: dict[int, bytes | None] | None = None,
) -> Path:
    """``n`` records: column ``image`` (encoded bytes) and ``caption``; ``bad`` replaces the
    image bytes of some rows (to plant bad records)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = _records(seed, n, *sizes, formats)
    images: list[bytes | None] = [r[0] for r in records]
    for i, blob in (bad or {}).items():
        images[i] = blob
    table = pa.table(
        {
            "image": pa.array(images, pa.binary()),
            "caption": [r[2] for r in records],
            "format": [r[1] for r in records],
        }
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_image_tar(
    path: Path,
    n: int,
    seed: int = 0,
    sizes: tuple[int, int] = (48, 160),
    formats: Sequence[str] = FORMATS,
    bad: dict[int, bytes | None] | None = None,
) -> Path:
    """A WebDataset-style tar of ``n`` records ``{i:06d}.{jpg|png|webp}`` + ``{i:06d}.txt``;
    ``bad`` replaces some images' bytes (None drops the image file)."""
    records = _records(seed, n, *sizes, formats)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for i, (blob, fmt, text) in enumerate(records):
            ext = "jpg" if fmt == "jpeg" else fmt
            image = bad[i] if bad and i in bad else blob
            files = [(f"{i:06d}.txt", text.encode())]
            if image is not None:
                files.insert(0, (f"{i:06d}.{ext}", image))
            for name, data in files:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.mtime = 0
                tar.addfile(info, io.BytesIO(data))
    return path


def make_image_demo_data(folder: str | Path, scale: float = 1.0) -> Path:
    """Write the image-text demo sources into ``folder`` (skipped if complete); return it."""
    folder = Path(folder)
    if (folder / MARKER).exists():
        return folder
    n = max(8, int(256 * scale))
    for f in range(2):
        write_image_parquet(
            folder / "images-parquet" / f"captions-{f:04d}.parquet", n // 2, seed=10 + f,
            sizes=(96, 384),
        )  # fmt: skip
        write_image_tar(
            folder / "images-tar" / f"shard-{f:04d}.tar", n // 2, seed=20 + f, sizes=(96, 384)
        )
    vocab = vocabulary(np.random.default_rng(VOCAB_SEED))  # the demo's, same ids; <image> last
    write_tokenizer(folder / "tokenizer-vlm.json", [*vocab, "<image>"])
    (folder / MARKER).write_text("ok\n")
    return folder
