"""Command-line surface: --help shows defaults and explains every flag; console commands beside python -m."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = {  # console script -> the python -m module it runs
    "llm-serve": "service",
    "llm-build-engine": "build_engine",
    "llm-offline": "service.offline",
    "llm-stream": "clients.stream",
    "llm-health": "clients.health",
    "llm-loadtest": "clients.loadtest",
}


def _help(*cmd: str) -> str:
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_console_commands_run_the_modules(script: str) -> None:
    path = shutil.which(script) or str(Path(sys.executable).parent / script)
    assert Path(path).is_file(), f"{script} is not installed (pip install -e .)"
    assert _help(path) == _help(sys.executable, "-m", COMMANDS[script])


def test_help_shows_defaults() -> None:
    text = " ".join(_help(sys.executable, "-m", "service").split())
    for expected in ("(default: 50051)", "(default: auto)", "(default: exit)", "(default: 30.0)"):
        assert expected in text
    assert "(default: 16)" in " ".join(_help(sys.executable, "-m", "build_engine").split())


def test_every_stream_flag_has_help() -> None:
    lines = _help(sys.executable, "-m", "clients.stream").splitlines() + [""]
    bare = [  # a flag (and its metavar) alone on its line, with no help text on the next line either
        line.split()[0]
        for line, nxt in itertools.pairwise(lines)
        if line.startswith("  --") and len(line.split()) <= 2 and not nxt.startswith(" " * 8)
    ]
    assert not bare, f"flags without help: {bare}"


@pytest.mark.parametrize("module", ["clients.stream", "clients.health", "clients.loadtest", "service.offline"])
def test_help_names_each_default_once_and_only_real_ones(module: str) -> None:
    text = " ".join(_help(sys.executable, "-m", module).split())
    assert "(default: None)" not in text or module == "service.offline"  # offline's own defaults are real
    assert "(default: made up) (default" not in text and ") (default: )" not in text


def test_every_offline_flag_has_help() -> None:
    lines = _help(sys.executable, "-m", "service.offline").splitlines() + [""]
    bare = [
        line.split()[0]
        for line, nxt in itertools.pairwise(lines)
        if line.startswith("  --") and len(line.split()) <= 2 and not nxt.startswith(" " * 8)
    ]
    assert not bare, f"flags without help: {bare}"


def test_event_loop_flag_picks_the_loop() -> None:
    from service.__main__ import config_from_args, parse_args, run_loop

    assert config_from_args(parse_args(["--engine", "e"])).event_loop == "auto"
    assert config_from_args(parse_args(["--engine", "e", "--event-loop", "asyncio"])).event_loop == "asyncio"

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run_loop(loop_module, "asyncio").startswith("asyncio")
    pytest.importorskip("uvloop")
    assert run_loop(loop_module, "auto").startswith("uvloop")
    assert run_loop(loop_module, "uvloop").startswith("uvloop")
