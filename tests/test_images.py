"""Image preprocessing: resize to a patch grid, patchify, decode, bad images, placeholders."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from omniload_dask.demo import encode_image, synthetic_image
from omniload_dask.plan import ImageSpec
from omniload_dask.preprocess.image import (
    BadImage,
    decode,
    patchify,
    target_size,
    tokens_of,
)
from omniload_dask.preprocess.interleave import place_images

SPEC = ImageSpec()  # patch 14, merge 2: sides are multiples of 28


@settings(max_examples=300, deadline=None)
@given(
    h=st.integers(1, 6000),
    w=st.integers(1, 6000),
    patch=st.sampled_from([8, 14, 16]),
    merge=st.sampled_from([1, 2]),
    min_side=st.integers(1, 8),
    extra=st.integers(4, 400),
)
def test_target_size_is_a_grid_of_merge_windows_within_the_pixel_limits(
    h, w, patch, merge, min_side, extra
):
    f = patch * merge
    spec = ImageSpec(
        patch_size=patch, merge=merge, min_pixels=(min_side * f) ** 2, max_pixels=extra * f * f
    )
    th, tw = target_size(h, w, spec)
    assert th % f == 0 and tw % f == 0 and th >= f and tw >= f
    assert th * tw <= spec.max_pixels
    if spec.max_pixels >= 4 * spec.min_pixels and max(h / w, w / h) <= 4:
        assert th * tw >= spec.min_pixels
    assert tokens_of(th, tw, spec) * merge * merge == (th // patch) * (tw // patch)


@settings(max_examples=200, deadline=None)
@given(h=st.integers(56, 3000), w=st.integers(56, 3000))
def test_target_size_keeps_the_aspect_ratio_within_one_grid_step(h, w):
    th, tw = target_size(h, w, SPEC)
    if th > SPEC.factor and tw > SPEC.factor:  # not clamped at the smallest side
        ratio = (th / tw) / (h / w)
        slack = 2 * SPEC.factor / min(th, tw)  # each side within a grid step of exact
        assert 1 - slack <= ratio <= 1 + slack


@pytest.mark.parametrize(
    "spec",
    [
        SPEC,
        ImageSpec(min_pixels=3136, max_pixels=146608),  # where 734 x 287 became 560 x 252
        ImageSpec(patch_size=8, merge=2, min_pixels=1024, max_pixels=16384),
        ImageSpec(patch_size=16, merge=1, min_pixels=1024, max_pixels=10240),
    ],
)
def test_target_size_keeps_the_aspect_ratio_within_one_grid_step_also_over_max_pixels(spec):
    f = spec.factor
    sizes = [(287, 734), (734, 287), (480, 640), (1080, 1920), (3000, 4000), (97, 1013)]
    sizes += [(h, w) for h in range(40, 4000, 97) for w in range(40, 4000, 131)]
    for h, w in sizes:
        scale = math.sqrt(min(max(h * w, spec.min_pixels), spec.max_pixels) / (h * w))
        if min(h, w) * scale < f:
            continue  # so elongated that its short side gets one grid step whatever its ratio
        th, tw = target_size(h, w, spec)
        assert th % f == 0 and tw % f == 0 and th * tw <= spec.max_pixels
        # the shorter way of restoring the ratio moves a side by at most one grid step
        off = min(abs(tw - th * w / h), abs(th - tw * h / w))
        assert off <= f, (h, w, th, tw, off)
    if spec.max_pixels == 146608:
        assert target_size(287, 734, spec) == (224, 588)  # 2.63:1 for 2.56:1, not 2.22:1


def test_target_size_worked_example_and_limits():
    assert target_size(100, 60, SPEC) == (112, 56)  # module docstring
    assert target_size(28, 28, SPEC) == (56, 56)  # grown to min_pixels 3136
    th, tw = target_size(4000, 3000, SPEC)
    assert th * tw <= SPEC.max_pixels and th > tw


@settings(max_examples=100, deadline=None)
@given(gh=st.integers(1, 6), gw=st.integers(1, 6), patch=st.integers(1, 5), merge=st.integers(1, 3))
def test_patchify_is_a_lossless_reordering_with_merge_windows_contiguous(gh, gw, patch, merge):
    h, w = gh * merge * patch, gw * merge * patch
    pixels = np.random.default_rng(gh * 100 + gw).integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = patchify(pixels, patch, merge)
    assert out.shape == (gh * gw * merge * merge, patch, patch, 3) and out.dtype == np.uint8
    into = np.full_like(out, 7)
    assert patchify(pixels, patch, merge, out=into) is into and np.array_equal(into, out)
    # Patch k sits at grid cell (r, c): window (k // m^2) row-major, then its place in the window.
    for k in range(len(out)):
        window, inside = divmod(k, merge * merge)
        wr, wc = divmod(window, gw)
        ir, ic = divmod(inside, merge)
        r, c = wr * merge + ir, wc * merge + ic
        expect = pixels[r * patch : (r + 1) * patch, c * patch : (c + 1) * patch]
        assert np.array_equal(out[k], expect)


def test_patchify_rejects_sizes_off_the_grid():
    with pytest.raises(ValueError, match="not a grid"):
        patchify(np.zeros((30, 28, 3), np.uint8), 14, 2)


@pytest.mark.parametrize("fmt", ["jpeg", "png", "webp"])
def test_decode_real_jpeg_png_webp_to_the_target_grid(fmt):
    pixels = synthetic_image(7, 150, 230)
    out = decode(encode_image(pixels, fmt), SPEC)
    assert out.dtype == np.uint8 and out.shape == (*target_size(150, 230, SPEC), 3)
    if fmt == "png":  # lossless: the resized image is close to resizing the original
        ref = np.asarray(Image.fromarray(pixels).resize(out.shape[1::-1], Image.BICUBIC))
        assert np.abs(ref.astype(int) - out.astype(int)).mean() < 2


def test_decode_flattens_alpha_onto_white_and_grey_to_rgb():
    rgba = np.zeros((56, 56, 4), np.uint8)  # fully transparent black
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, "PNG")
    assert (decode(buf.getvalue(), SPEC) == 255).all()
    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56), 90, np.uint8), "L").save(buf, "PNG")
    assert (decode(buf.getvalue(), SPEC) == 90).all()


def test_decode_follows_exif_orientation():
    pixels = synthetic_image(3, 56, 112)  # wide as stored
    img = Image.fromarray(pixels)
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees to show: tall
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif)
    assert decode(buf.getvalue(), SPEC).shape[:2] == (112, 56)


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"definitely not an image", "not an image"),
        (encode_image(synthetic_image(1, 200, 200), "jpeg")[:600], "cannot decode"),
        (encode_image(synthetic_image(1, 200, 200), "png")[:300], "cannot decode"),
        (b"", "not an image"),
    ],
)
def test_bad_images_raise_with_a_reason(blob, reason):
    with pytest.raises(BadImage, match=reason):
        decode(blob, SPEC)


def test_too_many_pixels_is_checked_before_decoding():
    spec = ImageSpec(max_input_pixels=100 * 100)
    blob = encode_image(synthetic_image(1, 101, 100), "png")
    with pytest.raises(BadImage, match=r"too many pixels: 100 x 101 = 10100 > images.max_input"):
        decode(blob, spec)


@settings(max_examples=200, deadline=None)
@given(
    docs=st.lists(
        st.tuples(st.integers(0, 6), st.lists(st.integers(1, 5), max_size=3)), max_size=8
    ),
    skip=st.integers(0, 1),
)
def test_placeholders_go_after_the_lead_token_in_image_order(docs, skip):
    lengths = [n for n, _ in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(1, int(offsets[-1]) + 1, dtype=np.uint32)  # all distinct, never 0
    record = np.asarray([r for r, (_, imgs) in enumerate(docs) for _ in imgs], np.int64)
    counts = np.asarray([c for _, imgs in docs for c in imgs], np.int64)
    out, new_offsets, starts = place_images(tokens, offsets, record, counts, 0, skip)
    i = 0
    for r, (n, imgs) in enumerate(docs):
        doc = out[new_offsets[r] : new_offsets[r + 1]].tolist()
        text = tokens[offsets[r] : offsets[r + 1]].tolist()
        lead = min(skip, n)
        assert doc == text[:lead] + [0] * sum(imgs) + text[lead:]
        at = lead
        for c in imgs:
            assert starts[i] == at
            i += 1
            at += c
