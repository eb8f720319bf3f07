"""Rules the suite keeps about itself, checked on its own source.

1. No test races a sleep against the engine: `time.sleep` / `asyncio.sleep` appear only in the helpers listed
   in SLEEP_ALLOWED, each with the reason it is not a race. A test that needs a request running, queued or
   finished makes it so (tests/doubles.py: PacedRunner, FaultyRunner) or waits for what it observes
   (tests/waiting.py), so a slower or faster box changes how long it takes, never whether it passes.
2. Every test module that starts a server (in process or as a subprocess) carries the `server` marker, so
   `pytest -m "not slow and not server"` is a quick unit run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

# (file, function) -> why its sleep races nothing
SLEEP_ALLOWED = {
    ("waiting.py", "wait_until"): "the poll interval of waiting for an observed condition",
    ("waiting.py", "wait_until_async"): "the same, in an event loop",
    ("doubles.py", "execute"): "PacedRunner's floor under a step's duration (a slow device): it makes a request "
    "last at least N x min_step_s, so a deadline shorter than that expires first on any machine",
    ("test_loadtest.py", "send"): "FakeBackend stands in for a server's latency; the load tester's own clock "
    "is under test, no engine runs",
}
SERVER_USES = ("running_server(", "ServerThread(", "wait_serving(", "tests.fault_server")


def _sleeps(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of every time.sleep / asyncio.sleep call, or a bare sleep() imported from one."""
    tree = ast.parse(path.read_text())
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                f = child.func
                attr = isinstance(f, ast.Attribute) and f.attr == "sleep"
                if (attr and isinstance(f.value, ast.Name) and f.value.id in ("time", "asyncio")) or (
                    isinstance(f, ast.Name) and f.id == "sleep"
                ):
                    found.append((function, child.lineno))
                if attr and isinstance(f.value, ast.Call) and getattr(f.value.func, "id", "") == "__import__":
                    found.append((function, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "data" not in p.parts)


def test_no_sleep_outside_the_allowed_helpers() -> None:
    bad = [
        f"{path.relative_to(TESTS)}:{line} in {function}()"
        for path in _modules()
        for function, line in _sleeps(path)
        if (path.name, function) not in SLEEP_ALLOWED
    ]
    assert not bad, "sleeps that race the engine (wait for an observed state instead): " + ", ".join(bad)


def test_the_sleep_check_finds_sleeps(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import time, asyncio\nfrom time import sleep\n"
        "def a():\n    time.sleep(1)\nasync def b():\n    await asyncio.sleep(0)\ndef c():\n    sleep(2)\n"
        "def d():\n    __import__('asyncio').sleep(1)\n"
    )
    assert _sleeps(sample) == [("a", 4), ("b", 6), ("c", 8), ("d", 10)]


def test_server_tests_carry_the_server_marker() -> None:
    unmarked = []
    for path in TESTS.glob("test_*.py"):
        text = path.read_text()
        if any(use in text for use in SERVER_USES) and "pytest.mark.server" not in text:
            unmarked.append(path.name)
    assert not unmarked, f"start a server but are not marked `server`: {sorted(unmarked)}"


@pytest.mark.parametrize("marker", ["server", "slow", "gpu"])
def test_markers_are_registered(pytestconfig: pytest.Config, marker: str) -> None:
    assert any(line.startswith(f"{marker}:") for line in pytestconfig.getini("markers"))
