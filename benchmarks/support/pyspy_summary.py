"""Where the CPU goes, from py-spy records in collapsed form (``py-spy record --format raw``).

    python benchmarks/support/pyspy_summary.py RECORD.txt [RECORD.txt ...] [--top 12]

Every sample is put in one category: walking its stack from the innermost frame outwards, the
first frame that matches a rule of :data:`RULES` decides (so time spent compressing a frame for
the network counts as serialisation, not as the event loop that called it). Prints the shares
of the categories and the innermost frames that took the most samples. py-spy leaves idle
threads out, so the shares are of on-CPU samples.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

__all__ = ["RULES", "categorise", "read_samples"]

RULES: list[tuple[str, re.Pattern[str]]] = [
    (name, re.compile(pattern))
    for name, pattern in [
        ("profiler and monitors", r"distributed/profile\.py|system_monitor|memory_monitor|"
                                  r"psutil|_measure_tick|monitor\.py"),
        ("tokenize", r"preprocess/tokenize\.py|tiktoken/|tokenizers/|encode_batch|encode_ordinary"),
        ("serialisation", r"distributed/protocol/|pickle|msgpack|cloudpickle|serialize|"
                          r"_compress|compression\.py"),
        ("read and decode", r"omniload_dask/sources/|json|zstandard|zstd|pyarrow|parquet|"
                            r"fsspec|gzip"),
        ("construct batches", r"omniload_dask/batching/|omniload_dask/cluster/tasks\.py"),
        ("feeder: expand batches", r"omniload_dask/trainer/"),
        ("data plane (plugin, coordinator)", r"omniload_dask/core/|omniload_dask/cluster/"),
        ("dask scheduler", r"distributed/scheduler\.py|distributed/stealing\.py|"
                           r"distributed/active_memory_manager\.py"),
        ("dask worker and tasks", r"distributed/worker|distributed/utils_perf|"
                                  r"distributed/threadpoolexecutor|distributed/_concurrent"),
        ("dask client", r"distributed/client\.py"),
        ("network and event loop", r"distributed/comm/|distributed/core\.py|tornado/|asyncio/|"
                                   r"distributed/batched\.py|selectors"),
        ("torch", r"torch/"),
    ]
]  # fmt: skip


def read_samples(path: Path) -> Counter[tuple[str, ...]]:
    """Stacks (outermost first, process headers dropped) and their sample counts."""
    out: Counter[tuple[str, ...]] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = tuple(f for f in stack.split(";") if not f.startswith(("process ", "thread ")))
        out[frames] += int(count)
    return out


def categorise(frames: tuple[str, ...]) -> str:
    """The category of one stack (see the module doc)."""
    for frame in reversed(frames):
        for name, pattern in RULES:
            if pattern.search(frame):
                return name
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("records", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    for path in args.records:
        samples = read_samples(path)
        total = sum(samples.values()) or 1
        cats: Counter[str] = Counter()
        leaves: Counter[str] = Counter()
        for frames, n in samples.items():
            cats[categorise(frames)] += n
            leaves[re.sub(r" \(.*/", " (", frames[-1]) if frames else "?"] += n
        print(f"== {path.name}: {total} on-CPU samples")
        for name, n in cats.most_common():
            print(f"  {100 * n / total:5.1f} %  {name}")
        print("  innermost frames:")
        for leaf, n in leaves.most_common(args.top):
            print(f"  {100 * n / total:5.1f} %  {leaf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
