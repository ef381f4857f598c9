"""Watching running jobs: what the data plane remembers for it, and the three views.

- :mod:`.monitoring`: what the data plane remembers for watching (pure, no Dask): read
  throughput, feeder reports, progress, per-source counters. ``stats()`` reads it.
- :mod:`.dashboard`: the Omniload page on the Dask dashboard (one session, its data);
  :mod:`.page_layout`: that page's plots and table.
- :mod:`.metrics`: ``omniload_*`` Prometheus metrics on the scheduler's ``/metrics``.
- :mod:`.status`: ``omniload status``, the terminal view.
- :mod:`.formatting`: the phrases those views share.

The views read only ``stats()`` (and, for the page's curves, the monitor's and coordinator's
recent history); none of them changes a job.
"""
