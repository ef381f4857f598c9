"""Every use of Dask internals, in one package, so an upgrade of distributed touches it only.

"Internals" are the parts of distributed that are not its documented API: the scheduler's task,
worker and client state, what the ``transition`` hook's keyword arguments hold, the worker's task
state and memory, the comm layer (``ConnectionPool``, handlers, ``to_serialize``), the nanny's
handlers, the dashboard's Bokeh application, the Active Memory Manager's policy classes and what
Dask remembers of every key. Everything else in the package uses Dask's public API only.

- :mod:`.server`: the scheduler's, workers' and nanny's state and hooks.
- :mod:`.comms`: calls over Dask's comms: a fetching agent's pools (no ``Client``), a client's
  calls to the data plane's handlers, and what a call may carry.
- :mod:`.dashboard`: a page of the scheduler's Bokeh dashboard.
- :mod:`.amm`: the Active Memory Manager's policies for standby copies.
- :mod:`.forgetting`: the bounds on what Dask remembers of every new key and submit.

The Dask adapter (:mod:`omniload_dask.cluster`), the views of running jobs
(:mod:`omniload_dask.observe`) and the trainer side (:mod:`omniload_dask.trainer`) import it;
it imports none of them, so each depends on it one way.
"""
