from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tiny_training_example_runs_on_feeder_batches(tmp_path):
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_tiny.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "still alive after" not in proc.stderr, proc.stderr[-3000:]  # a clean exit
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 3
    assert all(0 < x < 20 for x in losses)


def test_tiny_vlm_example_scatters_image_tokens_from_feeder_batches():
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_tiny_vlm.py"), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "still alive after" not in proc.stderr, proc.stderr[-3000:]  # a clean exit
    steps = re.findall(r"loss (\d+\.\d+)  (\d+) images", proc.stdout)
    assert len(steps) == 2
    assert all(0 < float(loss) < 20 for loss, _ in steps)
    assert sum(int(n) for _, n in steps) > 0


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


def _readme_python_blocks() -> list[str]:
    return _python_blocks(REPO / "README.md")


def test_every_python_block_of_the_readme_and_the_docs_parses_and_guards_the_cluster():
    import ast

    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    blocks = [block for page in pages for block in _python_blocks(page)]
    assert len(_readme_python_blocks()) >= 2 and len(blocks) >= 6
    for block in blocks:
        tree = ast.parse(block)  # every snippet is valid Python as printed
        starts = "Job.start(" in block and "address=" not in block
        if starts and any(isinstance(n, ast.FunctionDef) for n in tree.body):
            assert 'if __name__ == "__main__":' in block  # embedded cluster: spawned workers


def test_the_readme_training_script_runs_as_written(tmp_path):
    from omniload_dask.demo import make_demo_data

    make_demo_data(REPO / "plans" / "demo-data")
    scripts = [b for b in _readme_python_blocks() if 'if __name__ == "__main__":' in b]
    assert len(scripts) == 1
    (tmp_path / "train.py").write_text(scripts[0])
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "train.py")],
        cwd=REPO,  # the README says: from the repository root
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(re.findall(r"^step \d: loss \d+\.\d+", proc.stdout, flags=re.MULTILINE)) == 5
    assert "done: {" in proc.stdout  # its progress, and where a resume would continue
