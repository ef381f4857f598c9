"""The trainer side: what runs in each trainer rank (or node) to get its batches.

- :mod:`.feeder`: ``Feeder``, the iterator over one rank's micro-batches, and its
  ``state_dict``; :mod:`.options`: its arguments as one frozen ``FeederOptions``;
  :mod:`.wiring`: from those options to the rank's supply of steps, one factory per fan-out;
  :mod:`.prefetch`: the thread that keeps the next steps fetched.
- :mod:`.fanout`: where a rank's steps come from: its own fetch, its DP group's broadcast
  (:mod:`.broadcast`, torch.distributed) or its node's agent (:mod:`.node` the agent,
  :mod:`.node_supply` a rank's side; shared memory through :mod:`.shm`).
- :mod:`.fetch`: one round trip to the data plane and the workers, over a :mod:`.link`
  (Dask's comms, no ``Client``).
- :mod:`.ranks`: which rank a feeder serves (given, torch.distributed, or the environment).
- :mod:`.torch_dataset`: a feeder as a ``torch.utils.data.IterableDataset``.
"""
