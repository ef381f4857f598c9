"""Adapters for the training frameworks people use, each an optional dependency.

Nothing here is imported by ``import omniload_dask``; each module imports its framework when it
is imported itself and checks the installed version against the range it was written for
(:mod:`.versions`), so a mismatch is a clear error at start, not a wrong batch later.

- :mod:`.hf`: Hugging Face ``transformers.Trainer`` (and so ``accelerate``): padding-free
  batches, no second sharding, ``num_items_in_batch``, feeder state in the Trainer's checkpoint.
- :mod:`.lightning`: a ``LightningDataModule`` whose state goes into the Lightning checkpoint.
- :mod:`.torchtitan`: a ``BaseDataLoader`` for a torchtitan train spec, per DP rank.
- :mod:`.megatron`: Megatron-Core / Transformer Engine "THD" batches, with padding for context
  parallelism and fixed-length boundaries for CUDA graphs (the layout math needs only torch).
- :mod:`.launch`: one job for a ``torchrun`` world: rank 0 starts it, the others attach.
- :mod:`.positions`: which micro-batch a framework has consumed, as a feeder state.
"""
