"""The startup ceilings (the step metrics' roofline): measured after SERVING, in a child process, never in the
server's own (service/api/server.py _measure_ceilings, service/engine/roofline.py main)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import service.api.server as server_module
from service.engine.roofline import main as roofline_main
from tests.engines import build_tiny
from tests.servers import running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-ceilings")


def _fake(monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    """Stand in for the measurement (seconds and a 4x-LLC buffer) with a child printing `script`'s output."""
    monkeypatch.setattr(server_module, "CEILINGS_COMMAND", (sys.executable, "-c", script))


def test_the_gauges_come_from_the_child_after_serving(engine_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake(monkeypatch, "import json; print(json.dumps({'gemm_gflops': 123.0, 'read_gbytes_per_s': 45.5}))")
    with running_server(engine_dir, measure_ceilings=True) as server:
        wait_until(lambda: server.metric("llm_machine_read_gbytes_per_second") == 45.5, "the ceiling gauges set")
        assert server.metric("llm_machine_gemm_gflops") == 123.0


def test_a_failed_measurement_leaves_the_gauges_unset_and_serves_on(
    engine_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake(monkeypatch, "print('not json')")
    with running_server(engine_dir, measure_ceilings=True) as server:
        wait_until(lambda: not server.server._tasks, "the measurement task ended")
        assert server.metric("llm_machine_read_gbytes_per_second") == 0.0
        assert server.idle()


def test_the_child_prints_both_ceilings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from service.telemetry import Ceilings

    monkeypatch.setattr("service.engine.roofline.measure_ceilings", lambda quick: Ceilings(10.0, 2.5))
    roofline_main()
    assert json.loads(capsys.readouterr().out) == {"gemm_gflops": 10.0, "read_gbytes_per_s": 2.5}
