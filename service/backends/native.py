"""The native backend: our own engine (EngineCore + AsyncEngine), on any CPU."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from service.backends.base import BackendInfo
from service.config import BackendConfig
from service.engine.async_engine import AsyncEngine
from service.engine.core import EngineCore
from service.request import GenerateRequest, RequestOutput
from service.telemetry import BackendStats, Observer


class NativeBackend:
    def __init__(self, cfg: BackendConfig) -> None:
        self.core = EngineCore(
            cfg.engine_dir,
            kv_cache_memory=cfg.native.kv_cache_memory,
            enable_prefix_caching=cfg.prefix_caching,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_tokens,
            long_prefill_token_threshold=cfg.native.long_prefill_token_threshold,
        )
        self.engine = AsyncEngine(self.core, cfg.admission)
        self.tokenizer = self.core.tokenizer
        self.info = _info(self.core, cfg.admission.max_queue)

    def start(self, on_health_change: Callable[[bool], None], on_fatal: Callable[[str], None]) -> None:
        self.engine.bind(on_health_change, on_fatal)
        self.engine.start()

    def generate(self, gen: GenerateRequest, on_done: Callable[[], None] | None = None) -> AsyncIterator[RequestOutput]:
        return self.engine.generate(gen, on_done)

    def abort(self, req_id: str) -> None:
        self.engine.abort(req_id)

    def abort_all(self) -> None:
        self.engine.abort_all()

    def check_capacity(self) -> None:
        self.engine.check_capacity()

    @property
    def is_healthy(self) -> bool:
        return self.engine.is_healthy

    @property
    def num_in_flight(self) -> int:
        return self.engine.num_in_flight

    def stats(self) -> BackendStats:
        return self.core.stats()

    def observe(self, observer: Observer | None) -> None:
        self.engine.observe(observer)

    def stop_accepting(self) -> None:
        self.engine.stop_accepting()

    async def shutdown(self, timeout: float) -> None:
        await self.engine.shutdown(timeout)


def _info(core: EngineCore, max_queue: int) -> BackendInfo:
    cfg, sched = core.config, core.sched_cfg
    return BackendInfo.of_engine(
        cfg,
        "native",
        max_seq_len=sched.max_seq_len,
        max_batch_size=sched.max_num_seqs,
        max_num_tokens=sched.max_num_batched_tokens,
        kv_block_size=sched.block_size,
        num_kv_blocks=sched.num_kv_blocks,
        dtype=cfg.limits.dtype,
        weight_format=cfg.weight_format,
        prefix_caching=sched.enable_prefix_caching,
        max_queue=max_queue,
    )
