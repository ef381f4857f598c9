"""``python -m omniload_dask.cli``: the ``omniload`` command."""

import sys

from omniload_dask.cli.main import main

sys.exit(main())
