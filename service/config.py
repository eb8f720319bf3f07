"""Configuration of the server and its backends: every default lives here, once (a leaf module), except
TensorRT-LLM's runtime settings, which the Triton model repository writes too: TrtllmConfig takes those from
build_engine/trtllm_runtime.py (a leaf too).

The command line (`service/__main__.py`) builds its flags from these dataclasses, so a flag's default, its
`--help` and the value tests get without flags are the same thing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from build_engine.trtllm_runtime import TrtllmRuntime

BACKENDS = ("native", "trtllm", "triton")
FAILURE_POLICIES = ("exit", "recover")
KV_CACHE_DTYPES = ("float32", "float16", "bfloat16", "int8")  # the native KV cache's stored types (kernels/kv_cache.py)
EVENT_LOOPS = ("auto", "asyncio", "uvloop")  # auto: uvloop when it is installed, else asyncio's own


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Admission, health and the failure policy: the same for every backend (the seam owns them)."""

    max_queue: int = 256  # requests accepted but not yet scheduled; beyond it RESOURCE_EXHAUSTED
    stall_timeout_s: float = 60.0  # a step (or a backend call) running longer marks the backend unhealthy
    # after a failure that ends every request in flight: "exit" marks the backend dead and the server exits
    # non-zero so a supervisor restarts it (a stalled step is fatal too); "recover" rebuilds the backend's
    # state and serves again
    on_failure: str = "exit"
    idle_wait_s: float = 0.05  # how long an idle engine loop sleeps between checks

    def __post_init__(self) -> None:
        if self.on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_failure must be one of {FAILURE_POLICIES}, got {self.on_failure!r}")
        if self.max_queue < 1 or self.stall_timeout_s <= 0:
            raise ValueError("max_queue must be >= 1 and stall_timeout_s > 0")


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """Speculative decoding on the native engine (vLLM's names; docs/speculative.md, service/engine/spec_decode.py)."""

    method: str = "off"  # "off" or "ngram"
    num_speculative_tokens: int = 8  # drafts per step at most (a request may ask for fewer, or 0)
    prompt_lookup_min: int = 2  # shortest n-gram that proposes drafts
    prompt_lookup_max: int = 4  # longest n-gram tried first
    disable_by_batch_size: int = 4  # no drafts in a step with more running decodes than this

    def __post_init__(self) -> None:
        if self.method not in ("off", "ngram"):
            raise ValueError(f"speculative method must be off or ngram, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 16, "
                f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


@dataclass(frozen=True, slots=True)
class NativeConfig:
    kv_cache_memory: str = "auto"  # auto (from the engine's limits, capped), bytes (512MiB) or a fraction
    # while decodes run, a prefill chunk costs at most this many tokens' work; None: a quarter of
    # max_num_tokens; 0: no cap (docs/scheduling.md)
    long_prefill_token_threshold: int | None = None
    # the KV cache's stored type; float32 is exact (golden tests), the others halve or quarter the KV bytes a
    # decode step reads (int8: a float32 scale per token and KV head beside it)
    kv_cache_dtype: str = "float32"
    speculative: SpecConfig = SpecConfig()  # off unless asked for

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True, slots=True)
class TrtllmConfig(TrtllmRuntime):
    """The trtllm backend's settings: TensorRT-LLM's runtime settings (fields and defaults: TrtllmRuntime), the
    same ones python -m build_engine.triton_repo writes into a Triton model repository."""


TRITON_MODELS = ("tensorrt_llm", "ensemble")


@dataclass(frozen=True, slots=True)
class TritonConfig:
    url: str = ""  # HOST:PORT of a Triton server's gRPC endpoint
    model: str = "tensorrt_llm"  # tensorrt_llm (token ids in and out) or ensemble (text)
    ready_timeout_s: float = 300.0  # at startup, how long to wait for the Triton server and model to be ready
    health_period_s: float = 1.0  # how often ServerReady / ModelReady are asked (NOT_SERVING within about this)
    rpc_timeout_s: float = 2.0  # deadline of those health RPCs

    def __post_init__(self) -> None:
        if self.model not in TRITON_MODELS:
            raise ValueError(f"triton model must be one of {TRITON_MODELS}, got {self.model!r}")
        if self.ready_timeout_s < 0 or self.health_period_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError("triton ready_timeout_s must be >= 0, health_period_s and rpc_timeout_s > 0")


@dataclass(frozen=True, slots=True)
class BackendConfig:
    engine_dir: str  # engine directory (for the triton backend: the one its model repository was built from)
    backend: str = "auto"  # auto: the backend the engine directory was built for
    prefix_caching: bool = True  # share KV blocks of common prompt prefixes (TensorRT-LLM: KV block reuse)
    # KV-cache event batches kept for a subscriber's replay (trtllm.TrtllmService SubscribeKvEvents, which a
    # gateway's cache-aware routing reads); 0: no KV events (SubscribeKvEvents answers UNIMPLEMENTED)
    kv_event_history: int = 4096
    max_num_seqs: int | None = None  # sequences per step; None: the engine's max_batch_size
    max_num_tokens: int | None = None  # tokens per step; None: the engine's max_num_tokens
    # at startup, check the size and sha256 of every engine file against manifest.json (the structural checks of
    # build_engine/verify.py run either way)
    verify_checksums: bool = True
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    native: NativeConfig = field(default_factory=NativeConfig)
    trtllm: TrtllmConfig = field(default_factory=TrtllmConfig)
    triton: TritonConfig = field(default_factory=TritonConfig)

    def __post_init__(self) -> None:
        if self.kv_event_history < 0:
            raise ValueError(f"kv_event_history must be >= 0, got {self.kv_event_history}")
        if self.backend not in ("auto", *BACKENDS):
            raise ValueError(f"backend must be auto or one of {BACKENDS}, got {self.backend!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    backend: BackendConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    metrics_port: int | None = 9400  # None: no Prometheus endpoint; 0 picks a free port
    triton_port: int | None = None  # a Triton (KServe v2) front door on this port; None: off
    triton_decoupled: bool = True  # the door's ensemble / tensorrt_llm are decoupled (config.pbtxt's decoupled_mode)
    triton_http_port: int | None = None  # the same front door's HTTP/REST protocol on this port; None: off
    drain_timeout_s: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require and verify client certificates (mutual TLS)
    auth_token_file: str | None = None  # bearer tokens, one per line
    cache_salt_per_token: bool = False  # each token's requests share prefix KV blocks only among themselves
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_rpcs: int = 1024  # LLM RPCs in flight at most (health and reflection never count)
    max_rpcs_per_connection: int | None = None  # of those, on one client connection; None: half of them
    stream_stall_timeout_s: float = 30.0  # a stream whose client takes no response for this long is ended
    max_requests_per_stream: int = 128  # requests in flight on one Triton stream (beyond, it stops reading)
    tokenize_backlog: float = 4.0  # text being tokenized at most, in largest prompts (max_text_bytes)
    tokenize_backlog_per_connection: float = 1.0  # the same, per client connection
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    log_prompts: bool = False
    reflection: bool = True
    measure_ceilings: bool = True
    event_loop: str = "auto"  # EVENT_LOOPS (uvloop: ~20% less CPU per streamed token, benchmarks/overhead_bench.py)

    def __post_init__(self) -> None:
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event_loop must be one of {EVENT_LOOPS}, got {self.event_loop!r}")
        if self.max_concurrent_rpcs < 1 or (
            self.max_rpcs_per_connection is not None and self.max_rpcs_per_connection < 1
        ):
            raise ValueError("max_concurrent_rpcs and max_rpcs_per_connection must be >= 1")
        if self.stream_stall_timeout_s <= 0 or self.max_requests_per_stream < 1:
            raise ValueError("stream_stall_timeout_s must be > 0 and max_requests_per_stream >= 1")
        if self.tokenize_backlog < 1 or self.tokenize_backlog_per_connection < 1:
            raise ValueError("tokenize_backlog and tokenize_backlog_per_connection must be >= 1 (largest prompts)")


def replace_path(cfg: object, path: str, value: object) -> object:
    """A copy of a nested frozen config with `path` (e.g. "backend.native.kv_cache_memory") set to `value`."""
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: replace_path(getattr(cfg, head), rest, value)})


def get_path(cfg: object, path: str) -> object:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg
