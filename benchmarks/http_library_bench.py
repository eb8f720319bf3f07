"""Which asyncio HTTP library the Triton HTTP/REST front door uses: aiohttp against Starlette on uvicorn, measured.

    pip install starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0   # the contenders that are not requirements
    python -m benchmarks.http_library_bench [--seconds 4] [--connections 1,16] [--rounds 3] [--write]

Each library serves, in its own process (one worker, the default asyncio loop, its own fast parser: aiohttp's C
parser, uvicorn's httptools), the three shapes of the front door's traffic: `GET /v2/health/ready` (a probe:
nothing but HTTP), `POST /v2/models/m/infer` (a KServe JSON request of ~400 bytes parsed, a JSON response of
~200 written) and `POST /v2/models/m/generate_stream` (32 server-sent events, the event loop yielded between two,
as tokens arrive). A load generator in this process (raw asyncio sockets, HTTP/1.1 keep-alive, neither library's
client) keeps N connections busy for --seconds per shape, rounds interleaved; it reports requests/s, median
latency and the server's CPU time per request (what the front door costs the engine's host on a loaded box).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from benchmarks.common import CpuMeter, bench_parser, free_port, int_list, machine_line, process_cpu_s, publish

LIBRARIES = ("aiohttp", "starlette+uvicorn")
INFER_BODY = json.dumps(
    {
        "id": "42",
        "inputs": [
            {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["The capital of France is"]},
            {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [16]},
            {"name": "temperature", "shape": [1, 1], "datatype": "FP32", "data": [0.0]},
        ],
        "outputs": [{"name": "text_output"}],
    }
).encode()
EVENTS = 32


def _infer_reply(body: bytes) -> bytes:
    req = json.loads(body)
    out = {"name": "text_output", "datatype": "BYTES", "shape": [1, 1], "data": [req["inputs"][0]["data"][0]]}
    return json.dumps({"id": req["id"], "model_name": "m", "model_version": "1", "outputs": [out]}).encode()


def _event(i: int) -> bytes:
    return b'data: {"model_name":"m","model_version":"1","text_output":"tok%d"}\n\n' % i


# ---- the servers (each in its own process: --serve LIBRARY --port P) -----------------------------------------------
def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def ready(request: web.Request) -> web.Response:
        return web.Response()

    async def infer(request: web.Request) -> web.Response:
        return web.Response(body=_infer_reply(await request.read()), content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        for i in range(EVENTS):
            await resp.write(_event(i))
            await asyncio.sleep(0)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.add_routes([web.get("/v2/health/ready", ready), web.post("/v2/models/m/infer", infer),
                    web.post("/v2/models/m/generate_stream", stream)])  # fmt: skip
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def serve_starlette(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def ready(request: Request) -> Response:
        return Response()

    async def infer(request: Request) -> Response:
        return Response(_infer_reply(await request.body()), media_type="application/json")

    async def stream(request: Request) -> StreamingResponse:
        await request.body()

        async def events():
            for i in range(EVENTS):
                yield _event(i)
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream; charset=utf-8")

    app = Starlette(routes=[Route("/v2/health/ready", ready), Route("/v2/models/m/infer", infer, methods=["POST"]),
                            Route("/v2/models/m/generate_stream", stream, methods=["POST"])])  # fmt: skip
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, http="httptools",
                loop="asyncio", lifespan="off")  # fmt: skip


# ---- the load generator ----------------------------------------------------------------------------------------
SHAPES = {
    "health GET": (b"GET /v2/health/ready HTTP/1.1\r\nHost: b\r\n\r\n", None),
    "infer POST (JSON)": (b"POST /v2/models/m/infer HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n",
                          INFER_BODY),
    f"generate_stream ({EVENTS} SSE events)": (b"POST /v2/models/m/generate_stream HTTP/1.1\r\nHost: b\r\n", b"{}"),
}  # fmt: skip


async def _response(reader: asyncio.StreamReader) -> bytes:
    """One HTTP/1.1 response's body (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert status == 200, head
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")[1:] if h)}
    if b"content-length" in headers:
        return await reader.readexactly(int(headers[b"content-length"]))
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if size == 0:
            await reader.readuntil(b"\r\n")
            return bytes(body)
        body += await reader.readexactly(size + 2)
        del body[-2:]


async def _connection(port: int, request: bytes, until: float, latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < until:
            start = time.perf_counter()
            writer.write(request)
            await _response(reader)
            latencies.append(time.perf_counter() - start)
    finally:
        writer.close()


def _request(shape: str) -> bytes:
    head, body = SHAPES[shape]
    return head if body is None else head + b"Content-Length: %d\r\n\r\n" % len(body) + body


@dataclass(frozen=True, slots=True)
class Result:
    requests_s: float
    p50_ms: float
    server_cpu_us: float  # server CPU time per request


def measure(port: int, pid: int, shape: str, connections: int, seconds: float) -> Result:
    async def run() -> list[float]:
        latencies: list[float] = []
        until = time.monotonic() + seconds
        await asyncio.gather(*(_connection(port, _request(shape), until, latencies) for _ in range(connections)))
        return latencies

    asyncio.run(_warm(port, shape))
    cpu0, t0 = process_cpu_s(pid), time.monotonic()
    latencies = asyncio.run(run())
    elapsed, cpu = time.monotonic() - t0, process_cpu_s(pid) - cpu0
    return Result(len(latencies) / elapsed, statistics.median(latencies) * 1e3, cpu / len(latencies) * 1e6)


async def _warm(port: int, shape: str) -> None:
    await _connection(port, _request(shape), time.monotonic() + 0.3, [])


def start(library: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.http_library_bench", "--serve", library,
                             "--port", str(port)])  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            asyncio.run(_warm(port, "health GET"))
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {library} server did not start") from None
            time.sleep(0.1)


def compare(args: argparse.Namespace) -> list[str]:
    servers = {lib: start(lib) for lib in LIBRARIES}
    results: dict[tuple[str, str, int], list[Result]] = {}
    meter = CpuMeter([proc.pid for proc, _ in servers.values()]).start()
    try:
        for _ in range(args.rounds):
            for shape in SHAPES:
                for connections in args.connections:
                    for lib, (proc, port) in servers.items():
                        got = measure(port, proc.pid, shape, connections, args.seconds)
                        results.setdefault((shape, lib, connections), []).append(got)
    finally:
        use = meter.stop()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(10)
    return _report(args, results, use.others)


def _report(args: argparse.Namespace, results: dict[tuple[str, str, int], list[Result]], others: float) -> list[str]:
    lines = [
        "## HTTP library for the Triton HTTP/REST front door (`python -m benchmarks.http_library_bench`)",
        "",
        f"Command: `python -m benchmarks.http_library_bench --seconds {args.seconds:g} --connections "
        f"{','.join(map(str, args.connections))} --rounds {args.rounds}`  ",
        f"Machine: {machine_line()}; medians of {args.rounds} interleaved rounds; other processes on the box used "
        f"{others:.1f} cores on average meanwhile",
        "",
        "| traffic | connections | library | requests/s | p50 latency (ms) | server CPU per request (µs) |",
        "|---|---|---|---|---|---|",
    ]
    for (shape, lib, connections), runs in results.items():
        rps = statistics.median(r.requests_s for r in runs)
        p50 = statistics.median(r.p50_ms for r in runs)
        cpu = statistics.median(r.server_cpu_us for r in runs)
        lines.append(f"| {shape} | {connections} | {lib} | {rps:,.0f} | {p50:.2f} | {cpu:,.0f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = bench_parser(__doc__, "http_library_bench")
    p.add_argument("--seconds", type=float, default=4.0, help="load per shape, connection count and library")
    p.add_argument("--connections", type=int_list, default=[1, 16], help="concurrent keep-alive connections")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve", choices=LIBRARIES, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve == "aiohttp":
        serve_aiohttp(args.port)
    elif args.serve:
        serve_starlette(args.port)
    else:
        publish("http_library_bench", compare(args), args.write)


if __name__ == "__main__":
    main()
