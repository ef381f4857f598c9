"""Demo data made on the spot from fixed seeds: text and image-text sources and their tokenizers.

Nothing is downloaded, and every machine writes the same bytes, so the quickstart, the examples,
the tests and the benchmarks all read the same data. ``text`` writes the text sources (and, via
:func:`make_demo_data`, everything), ``images`` the image-text sources and their pieces,
``vocabulary`` the words, texts and word-level tokenizer both share.
"""

from omniload_dask.demo.image_chat import make_image_chat_demo_data
from omniload_dask.demo.images import (
    caption,
    encode_image,
    make_image_demo_data,
    synthetic_image,
    write_image_parquet,
    write_image_tar,
)
from omniload_dask.demo.text import demo_sources, demo_tokenizer, make_demo_data
from omniload_dask.demo.vocabulary import VOCAB_SEED, demo_text, vocabulary, write_tokenizer

__all__ = [
    "VOCAB_SEED",
    "caption",
    "demo_sources",
    "demo_text",
    "demo_tokenizer",
    "encode_image",
    "make_demo_data",
    "make_image_chat_demo_data",
    "make_image_demo_data",
    "synthetic_image",
    "vocabulary",
    "write_image_parquet",
    "write_image_tar",
    "write_tokenizer",
]
