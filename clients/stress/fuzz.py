"""Seeded field-level fuzzing: valid Generate requests with mutated values (edge numbers, odd strings, long
lists), plus a share of byte-level mutations of the serialized message. Same seed, same requests."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from protos.llm.v1 import llm_pb2

FLOATS = (0.0, -0.0, 5e-324, 1e-9, 0.01, 0.5, 1.0, 1.0000001, 1.5, 2.0, 2.0001, -2.0, -2.0001, 3.4e38, -1e30,
          float("nan"), float("inf"), float("-inf"))  # fmt: skip
STRINGS = ("", "a", "\x00", "\x00\x00abc", "<|im_end|>", "<|im_start|>system\n", "é" * 300, "😀" * 100, "x" * 257,
           "\ufffd", "\u202e", " " * 40, "\n\n", "1 2 3")  # fmt: skip


def _ints(vocab: int, max_seq_len: int) -> tuple[int, ...]:
    edges = (0, 1, 2, 15, 16, 17, 20, 21, 63, 64, 65, 255, 256, 1023, 1024, 2**31 - 1)
    model = (vocab - 1, vocab, vocab + 1, max_seq_len - 1, max_seq_len, max_seq_len + 1)
    return edges + model + tuple(-v for v in (1, 2, 1024, 2**31))


class Fuzzer:
    """Yields (label, serialized request) pairs; each request starts valid and gets 1 to 4 mutated fields."""

    def __init__(self, seed: int, vocab: int, max_seq_len: int, byte_mutation_share: float = 0.1) -> None:
        self.rng = random.Random(seed)
        self.vocab, self.max_seq_len = vocab, max_seq_len
        self.ints = _ints(vocab, max_seq_len)
        self.byte_share = byte_mutation_share
        self.mutations: dict[str, Callable[[llm_pb2.GenerateRequest], None]] = self._mutations()

    def _int(self) -> int:
        return self.rng.choice(self.ints) if self.rng.random() < 0.8 else self.rng.randint(-(2**31), 2**31 - 1)

    def _float(self) -> float:
        return self.rng.choice(FLOATS) if self.rng.random() < 0.8 else self.rng.uniform(-5, 5)

    def _string(self) -> str:
        if self.rng.random() < 0.8:
            return self.rng.choice(STRINGS)
        return "".join(chr(self.rng.choice((self.rng.randint(32, 126), self.rng.randint(0x80, 0xD7FF))))
                       for _ in range(self.rng.randint(0, 64)))  # fmt: skip

    def _uint(self) -> int:
        v = self._int()
        return v if 0 <= v < 2**32 else self.rng.choice((0, 2**32 - 1, self.vocab))

    def _mutations(self) -> dict[str, Callable[[llm_pb2.GenerateRequest], None]]:
        r = self

        def setter(path: str, draw: Callable[[], object]) -> Callable[[llm_pb2.GenerateRequest], None]:
            parent, _, name = path.rpartition(".")

            def apply(req: llm_pb2.GenerateRequest) -> None:
                target = getattr(req, parent) if parent else req
                value = draw()
                if name == "seed":
                    value = abs(int(value)) if isinstance(value, int) else r.rng.choice((0, 2**63, 2**64 - 1))
                setattr(target, name, value)

            return apply

        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
        muts = {f"sampling.{n}": setter(f"sampling.{n}", r._float) for n in floats}
        muts.update({
            "sampling.top_k": setter("sampling.top_k", r._int),
            "sampling.seed": setter("sampling.seed", r._int),
            "stopping.max_tokens": setter("stopping.max_tokens", r._int),
            "stopping.min_tokens": setter("stopping.min_tokens", r._int),
            "stopping.ignore_eos": setter("stopping.ignore_eos", lambda: r.rng.random() < 0.5),
            "output.logprobs": setter("output.logprobs", r._int),
            "output.include_special_tokens": setter("output.include_special_tokens", lambda: r.rng.random() < 0.5),
            "priority": setter("priority", r._int),
            "request_id": setter("request_id", r._string),
            "prompt": setter("prompt", r._string),
            "stopping.stop": lambda q: q.stopping.stop.extend(r._string() for _ in range(r.rng.choice((1, 16, 17)))),
            "stopping.stop_token_ids": lambda q: q.stopping.stop_token_ids.extend(
                r._uint() for _ in range(r.rng.choice((1, 64, 65)))),
            "prompt_token_ids": lambda q: q.prompt_token_ids.ids.extend(
                r._uint() for _ in range(r.rng.choice((0, 1, 5, r.max_seq_len)))),
            "messages": lambda q: q.messages.messages.extend(
                llm_pb2.ChatMessage(role=r._string(), content=r._string()) for _ in range(r.rng.choice((0, 1, 3)))),
        })  # fmt: skip
        return muts

    def _valid(self) -> llm_pb2.GenerateRequest:
        req = llm_pb2.GenerateRequest(
            sampling=llm_pb2.SamplingParams(temperature=self.rng.choice((0.0, 0.7))),
            stopping=llm_pb2.StoppingParams(max_tokens=self.rng.randint(1, 8), ignore_eos=True),
        )
        kind = self.rng.random()
        if kind < 0.6:
            req.prompt = "fuzz " * self.rng.randint(1, 20)
        elif kind < 0.8:
            req.prompt_token_ids.ids.extend(self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 30)))
        else:
            req.messages.messages.add(role="user", content="fuzz")
        return req

    def _bytes(self, data: bytes) -> bytes:
        buf = bytearray(data)
        for _ in range(self.rng.randint(1, 4)):
            op, i = self.rng.random(), self.rng.randrange(len(buf) + 1)
            if op < 0.4 and buf:
                buf[min(i, len(buf) - 1)] = self.rng.randrange(256)
            elif op < 0.7:
                buf[i:i] = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 8)))
            else:
                del buf[i : i + self.rng.randint(1, 8)]
        return bytes(buf)

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        names = sorted(self.mutations)
        while True:
            req = self._valid()
            chosen = self.rng.sample(names, self.rng.randint(1, 4))
            for name in chosen:
                self.mutations[name](req)
            data = req.SerializeToString()
            if self.rng.random() < self.byte_share:
                yield "bytes+" + "+".join(chosen), self._bytes(data)
            else:
                yield "+".join(chosen), data
