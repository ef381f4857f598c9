"""Data plans: YAML in, validated and frozen plan objects out (see :mod:`.specs`)."""

from omniload_dask.plan.specs import *  # noqa: F403
from omniload_dask.plan.specs import __all__  # noqa: F401
