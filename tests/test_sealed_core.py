"""The data plane is sealed: events and live changes go in through the coordinator's methods,
everything else reads its view; no module outside ``core`` writes it or reaches into its components.

Each test reads the package's source, so a module that breaks the rule fails here with its
name and line.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from omniload_dask.core.coordinator import Coordinator

PACKAGE = Path(__file__).resolve().parents[1] / "omniload_dask"
COORDINATOR_NAMES = {"coord", "_coord", "coordinator"}  # what the package calls one
# The whole way in (see core/coordinator.py's docstring). A new member is a decision: add it
# here, and to the docstring's table.
SURFACE = {
    "handle",
    "set_weights",
    "add_source",
    "remove_source",
    "apply_change",
    "apply_stages",
    "adopt_plan",
    "advance",
    "draw_step",
    "draw_together",
    "deal_steps",
    "commit_step",
    "take_actions",
    "has_actions",
    "batch_for",
    "part_for",
    "state_dict",
    "load_state_dict",
    "take_deltas",
    "stop_recording",
    "view",
    "components",
}


def _outside_core() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "core"]


def _is_coordinator(node: ast.expr) -> bool:
    """``coord``, ``self._coord``, ``run.coord``: an expression naming a coordinator."""
    if isinstance(node, ast.Name):
        return node.id in COORDINATOR_NAMES
    return isinstance(node, ast.Attribute) and node.attr in COORDINATOR_NAMES


def _through_coordinator(node: ast.expr) -> bool:
    """An attribute chain that passes a coordinator (``run.coord.view.x``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if _is_coordinator(node.value):
            return True
        node = node.value
    return False


def _offences(where: str, source: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, (ast.Attribute, ast.Subscript)) and _through_coordinator(part):
                    out.append(f"{where}:{node.lineno}: writes into the coordinator")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and (_is_coordinator(node.args[0]) or _through_coordinator(node.args[0]))
        ):
            out.append(f"{where}:{node.lineno}: {node.func.id} on the coordinator")
        if isinstance(node, ast.Attribute) and _is_coordinator(node.value):
            if node.attr.startswith("_") or node.attr == "components":
                out.append(f"{where}:{node.lineno}: reaches into coordinator.{node.attr}")
            elif node.attr not in SURFACE:
                out.append(f"{where}:{node.lineno}: coordinator.{node.attr} is not its surface")
    return out


def test_no_module_outside_core_writes_the_coordinator_or_reaches_into_its_components():
    offences = [
        o
        for path in _outside_core()
        for o in _offences(str(path.relative_to(PACKAGE.parent)), path.read_text())
    ]
    assert not offences, "\n".join(offences)


def test_the_check_sees_each_kind_of_breach():
    samples = {
        "run.coord.error = 'x'": "writes into",
        "coord.recording = False": "writes into",
        "coord.view.history[0] = 1": "writes into",
        "setattr(run.coord, 'error', 'x')": "setattr",
        "run.coord._cycle.max_in_flight": "reaches into",
        "self.coord.components.delivery": "reaches into",
        "coord.delivery.where": "not its surface",
    }
    for code, expected in samples.items():
        found = _offences("sample", code)
        assert found and expected in found[0], (code, found)
    assert not _offences("sample", "run.coord.view.history[-1]\ncoord.handle(event)")


def test_the_coordinator_is_entered_through_a_small_surface():
    public = {name for name, _ in inspect.getmembers(Coordinator) if not name.startswith("_")}
    assert public == SURFACE
