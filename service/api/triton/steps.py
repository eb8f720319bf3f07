"""The ensemble's two Python steps, `preprocessing` (text -> token ids) and `postprocessing` (token ids -> text),
callable on their own as in a real Triton (NVIDIA's end_to_end_test.py chains them by hand around
`tensorrt_llm`). They run the very cores the generated repository's model.py files run
(build_engine/triton_models/preprocessing.py, postprocessing.py) over the engine directory's tokenizer files, off
the event loop through the edge's tokenization gate, with the same text limits as `text_input`.
"""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2

from build_engine.triton_models.postprocessing import Postprocessor
from build_engine.triton_models.preprocessing import Preprocessor
from build_engine.triton_models.tables import MODEL_VERSION, ModelSpec
from service.api.edge import Edge
from service.api.triton.tensors import ResponseBuilder, decode_inputs
from service.api.validation import TextLimits
from service.backends.base import Backend
from service.errors import InvalidRequest


class Steps:
    def __init__(self, edge: Edge, engine_dir: str) -> None:
        self.edge = edge
        self.engine_dir = engine_dir
        self._pre: Preprocessor | None = None
        self._post: Postprocessor | None = None

    async def infer(
        self, spec: ModelSpec, req: service_pb2.ModelInferRequest, backend: Backend, peer: str, stream: bool
    ):
        """One step's response (a ModelStreamInferResponse when `stream`), its outputs as Triton's python models
        shape them (batch first)."""
        tensors = decode_inputs(spec, req)
        requested = [o.name for o in req.outputs]
        for name in requested:  # checked before any work is done
            if spec.output(name) is None:
                raise InvalidRequest(f"unexpected inference output '{name}' for model '{spec.name}'")
        if spec.kind == "preprocessing":
            outputs = await self._preprocess(tensors, backend, peer)
        else:
            outputs = await self._postprocess(tensors, backend, peer)
        b = ResponseBuilder(spec.name, MODEL_VERSION, req.id, stream=stream)
        for t in spec.outputs:
            if not requested or t.name in requested:
                b.add(t.name, t.datatype, outputs[t.name])
        return b.final(True) if stream else b.response

    async def _preprocess(self, tensors: dict[str, np.ndarray], backend: Backend, peer: str) -> dict:
        (query,) = tensors["QUERY"].reshape(-1)
        limits = TextLimits.for_model(backend.tokenizer, backend.info.max_seq_len)
        limits.check(len(query), "QUERY")
        num_bytes = len(query) + sum(len(w) for name in ("STOP_WORDS_DICT", "BAD_WORDS_DICT")
                                     for w in tensors.get(name, np.empty(0)).reshape(-1))  # fmt: skip
        outputs = await self.edge.tokenize(peer, num_bytes, limits, self._run_pre, tensors)
        if outputs["REQUEST_INPUT_LEN"][0, 0] > backend.info.max_seq_len:
            raise InvalidRequest(
                f"QUERY is {outputs['REQUEST_INPUT_LEN'][0, 0]} tokens; the model's context is "
                f"{backend.info.max_seq_len}"
            )
        return outputs

    def _run_pre(self, tensors: dict[str, np.ndarray]) -> dict:
        if self._pre is None:
            self._pre = Preprocessor(self.engine_dir)
        try:
            return self._pre.run(tensors)
        except UnicodeDecodeError:
            raise InvalidRequest("QUERY, STOP_WORDS_DICT and BAD_WORDS_DICT must be valid UTF-8") from None

    async def _postprocess(self, tensors: dict[str, np.ndarray], backend: Backend, peer: str) -> dict:
        tokens = tensors["TOKENS_BATCH"]  # [1, beams, len]
        if tokens.shape[1] == 0:
            raise InvalidRequest("TOKENS_BATCH holds no sequence (shape [1, beams >= 1, len])")
        if tokens.size and not (0 <= tokens.min() and tokens.max() < backend.info.vocab_size):
            raise InvalidRequest(f"TOKENS_BATCH holds a token id outside [0, {backend.info.vocab_size})")
        lengths = tensors.get("SEQUENCE_LENGTH")  # [1, beams]
        if lengths is None:
            lengths = np.full(tokens.shape[:-1], tokens.shape[-1], dtype=np.int32)
        if lengths.shape != tokens.shape[:-1] or not ((0 <= lengths) & (lengths <= tokens.shape[-1])).all():
            raise InvalidRequest(
                f"SEQUENCE_LENGTH must have shape {list(tokens.shape[:-1])} (TOKENS_BATCH's batch and beams) and "
                f"values in [0, {tokens.shape[-1]}]"
            )
        if tokens.shape[1] * tokens.shape[2] > backend.info.max_seq_len:  # bounds the decode work (and GIL time)
            raise InvalidRequest(
                f"TOKENS_BATCH holds {tokens.shape[1] * tokens.shape[2]} token ids; at most "
                f"{backend.info.max_seq_len} (the model's context) are decoded per request"
            )
        if tokens.shape[2] == 0:  # nothing to decode (numpy cannot reshape an empty batch by -1)
            return {"OUTPUT": np.array([b""] * tokens.shape[1], dtype=np.object_)}
        limits = TextLimits.for_model(backend.tokenizer, backend.info.max_seq_len)
        num_bytes = int(lengths.sum()) * backend.tokenizer.max_token_bytes
        text = await self.edge.tokenize(peer, min(num_bytes, limits.max_text_bytes), limits, self._run_post,
                                        tokens, lengths)  # fmt: skip
        return {"OUTPUT": np.asarray(text, dtype=np.object_).reshape(-1)}  # [batch x beams], as NVIDIA's

    def _run_post(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        if self._post is None:
            self._post = Postprocessor(self.engine_dir)
        return self._post.run(tokens, lengths)
