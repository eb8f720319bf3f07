"""A stand-in for llama.cpp's llama-server (tests only): the HTTP API the load tester and LlamaServer use, answering
at once, standard library only, so it also runs as the `llama-server` binary of benchmarks.llamacpp_peer.LlamaServer:

    python tests/fake_llama_server.py -m GGUF --host 127.0.0.1 --port P [llama-server's other flags, ignored]

With -lv 4 it logs a system_info line as llama.cpp does; asked for a model under os.devnull (LlamaServer's
system_info probe) it exits at once, as llama-server does for a model it cannot load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeLlamaHandler(BaseHTTPRequestHandler):
    """llama-server's /completion stream as llama.cpp 0c1e570 sends it (chunked SSE, one event per token, the final
    event with the timings), /tokenize and /props; it answers at once (no latency: the records' shape is tested)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._send(200, {"status": "ok"})
        self._send(200, {"model_path": self.server.model_path, "build_info": "b1-fake", "total_slots": 4,
                         "default_generation_settings": {"n_ctx": 512}})  # fmt: skip

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._send(200, {"tokens": [100 + ord(c) % 900 for c in body["content"]]})
        self.server.bodies.append(body)
        if body["n_predict"] == 0:
            return self._send(400, {"error": {"code": 400, "message": "n_predict must be positive"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(b":\n\n")  # an SSE comment (llama-server's keep-alive ping): no event
        n, prompt = body["n_predict"], body["prompt"]
        for i in range(1, n + 1):
            if i == 2:
                continue  # token 2 ends mid-UTF-8: held back, it comes with token 3 (tokens_predicted jumps by 2)
            if body["prompt"] == "fail" and i == 3:
                self._chunk(b'data: {"error": {"code": 500, "message": "boom"}}\n\n')
                break
            event = json.dumps({"content": "x", "tokens": [7], "stop": False, "tokens_predicted": i,
                                "tokens_evaluated": len(prompt)}).encode()  # fmt: skip
            self._chunk(b"data: " + event[:10])  # one event split over two chunks
            self._chunk(event[10:] + b"\r\n\r\n")
        else:
            final = {"content": "", "tokens": [], "stop": True, "tokens_predicted": n, "tokens_evaluated": len(prompt),
                     "stop_type": "limit", "timings": {"prompt_ms": 12.5, "predicted_n": n,
                                                       "predicted_per_token_ms": 3.25}}  # fmt: skip
            self._chunk(b"data: " + json.dumps(final).encode() + b"\n\n")
        self._chunk(b"")


def fake_server(host: str, port: int, model_path: str = "/models/tiny-Q4_K_M.gguf") -> ThreadingHTTPServer:
    """The fake on host:port (0: any free port); the /completion request bodies collect in `.bodies`."""
    server = ThreadingHTTPServer((host, port), FakeLlamaHandler)
    server.daemon_threads = True
    server.bodies = []
    server.model_path = model_path
    return server


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-m", dest="model", default="/models/tiny-Q4_K_M.gguf")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-lv", dest="verbosity", type=int, default=3)
    args, _ = p.parse_known_args(argv)
    if args.verbosity >= 4:  # trace: llama.cpp 0c1e570 logs its system_info, before it loads the model
        print("0.00.003.183 I cmn  common_param: system_info: n_threads = 2 | CPU : FAKE = 1 |", file=sys.stderr)
    if args.model.startswith(os.devnull):  # a model that cannot load (the system_info probe's): it exits
        sys.exit(1)
    fake_server(args.host, args.port, args.model).serve_forever()  # SIGTERM ends it


if __name__ == "__main__":
    main()
