"""The Dask adapter: everything that runs the pure data plane on a Dask cluster.

- :mod:`.plugin`: the scheduler plugin, thin: Dask's hooks and the ``omniload_*`` handlers,
  argument checks, and delegation to the parts below.
- :mod:`.lifecycle`: starting (discovery, resume from a checkpoint) and changing jobs; the
  data plane's own client. :mod:`.running`: a running job, its pump and long-polls.
- :mod:`.executor`: the coordinator's actions as Dask submits and releases, with priorities.
- :mod:`.standby`: second copies of upcoming batches and shards on another worker.
- :mod:`.checkpointing`: when a running job's checkpoint deltas are flushed.
- :mod:`.stats`: what the figure handlers (``stats``, ``mixture``, ...) reply.
- :mod:`.tasks`: the functions that run on workers (discover, read, construct, slice).
- :mod:`.job`: ``Job``, the client-side handle, and the embedded ``LocalCluster``.
- :mod:`.adaptive`: Dask's adaptive scaling, told how many workers keep the trainers fed.
- :mod:`.internals`: every use of Dask internals, and only there.
"""
