"""Weights kept as quantized blocks (GGUF Q4_0/Q4_1/Q8_0, int8, int4) and the kernels that multiply them with fp32."""
