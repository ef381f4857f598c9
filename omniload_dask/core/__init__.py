"""The pure data plane: events in, actions out; no I/O, no Dask, no threads.

What each module owns (the scheduler plugin and ``testing.InlineDataPlane`` drive it through
:class:`~omniload_dask.core.coordinator.Coordinator`, the one way in; modules outside core
read it through ``Coordinator.view``)::

    coordinator   the one way in: takes events, draws steps, returns actions; owns the rest
    events        what comes in (reads reported, ranks' requests, failures) and the job's failure
    views         what every module outside core reads: the cycle's place, figures, stats
    live          the sources as they change: streams, caps, weight schedule, change log
    streams       one source's sample stream: unit and row order per epoch, the read cursor
    draw          drawing a global batch from the sources' next documents (the mixer)
    stepping      the step cycle: draw, deal, commit, in order (dealing may run elsewhere)
    dealer        a drawn step's split among the DP groups, and each group's recipe
    delivery      which batch each rank gets: blocks held, parts, rebuilds
    positions     the ranks' positions, per DP group and job-wide, kept incrementally
    reads         which read units to submit: windows, quotas, portions, cost meters
    autoscale     read task sizes, quotas and worker counts from measured costs
    figures       counters, per-step figures, dealing times, the realised mixture
    state         snapshots and per-step deltas of the state, as plain data (checkpoints)
    actions       what the adapter carries out: submit a read or a construction, release
    keys          the task keys of a run
"""
