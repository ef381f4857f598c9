"""The Dask adapter: everything that runs the pure data plane on a Dask cluster.

- :mod:`.plugin`: the scheduler plugin, thin: Dask's hooks and the ``omniload_*`` handlers,
  argument checks, and delegation to the parts below.
- :mod:`.lifecycle`: starting (discovery, resume from a checkpoint) and changing jobs; the
  data plane's own client, which :mod:`.watchdog` replaces when its connection is lost.
- :mod:`.running`: a running job, its pump (dealing in a thread) and long-polls;
  :mod:`.waiters`: fetching agents waiting, each on the one step or block it needs.
- :mod:`.executor`: the coordinator's actions as Dask submits and releases, with priorities.
- :mod:`.standby`: second copies of upcoming batches and shards on another worker.
- :mod:`.checkpointing`: when a running job's checkpoint deltas are flushed.
- :mod:`.stats`: what the figure handlers (``stats``, ``mixture``, ...) reply.
- :mod:`.tasks`: the functions that run on workers (discover, read, construct blocks).
- :mod:`.serving`: the worker handler that hands a fetcher its part of a block.
- :mod:`.job`: ``Job``, the client-side handle, and the embedded ``LocalCluster``;
  :mod:`.settings`: the Dask settings it runs with, which the preload gives other clusters.
- :mod:`.adaptive`: Dask's adaptive scaling, told how many workers keep the trainers fed.

Every use of Dask internals is in :mod:`omniload_dask.internals` (which :mod:`omniload_dask.
observe` and :mod:`omniload_dask.trainer` use too); the wire form of a part is
:mod:`omniload_dask.batching.wire`'s.
"""
