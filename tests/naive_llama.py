"""A deliberately simple Llama forward pass for tests: contiguous KV, one head at a time, float64.

It reads the *source* checkpoint (Hugging Face names and layout, unfused, norms not folded, rotate-half RoPE
computed from scratch), so comparing the paged runner against it checks the build-time conversion too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from build_engine.tensor_io import SafetensorsFile


class NaiveLlama:
    def __init__(self, checkpoint_dir: str | Path) -> None:
        d = Path(checkpoint_dir)
        self.cfg = json.loads((d / "config.json").read_text())
        files = [SafetensorsFile(p) for p in sorted(d.glob("*.safetensors"))]
        self.w = {k: f.get(k).astype(np.float64) for f in files for k in f.keys()}
        c = self.cfg
        self.n_heads, self.n_kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = c.get("head_dim") or c["hidden_size"] // self.n_heads
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def _norm(self, x: np.ndarray, gain: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.cfg["rms_norm_eps"]) * gain

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        # x: [head_dim], rotate-half convention of transformers' LlamaRotaryEmbedding
        hd = self.head_dim
        inv_freq = 1.0 / self.cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
        cos, sin = np.cos(pos * inv_freq), np.sin(pos * inv_freq)
        x1, x2 = x[: hd // 2], x[hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin])

    def forward(self, token_ids: list[int]) -> np.ndarray:
        """Logits for every position of one sequence: [len(token_ids), vocab] float64."""
        w, hd = self.w, self.head_dim
        x = w["model.embed_tokens.weight"][token_ids]  # [n, D]
        n = len(token_ids)
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = h @ w[p + "self_attn.q_proj.weight"].T  # [n, H*hd]
            k = h @ w[p + "self_attn.k_proj.weight"].T  # [n, KV*hd]
            v = h @ w[p + "self_attn.v_proj.weight"].T
            attn = np.zeros((n, self.n_heads * hd))
            for head in range(self.n_heads):
                kv_head = head // (self.n_heads // self.n_kv)
                keys = np.stack([self._rope(k[s, kv_head * hd : (kv_head + 1) * hd], s) for s in range(n)])
                for t in range(n):
                    qt = self._rope(q[t, head * hd : (head + 1) * hd], t)
                    scores = keys[: t + 1] @ qt / np.sqrt(hd)
                    probs = np.exp(scores - scores.max())
                    probs /= probs.sum()
                    attn[t, head * hd : (head + 1) * hd] = probs @ v[: t + 1, kv_head * hd : (kv_head + 1) * hd]
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        return self._norm(x, w["model.norm.weight"]) @ self.lm_head.T
