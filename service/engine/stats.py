"""The FLOPs and bytes an engine step has to move, counted from the model's shapes (for StepStats)."""

from __future__ import annotations

from build_engine.spec import ModelArch
from service.engine.scheduler_output import SchedulerOutput

FP32 = 4


class StepCost:
    """FLOPs and bytes of one forward pass, from the architecture and the bytes the weights are stored in
    (`weight_bytes`: what the runner holds, 4-bit blocks as such; None: fp32 weights); the KV cache is fp32."""

    def __init__(self, arch: ModelArch, weight_bytes: int | None = None) -> None:
        d, f = arch.hidden_size, arch.intermediate_size
        self.layers = arch.num_hidden_layers
        self.layer_params = d * (arch.q_size + 2 * arch.kv_size) + arch.q_size * d + 3 * d * f
        self.head_params = arch.vocab_size * d
        self.attn_per_pair = 4 * arch.num_attention_heads * arch.head_dim  # QK^T + PV per (query, key), per layer
        self.kv_bytes_per_token = 2 * arch.kv_size * FP32  # K and V, per layer
        fp32 = (self.layers * self.layer_params + self.head_params) * FP32
        self.weight_bytes = fp32 if weight_bytes is None else weight_bytes

    def of(self, sched: SchedulerOutput) -> tuple[float, float]:
        """(flops, bytes) of the step the scheduler decided."""
        tokens = sched.total_num_scheduled_tokens
        sampled = sum(1 + s.num_drafts for s in sched.scheduled if s.sample)  # LM head rows
        pairs = 0  # (query, visible key) pairs over the batch
        context = 0  # KV tokens read
        for s in sched.scheduled:
            n, c = len(s.token_ids), s.num_computed
            pairs += n * c + n * (n + 1) // 2
            context += c + n
        flops = 2 * self.layers * self.layer_params * tokens + self.layers * self.attn_per_pair * pairs
        flops += 2 * self.head_params * sampled
        kv = self.layers * self.kv_bytes_per_token * (context + tokens)  # read every visible key, write the new
        return float(flops), float(self.weight_bytes + kv)
