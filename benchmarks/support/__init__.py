"""Modules the benchmarks share (baselines, corpus, accounting, timing); none is a benchmark."""
