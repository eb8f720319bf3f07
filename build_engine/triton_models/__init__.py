"""The two Python models of a generated Triton repository (preprocessing, postprocessing), copied as model.py.

Each file is self-contained (numpy, tokenizers and Triton's triton_python_backend_utils, all in the Triton
TensorRT-LLM container): the repository does not need this package. The tokenization and detokenization cores are
plain classes, tested here without Triton.
"""
