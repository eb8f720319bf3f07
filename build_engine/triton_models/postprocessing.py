"""Triton Python model `postprocessing` of the generated TensorRT-LLM ensemble: token ids -> text.

Written for build_engine.triton_repo (this file becomes REPO/postprocessing/1/model.py); self-contained: numpy,
tokenizers and triton_python_backend_utils. Each response is decoded on its own (an ensemble step keeps no state
between the streamed responses of one request), with the engine's tokenizer.json and skip_special_tokens as
configured: a character whose UTF-8 bytes span two streamed responses comes out as U+FFFD. The service's own
`--backend triton --triton-model tensorrt_llm` detokenizes incrementally instead (exact text).

Inputs: TOKENS_BATCH [B, beams, L], SEQUENCE_LENGTH [B, beams]. Output: OUTPUT [B * beams] (BYTES), one flat
row of texts in batch-major order, as NVIDIA's postprocessing model.py builds it (np.array over a flat list of
decoded strings; TensorRT-LLM triton_backend/all_models/inflight_batcher_llm/postprocessing/1/model.py @2e2327b9),
so NVIDIA's clients' `output[0].decode()` reads the first text.
"""

import json
import os

import numpy as np
from tokenizers import Tokenizer

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside Triton (tests): only the Postprocessor class is used
    pb_utils = None


class Postprocessor:
    def __init__(self, tokenizer_dir, skip_special_tokens=True):
        self.tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        self.skip_special_tokens = skip_special_tokens

    def run(self, tokens, lengths):
        """TOKENS_BATCH [B, beams, L], SEQUENCE_LENGTH [B, beams] -> OUTPUT [B * beams] (bytes objects)."""
        tokens = np.asarray(tokens)
        tokens = tokens.reshape(tokens.shape[0], -1, tokens.shape[-1]) if tokens.ndim >= 2 else tokens.reshape(1, 1, -1)
        lengths = np.asarray(lengths).reshape(tokens.shape[0], tokens.shape[1])
        texts = []
        for b in range(tokens.shape[0]):
            for beam in range(tokens.shape[1]):
                ids = tokens[b, beam, : int(lengths[b, beam])].tolist()
                texts.append(self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens).encode())
        return np.array(texts, dtype=np.object_)  # [B * beams]: flat, as NVIDIA's np.array(outputs)


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        skip = params.get("skip_special_tokens", "true").lower() in ("1", "true", "yes")
        self.core = Postprocessor(params["tokenizer_dir"], skip_special_tokens=skip)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tokens = pb_utils.get_input_tensor_by_name(request, "TOKENS_BATCH").as_numpy()
                lengths = pb_utils.get_input_tensor_by_name(request, "SEQUENCE_LENGTH")
                lengths = lengths.as_numpy() if lengths is not None else np.full(tokens.shape[:-1], tokens.shape[-1])
                output = pb_utils.Tensor("OUTPUT", self.core.run(tokens, lengths))
                responses.append(pb_utils.InferenceResponse(output_tensors=[output]))
            except Exception as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"postprocessing: {exc}")))
        return responses
