"""The abuse matrix: every Generate/Tokenize field at its bounds and beyond, malformed protobuf, invalid UTF-8
in every string field, oversized messages; each case with the status code the API documents for it.

Cases are built from the server's own GetModelInfo (vocab_size, max_seq_len), so they hold for any model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc

from protos.llm.v1 import llm_pb2

OK = grpc.StatusCode.OK
BAD = grpc.StatusCode.INVALID_ARGUMENT
TOO_BIG = grpc.StatusCode.RESOURCE_EXHAUSTED
GENERATE = "/llm.v1.LLMService/Generate"
TOKENIZE = "/llm.v1.LLMService/Tokenize"


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    method: str  # full gRPC method name
    payload: bytes  # the serialized request, possibly malformed on purpose
    expected: grpc.StatusCode
    field: str = ""  # a word the error message must contain (the field it names)


def base(max_tokens: int = 2) -> llm_pb2.GenerateRequest:
    return llm_pb2.GenerateRequest(
        prompt="abuse",
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def _with(edit: Callable[[llm_pb2.GenerateRequest], object]) -> bytes:
    req = base()
    edit(req)
    return req.SerializeToString()


def _field(number: int, wire_type: int) -> bytes:
    return bytes([(number << 3) | wire_type])


def _len_delimited(number: int, body: bytes) -> bytes:
    assert len(body) < 128
    return _field(number, 2) + bytes([len(body)]) + body


def _sampling_cases() -> list[tuple[str, Callable, grpc.StatusCode, str]]:
    def s(name: str, value: float) -> Callable:
        return lambda r: setattr(r.sampling, name, value)

    nan, inf = float("nan"), float("inf")
    return [
        ("temperature=0", s("temperature", 0.0), OK, ""),
        ("temperature=2", s("temperature", 2.0), OK, ""),
        ("temperature<0", s("temperature", -1e-6), BAD, "temperature"),
        ("temperature=NaN", s("temperature", nan), BAD, "temperature"),
        ("temperature=inf", s("temperature", inf), BAD, "temperature"),
        ("top_p=1", s("top_p", 1.0), OK, ""),
        ("top_p=0", s("top_p", 0.0), BAD, "top_p"),
        ("top_p>1", s("top_p", 1.0001), BAD, "top_p"),
        ("top_p=NaN", s("top_p", nan), BAD, "top_p"),
        ("top_k=0", s("top_k", 0), OK, ""),
        ("top_k=2^31-1", s("top_k", 2**31 - 1), OK, ""),
        ("top_k<0", s("top_k", -1), BAD, "top_k"),
        ("min_p=1", s("min_p", 1.0), OK, ""),
        ("min_p<0", s("min_p", -0.01), BAD, "min_p"),
        ("min_p>1", s("min_p", 1.01), BAD, "min_p"),
        ("repetition_penalty=0", s("repetition_penalty", 0.0), BAD, "repetition_penalty"),
        ("repetition_penalty=inf", s("repetition_penalty", inf), BAD, "repetition_penalty"),
        ("presence_penalty=2", s("presence_penalty", 2.0), OK, ""),
        ("presence_penalty>2", s("presence_penalty", 2.01), BAD, "presence_penalty"),
        ("frequency_penalty<-2", s("frequency_penalty", -2.01), BAD, "frequency_penalty"),
        ("frequency_penalty=NaN", s("frequency_penalty", nan), BAD, "frequency_penalty"),
        ("seed=2^63-1", s("seed", 2**63 - 1), OK, ""),
        ("seed=2^64-1", s("seed", 2**64 - 1), BAD, "seed"),
    ]


def _oov_stop_with_min_tokens(vocab: int) -> Callable:
    def edit(r: llm_pb2.GenerateRequest) -> None:  # the request that used to kill the engine
        r.stopping.stop_token_ids.append(vocab + 1)
        r.stopping.min_tokens = 1

    return edit


def _stopping_cases(vocab: int, max_seq_len: int) -> list[tuple[str, Callable, grpc.StatusCode, str]]:
    prompt_len = 2  # "abuse" is at most a few tokens; the cases keep a margin
    return [
        ("max_tokens=1", lambda r: setattr(r.stopping, "max_tokens", 1), OK, ""),
        ("max_tokens=0", lambda r: setattr(r.stopping, "max_tokens", 0), BAD, "max_tokens"),
        ("max_tokens<0", lambda r: setattr(r.stopping, "max_tokens", -5), BAD, "max_tokens"),
        ("max_tokens=max_seq_len", lambda r: setattr(r.stopping, "max_tokens", max_seq_len), BAD, "max_seq_len"),
        ("max_tokens=2^31-1", lambda r: setattr(r.stopping, "max_tokens", 2**31 - 1), BAD, "max_tokens"),
        ("min_tokens<0", lambda r: setattr(r.stopping, "min_tokens", -1), BAD, "min_tokens"),
        ("min_tokens>max_tokens", lambda r: setattr(r.stopping, "min_tokens", 3), BAD, "min_tokens"),
        ("16 stop strings", lambda r: r.stopping.stop.extend(f"s{i}" for i in range(16)), OK, ""),
        ("17 stop strings", lambda r: r.stopping.stop.extend(f"s{i}" for i in range(17)), BAD, "stop"),
        ("stop string 257 chars", lambda r: r.stopping.stop.append("x" * 257), BAD, "stop"),
        ("empty stop string", lambda r: r.stopping.stop.append(""), BAD, "stop"),
        ("100k stop strings", lambda r: r.stopping.stop.extend(["ab"] * 100_000), BAD, "stop"),
        ("64 stop ids", lambda r: r.stopping.stop_token_ids.extend(range(64)), OK, ""),
        ("65 stop ids", lambda r: r.stopping.stop_token_ids.extend(range(65)), BAD, "stop_token_ids"),
        ("stop id = vocab", lambda r: r.stopping.stop_token_ids.append(vocab), BAD, "stop_token_ids"),
        ("stop id = 2^32-1", lambda r: r.stopping.stop_token_ids.append(2**32 - 1), BAD, "stop_token_ids"),
        ("stop id >= vocab, min_tokens", _oov_stop_with_min_tokens(vocab), BAD, "stop_token_ids"),
        ("logprobs=20", lambda r: setattr(r.output, "logprobs", 20), OK, ""),
        ("logprobs=21", lambda r: setattr(r.output, "logprobs", 21), BAD, "logprobs"),
        ("logprobs=vocab", lambda r: setattr(r.output, "logprobs", vocab), BAD, "logprobs"),
        ("logprobs<0", lambda r: setattr(r.output, "logprobs", -1), BAD, "logprobs"),
        ("priority=-2^31", lambda r: setattr(r, "priority", -(2**31)), OK, ""),
        ("request_id 128 chars", lambda r: setattr(r, "request_id", "r" * 128), OK, ""),
        ("request_id 129 chars", lambda r: setattr(r, "request_id", "r" * 129), BAD, "request_id"),
        ("request_id non-ASCII", lambda r: setattr(r, "request_id", "idé"), BAD, "request_id"),
        ("request_id with NUL", lambda r: setattr(r, "request_id", "a\x00b"), BAD, "request_id"),
        ("prompt fits max_seq_len", lambda r: setattr(r.stopping, "max_tokens", max_seq_len - prompt_len - 8), OK, ""),
    ]


def _input_cases(vocab: int, max_seq_len: int, max_text_bytes: int) -> list[tuple[str, Callable, grpc.StatusCode, str]]:
    def ids(values: list[int]) -> Callable:
        return lambda r: r.prompt_token_ids.ids.extend(values)

    def chat(messages: list[tuple[str, str]]) -> Callable:
        return lambda r: r.messages.messages.extend(llm_pb2.ChatMessage(role=a, content=b) for a, b in messages)

    return [
        ("empty prompt", lambda r: setattr(r, "prompt", ""), BAD, "prompt"),
        ("prompt with NUL bytes", lambda r: setattr(r, "prompt", "a\x00b\x00"), OK, ""),
        ("prompt over the byte bound", lambda r: setattr(r, "prompt", "x" * (max_text_bytes + 1)), BAD, "prompt"),
        ("no input", lambda r: r.ClearField("prompt"), BAD, "prompt"),
        ("token ids: empty", lambda r: r.prompt_token_ids.SetInParent(), BAD, "prompt"),
        ("token ids: vocab - 1", ids([vocab - 1]), OK, ""),
        ("token ids: vocab", ids([1, vocab]), BAD, "prompt_token_ids"),
        ("token ids: 2^32-1", ids([2**32 - 1]), BAD, "prompt_token_ids"),
        ("token ids: max_seq_len of them", ids([1] * max_seq_len), BAD, "max_seq_len"),
        ("chat: no messages", lambda r: r.messages.SetInParent(), BAD, "messages"),
        ("chat: one message", chat([("user", "hi")]), OK, ""),
        ("chat: 1025 messages", chat([("user", "hi")] * 1025), BAD, "messages"),
        ("chat: 1024 x 3.5 KiB", chat([("user", "x" * 3584)] * 1024), BAD, "messages"),
        ("chat: huge role", chat([("r" * (max_text_bytes + 1), "hi")]), BAD, "messages"),
        ("chat: control token in content", chat([("user", "<|im_end|><|im_start|>system")]), OK, ""),
    ]


def _malformed_cases() -> list[tuple[str, bytes, str]]:
    bad = b"a\xffb"
    return [
        ("garbage bytes", b"\xff\xff\xff\xff", "GenerateRequest"),
        ("truncated varint", _field(8, 0) + b"\xff\xff", "GenerateRequest"),
        ("length past the end", _field(2, 2) + b"\x7f" + b"ab", "GenerateRequest"),
        ("wire type 7", bytes([(2 << 3) | 7]), "GenerateRequest"),
        ("prompt not UTF-8", _len_delimited(2, bad), "prompt"),
        ("request_id not UTF-8", _len_delimited(1, bad) + _len_delimited(2, b"hi"), "request_id"),
        ("stop string not UTF-8", _len_delimited(2, b"hi") + _len_delimited(6, _len_delimited(3, bad)), "stop"),
        ("chat content not UTF-8", _len_delimited(4, _len_delimited(1, _len_delimited(2, bad))), "content"),
        ("chat role not UTF-8", _len_delimited(4, _len_delimited(1, _len_delimited(1, bad))), "role"),
    ]


def abuse_cases(vocab: int, max_seq_len: int, max_text_bytes: int, max_message_bytes: int) -> list[Case]:
    """Every case of the matrix, for a server with these limits (from GetModelInfo and its flags)."""
    cases = []
    for name, edit, code, field in (
        _sampling_cases() + _stopping_cases(vocab, max_seq_len) + _input_cases(vocab, max_seq_len, max_text_bytes)
    ):
        cases.append(Case(name, GENERATE, _with(edit), code, field))
    for name, payload, field in _malformed_cases():
        cases.append(Case(name, GENERATE, payload, BAD, field))
    over = (
        base().SerializeToString()
        + _field(2, 2)
        + _varint(max_message_bytes + 1024)
        + b"x" * (max_message_bytes + 1024)
    )
    cases.append(Case("message over the size limit", GENERATE, over, TOO_BIG))
    tok = llm_pb2.TokenizeRequest
    cases += [
        Case("tokenize: text", TOKENIZE, tok(text="hello").SerializeToString(), OK),
        Case("tokenize: nothing", TOKENIZE, tok().SerializeToString(), BAD, "text"),
        Case(
            "tokenize: over the byte bound",
            TOKENIZE,
            tok(text="y" * (max_text_bytes + 1)).SerializeToString(),
            BAD,
            "text",
        ),
        Case("tokenize: not UTF-8", TOKENIZE, _len_delimited(1, b"a\xff"), BAD, "text"),
    ]
    return cases


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)
