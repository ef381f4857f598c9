"""The loader's Dask settings: one set for the embedded cluster and the preload, user values win.

The preload's effect on real ``dask scheduler`` / ``dask worker`` processes is checked end to end
in ``test_cluster.py`` (``test_plugin_and_cluster_settings_preloaded_...``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from omniload_dask.cluster import settings


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
