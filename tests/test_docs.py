"""The documentation site builds strictly, covers the public API and every plan field, and
every shell command it shows is either run by a test or named as one that cannot run here.

The site is MkDocs (``mkdocs.yml``, pages in ``docs/``) with mkdocstrings for the API
reference. ``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the
navigation, a snippet file that does not exist, and a docstring that does not render.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import omniload_dask

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

pytest.importorskip("mkdocs")
pytest.importorskip("mkdocstrings_handlers.python")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["NO_MKDOCS_2_WARNING"] = "1"  # a banner of the theme's, not a warning of the site's
    return env


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    assert not warnings, "\n".join(warnings)
    page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert 'id="omniload_dask.cluster.job.Job.start"' in page  # docstrings were rendered


def test_every_public_name_has_a_reference_entry() -> None:
    """Each name of ``omniload_dask.__all__`` has a ``::: dotted.path`` entry on the API page,
    and that path is the very object the package exports."""
    page = (DOCS / "reference" / "api.md").read_text()
    targets = re.findall(r"^::: (\S+)", page, re.MULTILINE)
    objects = {}
    for target in targets:
        module, _, name = target.rpartition(".")
        try:
            objects[target] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            objects[target] = None  # a module entry (``::: omniload_dask.errors``)
    for name in omniload_dask.__all__:
        exported = getattr(omniload_dask, name)
        found = [t for t, obj in objects.items() if obj is exported]
        assert found, f"{name}: no '::: ...' entry for it in docs/reference/api.md"


def test_the_plan_field_table_is_current() -> None:
    """docs/guides/plan-fields.md is what scripts/docs_plan_fields.py writes from the parser
    today: every field the parser reads has a row and a meaning, none is stale."""
    spec = importlib.util.spec_from_file_location(
        "docs_plan_fields", REPO / "scripts" / "docs_plan_fields.py"
    )
    assert spec and spec.loader
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # (its dataclasses look their module up there)
    spec.loader.exec_module(tool)
    rows = tool.watched_rows()
    assert tool.problems(rows) == []
    names = {re.sub(r"\[\]", "", path).rsplit(".", 1)[-1] for path in rows}
    assert tool.literal_fields() <= names, (
        "a field the parsers read is missing from the coverage plans"
    )
    assert (DOCS / "guides" / "plan-fields.md").read_text() == tool.render(rows), (
        "docs/guides/plan-fields.md is out of date: run python scripts/docs_plan_fields.py"
    )
