"""The offline CLI: single prompt (streamed or JSON) and a JSONL file of prompts run concurrently."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from service.engine.core import EngineCore
from service.request import GenerateRequest, SamplingParams


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "service.offline", "--kv-cache-memory", "64MiB", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def test_json_output_matches_the_engine(tiny_engine_dir: Path) -> None:
    result = _cli(
        "--engine", str(tiny_engine_dir), "--prompt", "Hello there", "--max-tokens", "12", "--ignore-eos", "--json"
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert set(doc) >= {"prompt_token_ids", "token_ids", "text", "finish_reason", "timing"}
    assert set(doc["timing"]) >= {"prefill_ms", "decode_ms", "tpot_ms"}
    assert doc["finish_reason"] == "length" and len(doc["token_ids"]) == 12
    engine = EngineCore(tiny_engine_dir, num_kv_blocks=64)
    ids = engine.tokenizer.encode("Hello there")
    outs = engine.generate([GenerateRequest("x", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])[
        "x"
    ]
    assert doc["prompt_token_ids"] == ids
    assert doc["token_ids"] == [t for o in outs for t in o.new_token_ids]
    assert doc["text"] == "".join(o.new_text for o in outs)


def test_streamed_text_and_timing_on_stderr(tiny_engine_dir: Path) -> None:
    result = _cli("--engine", str(tiny_engine_dir), "--prompt", "Hi", "--chat", "--max-tokens", "5", "--ignore-eos")
    assert result.returncode == 0 and "prefill" in result.stderr and "TPOT" in result.stderr


def test_prompts_file_runs_concurrently(tiny_engine_dir: Path, tmp_path: Path) -> None:
    lines = [
        {"prompt": "one", "max_tokens": 4, "ignore_eos": True},
        {"messages": [{"role": "user", "content": "two"}], "max_tokens": 6, "ignore_eos": True},
        {"id": "three", "prompt": "three", "max_tokens": 3, "temperature": 0.8, "seed": 3},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    result = _cli("--engine", str(tiny_engine_dir), "--prompts-file", str(path))
    assert result.returncode == 0, result.stderr
    docs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [d["id"] for d in docs] == ["0", "1", "three"]
    assert [len(d["token_ids"]) for d in docs[:2]] == [4, 6] and len(docs[2]["token_ids"]) <= 3
    assert "tok/s" in result.stderr


def test_bad_arguments_exit_2(tiny_engine_dir: Path, tmp_path: Path) -> None:
    bad = _cli("--engine", str(tiny_engine_dir), "--prompt", "x", "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr
    missing = _cli("--engine", str(tmp_path / "nope"), "--prompt", "x")
    assert missing.returncode == 2 and "does not exist" in missing.stderr


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "ok"}', "", '{"prompt": 5}'], 'p.jsonl:3: "prompt" must be a string, got int'),
        (['{"promt": "typo"}'], "p.jsonl:1: unknown key(s) 'promt'"),
        (["", "", "not json"], "p.jsonl:3: Expecting value"),
        (['{"prompt": "x", "temperature": "hot"}'], "p.jsonl:1: a sampling field has the wrong type"),
        (['{"prompt": "x", "max_tokens": 0}'], "p.jsonl:1: max_tokens must be >= 1"),
        (['{"prompt_token_ids": [1]}'], "p.jsonl:1: unknown key(s) 'prompt_token_ids'"),
        (['{"prompt": "x", "stop_token_ids": [99999]}'], "p.jsonl:1: stopping.stop_token_ids contains token id 99999"),
        (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], "p.jsonl:2: id 'a' is used twice"),
        (['{"messages": "hi"}'], 'p.jsonl:1: "messages" must be a non-empty list'),
        (["[1, 2]"], "p.jsonl:1: each line must be a JSON object, got list"),
    ],
)
def test_prompts_file_errors_name_the_line(tiny_engine_dir: Path, tmp_path: Path, lines, message) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines) + "\n")
    result = _cli("--engine", str(tiny_engine_dir), "--prompts-file", str(path))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
    assert message in result.stderr
