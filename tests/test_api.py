from __future__ import annotations

import subprocess
import sys

import omniload_dask


def test_public_api_is_sorted_and_importable():
    assert omniload_dask.__all__ == sorted(omniload_dask.__all__)
    for name in omniload_dask.__all__:
        assert getattr(omniload_dask, name) is not None


def test_importing_the_package_does_not_import_torch():
    code = "import sys, omniload_dask; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "False"
