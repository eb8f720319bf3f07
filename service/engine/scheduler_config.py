"""Runtime configuration of the engine (a leaf module), and KV cache sizing from a memory budget."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from build_engine.spec import EngineConfig


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int  # sequences per step (the engine's max_batch_size)
    max_num_batched_tokens: int  # tokens per step (prefill chunks + decodes; the engine's max_num_tokens)
    max_seq_len: int  # prompt + output tokens of one request
    block_size: int  # tokens per KV block
    num_kv_blocks: int  # blocks in the pool
    enable_prefix_caching: bool = True
    max_bypass: int = 8  # later requests admitted ahead of a waiting head before admission stops for it
    # While decodes run, one prefill chunk costs at most this many tokens' work (0: no cap), so the step that
    # carries the decodes stays short (docs/scheduling.md); attention_cost_per_key converts the keys a chunk's
    # tokens attend to into that unit, so a chunk deep into a long prompt is shorter than one at its start.
    long_prefill_token_threshold: int = 0
    attention_cost_per_key: float = 0.0  # one token's attention to one key / its linear layers' work (FLOPs)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len", "block_size", "num_kv_blocks"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_bypass < 0:
            raise ValueError(f"max_bypass must be >= 0, got {self.max_bypass}")
        if self.long_prefill_token_threshold < 0 or self.attention_cost_per_key < 0:
            raise ValueError("long_prefill_token_threshold and attention_cost_per_key must be >= 0")

    def prefill_cap(self, num_computed: int) -> int | None:
        """Tokens one prefill chunk may take while decodes run, `num_computed` tokens into its prompt."""
        if not self.long_prefill_token_threshold:
            return None
        cost = 1.0 + self.attention_cost_per_key * num_computed
        return max(1, int(self.long_prefill_token_threshold / cost))

    @classmethod
    def from_engine(cls, engine: EngineConfig, num_kv_blocks: int, **overrides: object) -> SchedulerConfig:
        """The engine's limits, with overrides; long_prefill_token_threshold None (the service's default) is a
        quarter of the step's token budget."""
        limits = engine.limits
        values = {
            "max_num_seqs": limits.max_batch_size,
            "max_num_batched_tokens": limits.max_num_tokens,
            "max_seq_len": limits.max_seq_len,
            "block_size": limits.kv_block_size,
            "num_kv_blocks": num_kv_blocks,
            "attention_cost_per_key": attention_cost_per_key(engine),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if overrides.get("long_prefill_token_threshold") is None:
            values["long_prefill_token_threshold"] = values["max_num_batched_tokens"] // LONG_PREFILL_BUDGET_SHARE
        return cls(**values)


LONG_PREFILL_BUDGET_SHARE = 4  # the default prefill chunk cap while decodes run: a quarter of the step's budget


def attention_cost_per_key(engine: EngineConfig) -> float:
    """FLOPs of one token attending to one key (QK and PV over every query head and layer) over the FLOPs of its
    linear layers (2 per weight of the transformer layers): how much one more key costs, in tokens."""
    a = engine.arch
    layer_weights = a.num_hidden_layers * (
        a.hidden_size * (a.q_size + 2 * a.kv_size) + a.q_size * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
    )
    return 4 * a.q_size * a.num_hidden_layers / (2 * layer_weights)


def available_memory_bytes() -> int:
    """MemAvailable of the machine, capped by a cgroup (container) limit when there is one."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit():
            avail = min(avail, int(raw))
    return avail


def parse_memory(value: str) -> tuple[int | None, float | None]:
    """'0.1' or '10%' -> a fraction of available memory; '512MiB', '2G', '1000000' -> bytes."""
    text = value.strip()
    if text.endswith("%"):
        return None, float(text[:-1]) / 100
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?", text, re.I)
    if m and m.group(2):
        unit = m.group(2).upper().rstrip("B").rstrip("I")
        scale = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
        return int(float(m.group(1)) * scale), None
    number = float(text)
    if 0 < number <= 1:
        return None, number
    return int(number), None


AUTO_KV_FRACTION = 0.10  # the cap of --kv-cache-memory auto, as a fraction of available memory


def kv_blocks_for_budget(
    engine: EngineConfig, budget: str, bytes_per_block: int, max_num_seqs: int | None = None
) -> tuple[int, int]:
    """Number of KV blocks for '--kv-cache-memory'; returns (blocks, budget in bytes).

    'auto': what the engine's limits can use (max_num_seqs sequences of max_seq_len tokens, so a full batch never
    preempts), capped at AUTO_KV_FRACTION of available memory but never below one max_seq_len request.
    Otherwise bytes ('512MiB', '2G') or a fraction of available memory ('0.25', '25%').
    """
    per_request = -(-engine.limits.max_seq_len // engine.limits.kv_block_size)
    if budget.strip().lower() == "auto":
        wanted = (max_num_seqs or engine.limits.max_batch_size) * per_request
        cap = int(available_memory_bytes() * AUTO_KV_FRACTION) // bytes_per_block
        blocks = max(per_request, min(wanted, cap))
        return blocks, blocks * bytes_per_block
    absolute, fraction = parse_memory(budget)
    if fraction is not None:
        if not 0 < fraction <= 0.95:
            raise ValueError(f"kv cache memory fraction must be in (0, 0.95], got {fraction}")
        absolute = int(available_memory_bytes() * fraction)
    blocks = absolute // bytes_per_block
    if blocks < per_request:
        raise ValueError(
            f"kv cache memory {absolute} bytes holds {blocks} blocks, fewer than the {per_request} one request of "
            f"max_seq_len={engine.limits.max_seq_len} may need; raise --kv-cache-memory or rebuild with a smaller "
            "--max-seq-len"
        )
    return blocks, absolute
