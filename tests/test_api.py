from __future__ import annotations

import subprocess
import sys

import omniload_dask


def test_public_api_is_sorted_and_importable():
    assert omniload_dask.__all__ == sorted(omniload_dask.__all__)
    for name in omniload_dask.__all__:
        assert getattr(omniload_dask, name) is not None


PURE = [
    "plan",
    "mixing",
    "balance",
    "coordinator",
    "actions",
    "plane_base",
    "plane_live",
    "plane_reads",
    "plane_figures",
    "plane_state",
    "checkpoint",
    "cost",
    "streams",
    "batches",
    "errors",
    "sources",
    "preprocess.tokenize",
    "preprocess.image",
    "preprocess.interleave",
    "autoscale",
]


def test_pure_modules_import_neither_torch_nor_distributed():
    code = (
        "import importlib, sys\n"
        f"for m in {PURE!r}:\n"
        "    importlib.import_module('omniload_dask.' + m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'distributed'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == ""


def test_importing_the_package_does_not_import_torch():
    code = "import sys, omniload_dask; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False"
