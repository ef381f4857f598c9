"""Preprocessing that runs on workers, one module per step (tokenize; images come later)."""

from omniload_dask.preprocess.tokenize import TokenizerInfo, load_tokenizer, tokenize

__all__ = ["TokenizerInfo", "load_tokenizer", "tokenize"]
