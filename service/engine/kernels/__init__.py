"""The native engine's kernels, in one package: which implementation runs is chosen once (backend.py).

backend.py          the C / numba / numpy choice (and the LLM_QUANT_KERNELS, QUANT_KERNELS_GENERIC switches)
threads.py          ThreadPolicy (a value the runner holds) and OpenBLAS's thread control
ops.py              the named ops of the forward pass: linear, RMSNorm, embedding rows, RoPE, SiLU x up, KV writes
attention.py        causal attention of prefill chunks (contiguous or read through a block table)
paged_attention.py  decode attention over the paged KV cache
kv_cache.py         the KV cache's stored types (--kv-cache-dtype) and arrays, their conversions in numpy
matmul.py           quantized matmuls: GGUF Q4_0 / Q4_1 / Q8_0 blocks x fp32 activations
numba_kernels.py    the numba fallbacks (matmul, decode attention)
csrc/               the C extension _kernels (setup.py builds it; docs/kernels.md)
"""
