"""Batching: which documents form each global batch, how they are split, and how packed.

Pure (numpy only, no I/O, no Dask). What each module owns, in the order a step uses them:

    mixing            the weighted-fair draw of each global batch from the sources, and the
                      weight of every source at every step (plan, schedule, live changes)
    balance/          the split of one global batch among the DP groups, one module per
                      pass (route, place, refine, polish, slide; its package doc)
    assignment        the resulting split and its figures (efficiency, tokens, costs)
    fill              tokens moved into micro-batches a split left empty
    sorting           stable orders of small integer keys (radix sorts where they fit)
    formats           shards, recipes and the packed ("varlen") batch layout they build
      packing           a recipe table pickled as one byte string (one frame to Dask)
    wire              the wire format of a part: packed by its construction, served and
                      unpacked as it is, expanded to the full layout by the feeder
    context_parallel  each context-parallel rank's zigzag slice of a built batch

What a document piece costs to train on (the plan's ``cost:``, the balancer's weight) is the
plan's: :mod:`omniload_dask.plan.cost`. The data plane (:mod:`omniload_dask.core`) calls
``mixing`` and ``balance``; worker tasks
(:mod:`omniload_dask.cluster.tasks`) call ``formats``, ``context_parallel`` and ``wire``, which
the trainer side (:mod:`omniload_dask.trainer`) reads back.
"""
