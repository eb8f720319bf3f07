"""Worker discovery for the Shepherd Model Gateway (smg) in docker-compose: python -m clients.discovery

Keeps smg's `--discovery-provider file` manifest equal to the replicas of a compose service that are SERVING,
and gives smg the tokenizer they serve. Every `--interval` seconds it resolves `--service` (Docker's DNS returns
one address per container, so `--scale` changes show up at the next pass), asks each address for
grpc.health.v1 (over TLS or mutual TLS with the same flags as the other clients), and rewrites the manifest
(atomically, only when it changes; smg rereads it on change):

    {"version": 1, "workers": [{"id": "172.18.0.5", "url": "grpc://172.18.0.5:50051", "model_id": "smollm2-135m"}]}

Listing only SERVING replicas is what lets smg start and scale without restarts: a replica still loading is
not handed to smg (which gives a worker up after 20 failed registrations), and a draining one (NOT_SERVING at
once on SIGTERM) is withdrawn, so new requests go elsewhere while its streams finish. An address that stops
answering is withdrawn after `--failures` passes in a row (a pass can time out on a busy box).

The first SERVING replica's tokenizer bundle (trtllm.TrtllmService/GetTokenizer: the Hugging Face files the
worker tokenizes with) is unpacked into `--tokenizer-dir`/MODEL, the directory smg's --tokenizer-path names
(smg matches it to the workers' model by the directory's name). With --once it runs one pass and exits 0 when
at least one worker is listed (for scripts and tests).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import trtllm_service_pb2_grpc as trtllm_grpc
from smg_grpc_proto.generated import common_pb2, trtllm_service_pb2

from clients.common import HelpFormatter, add_connection_args, open_channel

log = logging.getLogger("clients.discovery")
SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True, slots=True)
class Probe:
    """One address's answer in one pass: SERVING, or why not (`refused`: it said NOT_SERVING or is gone)."""

    serving: bool
    refused: bool = False


@dataclass
class Registry:
    """The workers listed in the manifest, and how many passes in a row each has failed to answer."""

    failures_to_drop: int
    listed: dict[str, str] = field(default_factory=dict)  # address -> model id
    misses: dict[str, int] = field(default_factory=dict)
    written: dict | None = None  # the manifest last written

    def update(self, probes: dict[str, Probe], model_of: Callable[[str], str]) -> None:
        """Apply one pass. Addresses no longer resolved, or that said NOT_SERVING, are dropped at once."""
        for addr in list(self.listed):
            probe = probes.get(addr)
            if probe is None or probe.refused:
                self._drop(addr)
            elif not probe.serving:
                self.misses[addr] = self.misses.get(addr, 0) + 1
                if self.misses[addr] >= self.failures_to_drop:
                    self._drop(addr)
            else:
                self.misses.pop(addr, None)
        for addr, probe in probes.items():
            if probe.serving and addr not in self.listed:
                self.listed[addr] = model_of(addr)

    def _drop(self, addr: str) -> None:
        self.listed.pop(addr, None)
        self.misses.pop(addr, None)

    def manifest(self, port: int, scheme: str) -> dict:
        workers = [
            {"id": a, "url": f"{scheme}://{_host(a)}:{port}", "model_id": m} for a, m in sorted(self.listed.items())
        ]
        return {"version": 1, "workers": workers}


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def resolve(service: str, port: int) -> list[str]:
    """Every address the name resolves to (one per container of a compose service), sorted; [] when none."""
    try:
        infos = socket.getaddrinfo(service, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({info[4][0] for info in infos})


class Prober:
    """grpc.health.v1 and the worker protocol's GetModelInfo / GetTokenizer, per address, with the CLI's TLS flags."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._args = args

    def _channel(self, addr: str) -> grpc.Channel:
        conn = argparse.Namespace(**vars(self._args))
        conn.target = f"{_host(addr)}:{self._args.port}"
        return open_channel(conn)

    def health(self, addr: str) -> Probe:
        try:
            with self._channel(addr) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=self._args.timeout)
        except grpc.RpcError as err:
            return Probe(
                False, refused=err.code() == grpc.StatusCode.UNAVAILABLE and "refused" in (err.details() or "")
            )
        return Probe(resp.status == SERVING, refused=resp.status != SERVING)

    def model_id(self, addr: str) -> str:
        with self._channel(addr) as ch:
            stub = trtllm_grpc.TrtllmServiceStub(ch)
            return stub.GetModelInfo(trtllm_service_pb2.GetModelInfoRequest(), timeout=self._args.timeout).model_id

    def tokenizer_zip(self, addr: str) -> bytes:
        with self._channel(addr) as ch:
            chunks = list(trtllm_grpc.TrtllmServiceStub(ch).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
        data = b"".join(c.data for c in chunks)
        if not chunks or chunks[-1].sha256 != hashlib.sha256(data).hexdigest():
            raise ValueError(f"{addr}: the tokenizer bundle does not match its sha256")
        return data


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` in one rename: smg never reads half a manifest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def unpack_tokenizer(data: bytes, into: Path) -> None:
    """The bundle's files into `into` (created whole, then renamed into place)."""
    into.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=into.parent, prefix=f".{into.name}."))
    zipfile.ZipFile(io.BytesIO(data)).extractall(tmp)
    tmp.chmod(0o755)
    if into.exists():
        shutil.rmtree(into)
    tmp.rename(into)


def one_pass(args: argparse.Namespace, prober: Prober, registry: Registry) -> None:
    """Resolve, probe, fetch the tokenizer once, rewrite the manifest when it differs from the one last written."""
    registry.update({a: prober.health(a) for a in resolve(args.service, args.port)}, prober.model_id)
    if registry.listed:
        addr, model = next(iter(sorted(registry.listed.items())))
        target = args.tokenizer_dir / model if args.tokenizer_dir else None
        if target is not None and not (target / "tokenizer.json").exists():
            unpack_tokenizer(prober.tokenizer_zip(addr), target)
            log.info("tokenizer of %s from %s -> %s", model, addr, target)
    manifest = registry.manifest(args.port, args.scheme)
    if manifest != registry.written or not args.manifest.exists():
        write_atomic(args.manifest, json.dumps(manifest, indent=2) + "\n")
        registry.written = manifest
        log.info("manifest %s: %d worker(s) %s", args.manifest, len(registry.listed), sorted(registry.listed) or "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="python -m clients.discovery", description=__doc__.split("\n\n")[0]
    )
    add_connection_args(p)
    p.set_defaults(target=None)  # the addresses come from --service
    p.add_argument("--service", required=True, help="DNS name of the replicas (the compose service name)")
    p.add_argument("--port", type=int, default=50051, help="the replicas' gRPC port")
    p.add_argument("--manifest", type=Path, required=True, help="smg's --discovery-file, rewritten in place")
    p.add_argument("--tokenizer-dir", type=Path, help="unpack the workers' tokenizer bundle into DIR/MODEL")
    p.add_argument("--scheme", default="grpc", help="URL scheme written for each worker")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between passes")
    p.add_argument("--timeout", type=float, default=2.0, help="per health check, seconds")
    p.add_argument("--failures", type=int, default=3, help="passes without an answer before a worker is withdrawn")
    p.add_argument("--once", action="store_true", help="one pass; exit 1 when no worker is SERVING")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prober, registry = Prober(args), Registry(args.failures)
    if args.once:
        one_pass(args, prober, registry)
        return 0 if registry.listed else 1
    while True:
        started = time.monotonic()
        try:
            one_pass(args, prober, registry)
        except (OSError, ValueError, grpc.RpcError) as err:  # one bad pass (a worker gone mid-call) is not fatal
            log.warning("pass failed: %s", err)
        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


if __name__ == "__main__":
    sys.exit(main())
