"""Images: decode with Pillow, resize to a patch grid (NaViT-style variable resolution), patchify.

Every image keeps (close to) its own aspect ratio and resolution: it is resized so that both
sides are multiples of ``factor = patch_size * merge`` and its area lies within the plan's
``[min_pixels, max_pixels]``, then cut into ``patch_size`` x ``patch_size`` RGB patches. The
patches are ordered so that each ``merge`` x ``merge`` window is contiguous, so the encoder's
outputs merge into tokens by taking consecutive groups of ``merge**2``::

    patch 14, merge 2, a 100 x 60 image (h x w) -> factor 28
    target size  round(100/28)*28 = 112, round(60/28)*28 = 56   (112 * 56 = 6272 >= 3136)
    grid         112/14 = 8 rows, 56/14 = 4 columns = 32 patches of 14 x 14 x 3 uint8
    tokens       32 / 2**2 = 8 placeholder tokens in the document
    patch order  windows row-major; inside a window its 2 x 2 patches row-major:
                 (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) (1,2) (1,3) | (2,0) ...

An image that Pillow cannot read (not an image, an unsupported format, truncated data) or that
has more than ``max_input_pixels`` pixels before resizing raises :class:`BadImage`; the read
task turns that into a bad record, which the plan's ``on_error`` raises or skips and counts.
"""

from __future__ import annotations

import io
import math
import warnings
from typing import Any

import numpy as np

from omniload_dask.plan import ImageSpec

__all__ = [
    "FORMATS",
    "BadImage",
    "aspect_error",
    "decode",
    "patchify",
    "target_size",
    "tokens_of",
]

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")  # what Pillow may open (others are bad records)
_ORIENTATION = 0x0112  # EXIF tag: 5..8 mean the stored image is transposed


class BadImage(ValueError):
    """An image that cannot be used; the message says why (for the bad-record report)."""


def target_size(height: int, width: int, spec: ImageSpec) -> tuple[int, int]:
    """``(H, W)``: multiples of ``spec.factor``, ``H * W <= max_pixels``, aspect kept.

    The image is scaled to an area within ``[min_pixels, max_pixels]`` and each side rounded to
    the grid, as Qwen2-VL's resize does; where rounding leaves that range, the side is rounded
    the other way, whichever keeps the aspect ratio best. Either way the aspect ratio stays
    within one grid step (``factor`` pixels) of the image's: ``min(|W - H * w / h|, |H - W * h
    / w|) <= factor``. ``H * W >= min_pixels`` too, except when the grid cannot also stay
    within ``max_pixels``; a side shorter than one grid step after scaling gets one.
    """
    f = spec.factor
    if height < 1 or width < 1:
        raise BadImage(f"image has no pixels ({width} x {height})")
    area = height * width
    scale = math.sqrt(min(max(area, spec.min_pixels), spec.max_pixels) / area)
    hs, ws = height * scale / f, width * scale / f  # the ideal sides, in grid steps
    h, w = max(1, round(hs)) * f, max(1, round(ws)) * f
    if spec.min_pixels <= h * w <= spec.max_pixels:
        return h, w
    fits = [
        (h, w)
        for h in {max(1, math.floor(hs)) * f, max(1, math.ceil(hs)) * f}
        for w in {max(1, math.floor(ws)) * f, max(1, math.ceil(ws)) * f}
        if spec.min_pixels <= h * w <= spec.max_pixels
    ]
    if fits:
        return min(fits, key=lambda c: (aspect_error(height, width, *c), -c[0] * c[1]))
    while h * w > spec.max_pixels and max(h, w) > f:  # no grid fits both limits: stay within max
        if h >= w:
            h -= f
        else:
            w -= f
    while h * w < spec.min_pixels:  # grow the shorter side while max_pixels allows
        if h <= w and (h + f) * w <= spec.max_pixels:
            h += f
        elif h * (w + f) <= spec.max_pixels:
            w += f
        elif (h + f) * w <= spec.max_pixels:
            h += f
        else:
            break
    return h, w


def aspect_error(height: int, width: int, h: int, w: int) -> float:
    """How far an ``h`` x ``w`` resize of a ``height`` x ``width`` image is from its aspect
    ratio, in pixels: how much the shorter way of correcting it would move a side."""
    ratio = width / height
    return min(abs(w - h * ratio), abs(h - w / ratio))


def tokens_of(height: int, width: int, spec: ImageSpec) -> int:
    """Placeholder tokens of an ``height`` x ``width`` (already resized) image."""
    p = spec.patch_size
    return (height // p) * (width // p) // (spec.merge * spec.merge)


def patchify(
    pixels: np.ndarray, patch: int, merge: int = 1, out: np.ndarray | None = None
) -> np.ndarray:
    """``(H, W, 3)`` uint8 -> ``(H/patch * W/patch, patch, patch, 3)``, merge windows contiguous.

    ``out`` (that shape, contiguous) receives the patches without an intermediate copy.
    """
    h, w, c = pixels.shape
    gh, gw = h // patch, w // patch
    if gh * patch != h or gw * patch != w or gh % merge or gw % merge:
        raise ValueError(f"image {h} x {w} is not a grid of {merge} x {merge} x {patch}px windows")
    blocks = pixels.reshape(gh // merge, merge, patch, gw // merge, merge, patch, c)
    # (window row, window col, row in window, col in window, pixel row, pixel col, channel)
    ordered = blocks.transpose(0, 3, 1, 4, 2, 5, 6)
    if out is None:
        return np.ascontiguousarray(ordered).reshape(-1, patch, patch, c)
    out.reshape(ordered.shape)[...] = ordered
    return out


def decode(data: bytes, spec: ImageSpec) -> np.ndarray:
    """Decode, orient (EXIF), flatten alpha onto white, resize; ``(H, W, 3)`` uint8."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img: Any = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width * height > spec.max_input_pixels:
                raise BadImage(
                    f"too many pixels: {width} x {height} = {width * height} > "
                    f"images.max_input_pixels ({spec.max_input_pixels})"
                )
            transposed = _orientation(img) in (5, 6, 7, 8)
            oh, ow = (width, height) if transposed else (height, width)
            th, tw = target_size(oh, ow, spec)
            if img.format == "JPEG":  # decode at a reduced DCT scale when it is large enough
                img.draft("RGB", (th, tw) if transposed else (tw, th))
            img.load()
            if transposed:
                from PIL import ImageOps

                img = ImageOps.exif_transpose(img)
            img = _rgb(img)
            if img.size != (tw, th):
                img = img.resize((tw, th), Image.Resampling.BICUBIC, reducing_gap=3.0)
            return np.asarray(img, dtype=np.uint8)
    except BadImage:
        raise
    except Image.DecompressionBombError as exc:
        raise BadImage(f"too many pixels ({exc})") from None
    except UnidentifiedImageError:
        raise BadImage(
            f"not an image, or not one of {', '.join(FORMATS)} ({len(data)} bytes)"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, MemoryError) as exc:
        raise BadImage(f"cannot decode it: {type(exc).__name__}: {exc}") from None


def _orientation(img: Any) -> int:
    try:
        return int(img.getexif().get(_ORIENTATION, 1))
    except Exception:  # a broken EXIF block must not fail an otherwise good image
        return 1


def _rgb(img: Any) -> Any:
    from PIL import Image

    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")
