"""clients.discovery, which keeps smg's file-discovery manifest equal to the SERVING replicas (the compose `gateway`
profile): the withdrawal rules on their own, then a real server on loopback: listed with its model and
tokenizer, the manifest taken by the real smg binary (an OpenAI completion through it), withdrawn once stopped."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from clients import discovery
from clients.discovery import Probe, Registry
from tests.servers import free_port, running_server
from tests.waiting import wait_until

SMG = shutil.which("smg")


def test_registry_lists_serving_and_withdraws_by_the_rules() -> None:
    reg = Registry(failures_to_drop=2)
    reg.update({"10.0.0.2": Probe(True), "10.0.0.3": Probe(False)}, lambda a: "m")
    assert reg.listed == {"10.0.0.2": "m"}  # one still loading is not handed to smg
    reg.update({"10.0.0.2": Probe(False), "10.0.0.3": Probe(True)}, lambda a: "m")
    assert sorted(reg.listed) == ["10.0.0.2", "10.0.0.3"]  # one missed answer is not enough to drop
    reg.update({"10.0.0.2": Probe(True), "10.0.0.3": Probe(True)}, lambda a: "m")
    reg.update({"10.0.0.2": Probe(False), "10.0.0.3": Probe(True)}, lambda a: "m")
    assert "10.0.0.2" in reg.listed  # the count of misses restarted after it answered
    reg.update({"10.0.0.2": Probe(False), "10.0.0.3": Probe(False, refused=True)}, lambda a: "m")
    assert reg.listed == {}  # two misses in a row; NOT_SERVING (a drain) or refused at once
    reg.update({"10.0.0.4": Probe(True), "fd00::5": Probe(True)}, lambda a: "m")
    reg.update({"fd00::5": Probe(True)}, lambda a: "m")  # 10.0.0.4 no longer resolves: gone at once
    assert reg.manifest(50051, "grpc") == {
        "version": 1,
        "workers": [{"id": "fd00::5", "url": "grpc://[fd00::5]:50051", "model_id": "m"}],
    }


def _argv(port: int, tmp: Path) -> list[str]:
    argv = ["--service", "127.0.0.1", "--port", str(port), "--manifest", str(tmp / "workers.json")]
    argv += ["--tokenizer-dir", str(tmp / "tokenizer")]
    return argv


def _completion(url: str) -> dict:
    body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    body = json.dumps({**body, "ignore_eos": True}).encode()  # exactly 4 tokens, whatever the model says
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _smg_completion(manifest: Path, tokenizer: Path, log: Path) -> dict:
    """The real smg, discovering workers from the manifest: one completion through it."""
    web = free_port()
    cmd = [SMG, "launch", "--host", "127.0.0.1", "--port", str(web), "--prometheus-port", str(free_port())]
    cmd += ["--discovery-provider", "file", "--discovery-file", str(manifest), "--tokenizer-path", str(tokenizer)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:

        def routed() -> dict | None:
            assert proc.poll() is None, log.read_text()[-800:]
            try:
                return _completion(f"http://127.0.0.1:{web}")
            except OSError:
                return None

        return wait_until(routed, "smg routing to the discovered worker", 90)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
@pytest.mark.server
def test_discovery_lists_a_serving_worker_for_smg_and_withdraws_it(smollm2_engine_dir: Path, tmp_path: Path) -> None:
    with running_server(smollm2_engine_dir) as srv:
        port = int(srv.target.rsplit(":", 1)[1])
        argv = _argv(port, tmp_path)
        assert discovery.main([*argv, "--once"]) == 0
        manifest = json.loads((tmp_path / "workers.json").read_text())
        model = srv.server.backend.info.model_name
        assert manifest == {
            "version": 1,
            "workers": [{"id": "127.0.0.1", "url": f"grpc://127.0.0.1:{port}", "model_id": model}],
        }
        tokenizer = tmp_path / "tokenizer" / model
        ids = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode("Hello world", add_special_tokens=False).ids
        assert ids == srv.server.backend.tokenizer.encode("Hello world")
        if SMG is not None:  # what smg takes: the manifest, and the tokenizer directory named after the model
            out = _smg_completion(tmp_path / "workers.json", tokenizer, tmp_path / "smg.log")
            assert out["usage"]["completion_tokens"] == 4
        args = discovery.parse_args(argv)  # one registry across the stop, as in the long-running loop
        registry = Registry(failures_to_drop=3)
        discovery.one_pass(args, discovery.Prober(args), registry)
        assert list(registry.listed) == ["127.0.0.1"]
    discovery.one_pass(args, discovery.Prober(args), registry)  # refused: withdrawn at once, not after 3 passes
    assert json.loads((tmp_path / "workers.json").read_text())["workers"] == []
    assert discovery.main([*argv, "--once"]) == 1
