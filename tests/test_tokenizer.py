"""Tokenizer, chat template and streaming detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_golden.json").read_text())
MULTIBYTE = [
    "Hello world, how are you?",
    " leading space and  double  spaces",
    "Café crème brûlée, naïve façade, Ångström",
    "东京和北京都是大城市。你好，世界！",
    "日本語のテキストと한국어",
    "emoji 😀🎉 and 👍🏽 and flags 🇫🇷🇯🇵",
    "mixed: ok ✓, math ∑∫√, arrows → ←, €100",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_engine_dir(smollm2_engine_dir)


@pytest.fixture(scope="module")
def tiny(tiny_engine_dir: Path) -> Tokenizer:
    return Tokenizer.from_engine_dir(tiny_engine_dir)


@pytest.mark.parametrize("case", GOLDEN["tokenizer_cases"], ids=lambda c: repr(c["text"])[:30])
def test_encode_matches_transformers(smollm2: Tokenizer, case: dict) -> None:
    assert smollm2.encode(case["text"]) == case["ids"]


def test_digits_are_isolated_like_llama_cpp_smollm(smollm2: Tokenizer) -> None:
    # the one documented difference from transformers' GGUF loader (plain GPT-2 split gives [216, 216, 33])
    assert smollm2.encode("  1") == [256, 33]
    assert smollm2.encode("2024") == [34, 32, 34, 36]


def test_decode_keeps_special_tokens_unless_asked(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert smollm2.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template_renders_like_transformers(smollm2: Tokenizer) -> None:
    text = smollm2.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = smollm2.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=False)
    assert no_prompt.endswith("Hi there<|im_end|>\n") and "<|im_start|>assistant" not in no_prompt


def test_chat_ids_match_golden(smollm2: Tokenizer) -> None:
    for case in GOLDEN["cases"]:
        if case["kind"] == "chat":
            assert smollm2.encode_chat(case["messages"]) == case["prompt_token_ids"]


def test_model_without_template_raises(smollm2: Tokenizer) -> None:
    bare = Tokenizer(smollm2._tok, smollm2.special, chat_template=None)
    with pytest.raises(ChatTemplateError):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def _stream(tokenizer: Tokenizer, prompt: str, output: str) -> tuple[list[str], str]:
    prompt_ids = tokenizer.encode(prompt)
    out_ids = tokenizer.encode(output, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.push(t) for t in out_ids]
    deltas.append(detok.flush())
    return deltas, tokenizer.decode(out_ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("which", ["smollm2", "tiny"])
def test_incremental_detokenizer_equals_full_decode(text: str, which: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(which)
    deltas, full = _stream(tokenizer, "Prompt:", text)
    assert "".join(deltas) == full == text
    assert not any("\ufffd" in d for d in deltas), "a delta split a multi-byte character"


def test_detokenizer_holds_back_partial_characters(tiny: Tokenizer) -> None:
    # the tiny tokenizer has one token per byte: a 4-byte emoji arrives as 4 tokens, emitted once, whole
    deltas, _ = _stream(tiny, "x", "😀")
    assert deltas[:4] == ["", "", "", "😀"]


def test_detokenizer_keeps_leading_space_of_first_token(smollm2: Tokenizer) -> None:
    deltas, _ = _stream(smollm2, "The capital of France is", " Paris. It is")
    assert deltas[0] == " Paris"


def test_detokenizer_flush_emits_invalid_tail(tiny: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tiny, tiny.encode("x"))
    emoji_bytes = tiny.encode("😀", add_special_tokens=False)
    assert [detok.push(t) for t in emoji_bytes[:2]] == ["", ""]
    assert detok.flush() == "\ufffd"  # the stream ended inside a character: shown as a replacement character


def test_detokenizer_skips_special_tokens(smollm2: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("hi"))
    assert detok.push(smollm2.encode(" there")[0]) == " there"
    assert detok.push(2) == ""  # <|im_end|>
    assert detok.text == " there"
