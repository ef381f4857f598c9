"""The ``omniload`` command line, thin over the library."""

from omniload_dask.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
