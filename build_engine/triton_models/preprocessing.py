"""Triton Python model `preprocessing` of the generated TensorRT-LLM ensemble: text -> token ids.

Written for build_engine.triton_repo (this file becomes REPO/preprocessing/1/model.py); self-contained: numpy,
tokenizers and triton_python_backend_utils, all present in Triton's TensorRT-LLM container. It tokenizes as the
service does (the engine's tokenizer.json, add_special_tokens as configured, so an llm.v1 `prompt` and a Triton
`text_input` become the same ids), fills end/pad ids from the engine's tokenizer_config.json unless the request
gives them, and turns stop / bad words into TensorRT-LLM's word lists ([2, L]: ids, then cumulative end offsets,
padded with 0 and -1).

Inputs (config.pbtxt): QUERY, REQUEST_OUTPUT_LEN, STOP_WORDS_DICT, BAD_WORDS_DICT, END_ID, PAD_ID.
Outputs: INPUT_ID, DECODER_INPUT_ID ([[pad_id]]: decoder-only), REQUEST_INPUT_LEN, REQUEST_DECODER_INPUT_LEN,
REQUEST_OUTPUT_LEN, STOP_WORDS_IDS, BAD_WORDS_IDS, OUT_END_ID, OUT_PAD_ID.
"""

import json
import os

import numpy as np
from tokenizers import Tokenizer

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside Triton (tests): only the Preprocessor class is used
    pb_utils = None

INPUTS = ("QUERY", "REQUEST_OUTPUT_LEN", "STOP_WORDS_DICT", "BAD_WORDS_DICT", "END_ID", "PAD_ID")


class Preprocessor:
    def __init__(self, tokenizer_dir, add_special_tokens=True):
        self.tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
            special = json.load(f)
        self.add_special_tokens = add_special_tokens
        self.end_id = self._id(special.get("eos_token"))
        pad = self._id(special.get("pad_token"))
        self.pad_id = self.end_id if pad is None else pad

    def _id(self, token):
        if isinstance(token, dict):  # transformers' AddedToken form
            token = token.get("content")
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text):
        # encode_batch releases the GIL (encode holds it for the whole call)
        return self.tokenizer.encode_batch([text], add_special_tokens=self.add_special_tokens)[0].ids

    def word_list(self, rows):
        """[B, N] words (bytes) -> [B, 2, L] int32: each row's word ids concatenated, then their end offsets."""
        lists = []
        for row in rows:
            ids, offsets = [], []
            for word in row.reshape(-1):
                text = word.decode("utf-8") if isinstance(word, bytes) else str(word)
                if not text:
                    continue  # padding
                ids += self.tokenizer.encode(text, add_special_tokens=False).ids
                offsets.append(len(ids))
            lists.append((ids, offsets))
        width = max([1, *(len(ids) for ids, _ in lists)])
        out = np.zeros((len(lists), 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for i, (ids, offsets) in enumerate(lists):
            out[i, 0, : len(ids)] = ids
            out[i, 1, : len(offsets)] = offsets
        return out

    def run(self, inputs):
        """inputs: name -> numpy array (batch first); the outputs by name."""
        queries = inputs["QUERY"].reshape(len(inputs["QUERY"]), -1)
        batch = len(queries)
        ids = [self.encode(q[0].decode("utf-8") if isinstance(q[0], bytes) else str(q[0])) for q in queries]
        width = max([1, *(len(i) for i in ids)])
        input_id = np.full((batch, width), self.pad_id, dtype=np.int32)
        for i, row in enumerate(ids):
            input_id[i, : len(row)] = row
        empty = np.empty((batch, 0), dtype=np.object_)

        def given(name, default):
            value = inputs.get(name)
            if value is None:
                return np.full((batch, 1), default, dtype=np.int32)
            return np.asarray(value, dtype=np.int32).reshape(batch, 1)

        return {
            "INPUT_ID": input_id,
            "DECODER_INPUT_ID": np.full((batch, 1), self.pad_id, dtype=np.int32),  # decoder-only, as NVIDIA's
            "REQUEST_INPUT_LEN": np.array([[len(i)] for i in ids], dtype=np.int32),
            "REQUEST_DECODER_INPUT_LEN": np.ones((batch, 1), dtype=np.int32),
            "REQUEST_OUTPUT_LEN": np.asarray(inputs["REQUEST_OUTPUT_LEN"], dtype=np.int32).reshape(batch, 1),
            "STOP_WORDS_IDS": self.word_list(inputs.get("STOP_WORDS_DICT", empty)),
            "BAD_WORDS_IDS": self.word_list(inputs.get("BAD_WORDS_DICT", empty)),
            "OUT_END_ID": given("END_ID", self.end_id),
            "OUT_PAD_ID": given("PAD_ID", self.pad_id),
        }


class TritonPythonModel:
    def initialize(self, args):
        params = {k: v["string_value"] for k, v in json.loads(args["model_config"])["parameters"].items()}
        add = params.get("add_special_tokens", "true").lower() in ("1", "true", "yes")
        self.core = Preprocessor(params["tokenizer_dir"], add_special_tokens=add)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = {}
                for name in INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                outputs = self.core.run(inputs)
                tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as exc:  # one bad request fails alone, with the reason
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"preprocessing: {exc}")))
        return responses
