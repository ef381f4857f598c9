"""The trainer side: what runs in each trainer rank to get its batches.

- :mod:`.feeder`: ``Feeder``, the prefetching iterator over one rank's micro-batches, and its
  ``state_dict``; :mod:`.fetch`: one round trip to the data plane and the workers.
- :mod:`.ranks`: which rank a feeder serves (given, torch.distributed, or the environment).
- :mod:`.torch_dataset`: a feeder as a ``torch.utils.data.IterableDataset``.
"""
