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


# Every shell command README.md and the guides show, and where it runs. A command is run here
# (HERE), by a test that holds its words (a file and the words it must contain), by a test that
# runs a page's copy of it as written (a file and the page: the command must be on that page,
# and the test must read it), or it is named with the reason it cannot run in the test suite.
# The benchmark pages are checked apart: each page's commands name a script of benchmarks/
# (their history records commands as they were run that day).
HERE = "run by tests/test_docs.py"
SECURITY_PAGE = "docs/guides/security.md"
COMMANDS: dict[str, str | tuple[str, ...]] = {
    "omniload demo-data plans/demo-data": HERE,
    "omniload validate plans/quickstart.yaml": HERE,
    "omniload run plans/quickstart.yaml": ("tests/test_cli.py", '"run"', "quickstart.yaml"),
    "torchrun --nproc-per-node 2 examples/train_hf.py --out runs/hf --steps 8": (
        "tests/test_integrations_hf.py",
        '"train_hf.py"',
        '"--out"',
        '"--steps"',
    ),
    "torchrun --nproc-per-node 2 examples/train_hf.py --out runs/hf --steps 8 --resume": (
        "tests/test_integrations_hf.py",
        '"train_hf.py"',
        '"--resume"',
    ),
    "torchrun --nproc-per-node 2 examples/train_lightning.py --out runs/lightning --steps 8": (
        "tests/test_integrations_lightning.py",
        '"train_lightning.py"',
        '"--out"',
        '"--steps"',
    ),
    "torchrun --nproc-per-node 2 examples/train_lightning.py --out runs/lightning --steps 8 "
    "--resume": (
        "tests/test_integrations_lightning.py",
        '"train_lightning.py"',
        '"--resume"',
    ),
    "torchrun --nproc-per-node 2 examples/train_megatron.py --out runs/megatron --steps 8": (
        "tests/test_integrations_megatron_train.py",
        '"train_megatron.py"',
        '"--out"',
        '"--steps"',
    ),
    "torchrun --nproc-per-node 2 examples/train_megatron.py --out runs/megatron --steps 8 "
    "--resume": (
        "tests/test_integrations_megatron_train.py",
        '"train_megatron.py"',
        '"--resume"',
    ),
    "torchrun --nproc-per-node 1 examples/train_torchtitan.py --out runs/titan "
    "--training.steps 30": "torchtitan's models need a CUDA GPU (examples/gpu_check_torchtitan.py)",
    "python examples/gpu_check_torchtitan.py --steps 30 --kill-after 15 --out runs/titan-check": (
        "needs a CUDA GPU; tests/test_integrations_torchtitan.py checks its config on CPU"
    ),
    "source scripts/gpu/setup.sh": "a GPU machine's set-up: installs wheels carried in .whl/",
    "python scripts/gpu/thd_varlen.py": "needs a CUDA GPU (torch's fused varlen attention)",
    "omniload run plans/sft.yaml --make-demo-data": (
        "tests/test_chat.py",
        '"run"',
        '"sft.yaml"',
        '"--make-demo-data"',
    ),
    "omniload run plans/vlm_chat.yaml --make-demo-data": (
        "tests/test_plan_vlm_chat.py",
        '"run"',
        "vlm_chat.yaml",
        '"--make-demo-data"',
    ),
    "omniload calibrate '{hidden: 64, layers: 2, heads: 4, ffn: 256, vocab: 256, gated: true}' "
    "--seq-len 2048 --out calibration.yaml": (
        "tests/test_calibrate.py",
        '"calibrate"',
        '"--seq-len"',
        '"--out"',
    ),
    "omniload run plans/quickstart.yaml --address tcp://scheduler:8786 --steps 50": (
        "tests/test_cli_jobs.py",
        '"run", plan, "--address"',
        '"--steps"',
    ),
    "omniload jobs --address tcp://scheduler:8786": (
        "tests/test_cli_jobs.py",
        '"jobs", "--address"',
    ),
    "omniload status --address tcp://scheduler:8786 --once": (
        "tests/test_cli_jobs.py",
        '"status", "--address"',
        '"--once"',
    ),
    "omniload set-weights --address tcp://scheduler:8786 web=2 books=1": (
        "tests/test_cli_jobs.py",
        '"set-weights", "--address"',
    ),
    "omniload stop quickstart --address tcp://scheduler:8786": (
        "tests/test_cli_jobs.py",
        '"stop", "life", "--address"',
    ),
    "omniload status --address tcp://127.0.0.1:8786 --once": (
        "tests/test_dashboard.py",
        '"status", "--address"',
        '"--once"',
    ),
    "dask scheduler --preload omniload_dask.preload": (
        "tests/test_faults.py",
        '"scheduler"',
        '"--preload", "omniload_dask.preload"',
    ),
    "dask worker tcp://scheduler:8786 --nthreads 3 --resources omniload-read=2 --preload "
    "omniload_dask.preload --preload-nanny omniload_dask.rejoin": (
        "tests/test_faults.py",
        '"worker"',
        '"omniload-read=2"',
        '"--preload-nanny"',
    ),
    "dask scheduler --preload omniload_dask.preload --port 8786": (
        "tests/test_faults.py",
        '"scheduler"',
        '"--port"',
        '"--preload", "omniload_dask.preload"',
    ),
    "dask scheduler --protocol tls --port 8786 --dashboard-address 127.0.0.1:8787 --tls-ca-file "
    "ca.pem --tls-cert scheduler.pem --tls-key scheduler.key --preload omniload_dask.preload": (
        "tests/test_security.py",
        SECURITY_PAGE,
    ),
    "dask worker tls://scheduler:8786 --tls-ca-file ca.pem --tls-cert worker.pem --tls-key "
    "worker.key --nthreads 3 --resources omniload-read=2 --no-dashboard --preload "
    "omniload_dask.preload": ("tests/test_security.py", SECURITY_PAGE),
    "omniload status --address tls://scheduler:8786 --tls-ca-file ca.pem --tls-cert trainer.pem "
    "--tls-key trainer.key --once": ("tests/test_security.py", SECURITY_PAGE),
    "python -c \"from omniload_dask import Job; Job.start('plan.yaml', address="
    "'tcp://scheduler:8786', resume=True)\"": "needs a scheduler at tcp://scheduler:8786; "
    "tests/test_faults.py makes the same Job.start(..., resume=True) call after a scheduler kill",
    "scripts/quickstart.sh": "creates .venv and installs the package; its steps are the "
    "demo-data, validate and run commands beside it, which run here",
    "scripts/test.sh": "the test command itself",
    "source .venv/bin/activate": "changes the calling shell only; scripts/quickstart.sh makes "
    ".venv and prints this line, and the test command runs in that environment",
    "torchrun --nnodes 512 --nproc-per-node 8 train.py": "needs 512 trainer nodes",
}


def shell_commands(markdown: str) -> list[str]:
    """The commands of a page's ``bash``/``console`` blocks: continuation lines joined,
    comments and ``$`` prompts dropped, whitespace collapsed."""
    found = []
    for lang, body in re.findall(r"^```(bash|sh|console)\n(.*?)^```", markdown, re.M | re.S):
        current, going_on = "", False
        for line in body.splitlines():
            if lang == "console":
                if line.startswith("$ "):
                    current = line[2:]
                elif going_on:
                    current += " " + line.strip()
                else:
                    continue
            else:
                text = "" if line.lstrip().startswith("#") else line.split(" #")[0].rstrip()
                if not text and not current:
                    continue
                current = f"{current} {text.strip()}" if current else text.strip()
            going_on = current.endswith("\\")
            if going_on:
                current = current[:-1].rstrip()
                continue
            if current:
                found.append(re.sub(r"\s+", " ", current))
            current = ""
    return found


def _guide_pages() -> list[Path]:
    """README.md and every page of docs/ but the benchmark pages."""
    pages = [p for p in sorted(DOCS.rglob("*.md")) if "benchmarks" not in p.parts]
    return [REPO / "README.md", *pages]


def test_every_command_of_the_readme_and_the_guides_is_run_or_said_not_runnable() -> None:
    shown = {cmd for page in _guide_pages() for cmd in shell_commands(page.read_text())}
    assert shown, "no commands found: the extraction is broken"
    unlisted = sorted(shown - set(COMMANDS))
    assert not unlisted, (
        f"commands shown in README.md or docs/ with no entry in COMMANDS: {unlisted}"
    )
    stale = sorted(set(COMMANDS) - shown)
    assert not stale, f"COMMANDS lists commands no page shows: {stale}"
    for command, where in COMMANDS.items():
        if isinstance(where, tuple):
            test_file, *evidence = where
            text = (REPO / test_file).read_text()
            if len(evidence) == 1 and evidence[0].endswith(".md"):  # run from that page's copy
                page = evidence[0]
                shown_there = shell_commands((REPO / page).read_text())
                assert command in shown_there, f"{command!r}: not in {page}"
                assert Path(page).name in text, f"{test_file} does not read {page}"
                continue
            for words in evidence:
                assert words in text, f"{command!r}: {test_file} does not hold {words}"


def test_the_commands_run_here_work() -> None:
    """The commands marked HERE, as written, from the repository root (``omniload`` as
    ``python -m omniload_dask.cli``, so this tree's package is the one run)."""
    for command, where in COMMANDS.items():
        if where != HERE:
            continue
        argv = [sys.executable, "-m", "omniload_dask.cli", *command.split()[1:]]
        done = subprocess.run(
            argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"


def test_benchmark_pages_name_scripts_that_exist() -> None:
    for page in sorted((DOCS / "benchmarks").glob("*.md")):
        text = page.read_text()
        run = text.split("## History")[0]
        for command in shell_commands(run):
            script = command.split()[1]
            assert (REPO / script).is_file(), f"{page.name}: {command}: no {script}"
        if page.stem != "index":
            assert (REPO / "benchmarks" / f"{page.stem}.py").is_file(), page.name


def test_every_example_plan_says_what_it_shows_and_is_in_the_docs() -> None:
    plans_page = (DOCS / "guides" / "plans.md").read_text()
    for plan in sorted((REPO / "plans").glob("*.yaml")):
        first = plan.read_text().splitlines()[0]
        assert first.startswith("# ") and first.rstrip().endswith("."), (
            f"{plan.name}: its first line should be a comment saying what it shows"
        )
        assert f'--8<-- "plans/{plan.name}"' in plans_page, f"{plan.name}: not in plans.md"


def test_the_training_script_of_the_docs_is_the_one_the_tests_run() -> None:
    """tests/test_examples.py runs the README's training script; the docs show the same."""
    script = re.findall(
        r"^```python\n(.*?)^```", (DOCS / "getting-started.md").read_text(), re.M | re.S
    )[0]
    assert script in (REPO / "README.md").read_text()


def _anchors(markdown: str) -> set[str]:
    """The ids of a page's headings as MkDocs' ``toc`` and GitHub make them."""
    out = set()
    for heading in re.findall(
        r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), re.M
    ):
        text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
        out.add(re.sub(r"\s+", "-", re.sub(r"[^\w\s-]", "", text)))
    return out


def test_the_readme_is_a_front_door_whose_links_lead_somewhere() -> None:
    """README.md stays short (the manual is the site), and each relative link names a file of
    the repository and, where it has one, a heading of that file."""
    readme = (REPO / "README.md").read_text()
    lines = len(readme.splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move the detail into a page of docs/"
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = REPO / target if target else REPO / "README.md"
        assert path.exists(), f"README.md links to {link}: no {target}"
        if anchor:
            assert anchor in _anchors(path.read_text()), f"README.md links to {link}: no heading"


def test_the_readmes_figures_are_todays_of_the_benchmarks_table() -> None:
    """The README's table names the date and code of the head to head it quotes; that run is
    the one BENCHMARKS.md gives as today's."""
    readme = (REPO / "README.md").read_text()
    found = re.search(r"`benchmarks/head_to_head\.py` on (\d{4}-\d\d-\d\d) \(code `(\w+)`", readme)
    assert found, "README.md: the figures' date and code are not named"
    date, commit = found.groups()
    rows = [
        line
        for line in (REPO / "BENCHMARKS.md").read_text().splitlines()
        if line.startswith("| [head to head]")
    ]
    assert rows and all(f"| {date} | `{commit}` |" in row for row in rows), (
        f"README.md quotes the head to head of {date} ({commit}); BENCHMARKS.md has another"
    )
