"""What workers do to records before they become shards, one module per step.

``tokenize`` turns texts into tokens (the byte tokenizer, or a Hugging Face tokenizer.json),
``image`` decodes and resizes images and cuts them into patches, ``interleave`` places each
image's placeholder tokens into its document. Optional dependencies (Pillow, ``tokenizers``) are
imported when first needed.
"""

from omniload_dask.preprocess.tokenize import TokenizerInfo, load_tokenizer, tokenize

__all__ = ["TokenizerInfo", "load_tokenizer", "tokenize"]
