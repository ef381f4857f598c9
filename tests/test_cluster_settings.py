"""The loader's Dask settings: one set for the embedded cluster and the preload, user values win.

The preload's effect on real ``dask scheduler`` / ``dask worker`` processes is checked end to end
in ``test_cluster.py`` (``test_plugin_and_cluster_settings_preloaded_...``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import dask
import pytest
from distributed import Client

from omniload_dask import local_cluster
from omniload_dask.cluster import settings
from omniload_dask.cluster.job import _with_worker_preload
from omniload_dask.preload import READER_MODULES, warm_modules


def test_settings_nest_into_dask_config_form():
    assert settings.nested({"a.b.c": 1, "a.b.d": 2, "a.e": 3}) == {
        "a": {"b": {"c": 1, "d": 2}, "e": 3}
    }


def test_read_tasks_turn_tokenizer_pools_off_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    settings.single_threaded_tokenizers()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    settings.single_threaded_tokenizers()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


def test_importing_the_preload_sets_dask_defaults_that_a_user_setting_overrides():
    # a fresh process: the preload changes the process's Dask config on import
    code = textwrap.dedent(
        """
        import dask
        import omniload_dask.preload  # noqa: F401
        print(dask.config.get("distributed.scheduler.worker-saturation"),
              dask.config.get("distributed.worker.profile.enabled"),
              dask.config.get("distributed.admin.tick.interval"))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    plain = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert plain.stdout.split() == ["inf", "False", "200ms"], plain.stderr
    env["DASK_DISTRIBUTED__ADMIN__TICK__INTERVAL"] = "50ms"
    user = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert user.stdout.split() == ["inf", "False", "50ms"], user.stderr


def _warmed() -> list[str]:
    import sys

    return [m for m in ("omniload_dask.preload", *READER_MODULES) if m in sys.modules]


def test_warm_imports_are_opt_in_and_a_bad_value_is_named() -> None:
    assert warm_modules() == ()  # (a text job never pays for pyarrow and pandas)
    with dask.config.set({"omniload.warm-imports": "readers"}):
        assert warm_modules() == READER_MODULES
    with dask.config.set({"omniload.warm-imports": ["json"]}):
        assert warm_modules() == ("json",)
    with (
        dask.config.set({"omniload.warm-imports": 3}),
        pytest.raises(TypeError, match=r"omniload\.warm-imports must be a list"),
    ):
        warm_modules()


def test_the_embedded_clusters_workers_run_the_preload_and_warm_the_readers_imports():
    pytest.importorskip("pandas")
    got: list[str] = []
    with (
        dask.config.set({"omniload.warm-imports": "readers"}),  # (the worker processes get it)
        local_cluster(1, dashboard_address=None) as cluster,
        Client(cluster, set_as_default=False) as client,
    ):
        for _ in range(240):  # (bounded: 60 s for the background imports)
            got = next(iter(client.run(_warmed).values()))
            if len(got) == 1 + len(READER_MODULES):
                break
            time.sleep(0.25)
    assert got == ["omniload_dask.preload", *READER_MODULES]
    # a caller's own preloads run too, ours once after them
    assert _with_worker_preload("mine") == ["mine", "omniload_dask.preload"]
    assert _with_worker_preload(["omniload_dask.preload"]) == ["omniload_dask.preload"]
