"""TLS and mutual TLS: good clients connect; plaintext, wrong-CA and certificate-less clients do not."""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest

from protos.llm.v1 import llm_pb2, llm_pb2_grpc
from tests.engines import build_tiny
from tests.servers import running_server

pytestmark = pytest.mark.server


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}", cwd=d)  # fmt: skip


def _leaf(d: Path, name: str, ca: str, san: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "DNS:localhost,IP:127.0.0.1")
    _leaf(d, "client", "ca", "DNS:client")
    _leaf(d, "rogue-client", "rogue-ca", "DNS:client")
    return d


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-tls", max_seq_len=256)


def _call(channel: grpc.Channel) -> grpc.StatusCode:
    try:
        llm_pb2_grpc.LLMServiceStub(channel).GetModelInfo(llm_pb2.GetModelInfoRequest(), timeout=5)
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


def _secure(target: str, pki: Path, ca: str = "ca", client: str | None = None) -> grpc.Channel:
    key = (pki / f"{client}.key").read_bytes() if client else None
    cert = (pki / f"{client}.crt").read_bytes() if client else None
    creds = grpc.ssl_channel_credentials((pki / f"{ca}.crt").read_bytes(), key, cert)
    return grpc.secure_channel(target, creds)


def test_tls(engine_dir: Path, pki: Path) -> None:
    with running_server(engine_dir, tls_cert=str(pki / "server.crt"), tls_key=str(pki / "server.key")) as srv:
        assert _call(_secure(srv.target, pki)) == grpc.StatusCode.OK
        assert _call(grpc.insecure_channel(srv.target)) == grpc.StatusCode.UNAVAILABLE
        assert _call(_secure(srv.target, pki, ca="rogue-ca")) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(engine_dir: Path, pki: Path) -> None:
    overrides = {
        "tls_cert": str(pki / "server.crt"),
        "tls_key": str(pki / "server.key"),
        "tls_client_ca": str(pki / "ca.crt"),
    }
    with running_server(engine_dir, **overrides) as srv:
        assert _call(_secure(srv.target, pki, client="client")) == grpc.StatusCode.OK
        assert _call(_secure(srv.target, pki)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        assert _call(_secure(srv.target, pki, client="rogue-client")) == grpc.StatusCode.UNAVAILABLE
        assert _call(grpc.insecure_channel(srv.target)) == grpc.StatusCode.UNAVAILABLE


def test_tls_key_without_cert_is_refused(engine_dir: Path, pki: Path) -> None:
    from service.api.server import LLMServer
    from tests.servers import make_config

    server = LLMServer(make_config(engine_dir, tls_key=str(pki / "server.key")))
    import asyncio

    with pytest.raises(ValueError, match="go together"):
        asyncio.run(server.start())


# ---- the Triton front door (--triton-port): the same credentials and the same bearer token ----------------------
def _triton_ready(url: str, pki: Path | None = None, client: str | None = None, **kw) -> bool | str:
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    if pki is not None:
        kw.update(ssl=True, root_certificates=str(pki / "ca.crt"))
        if client:
            kw.update(private_key=str(pki / f"{client}.key"), certificate_chain=str(pki / f"{client}.crt"))
    try:
        c = tg.InferenceServerClient(url, **kw)
        return c.get_model_metadata("ensemble", client_timeout=5).name == "ensemble"
    except InferenceServerException as exc:
        return str(exc.status())


def test_tls_covers_the_triton_port(engine_dir: Path, pki: Path) -> None:
    overrides = {
        "tls_cert": str(pki / "server.crt"),
        "tls_key": str(pki / "server.key"),
        "tls_client_ca": str(pki / "ca.crt"),
        "triton_port": 0,
    }
    with running_server(engine_dir, **overrides) as srv:
        url = f"127.0.0.1:{srv.server.triton_port}"
        assert _triton_ready(url, pki, client="client") is True
        assert _triton_ready(url, pki) == "StatusCode.UNAVAILABLE"  # no client certificate
        assert _triton_ready(url, pki, client="rogue-client") == "StatusCode.UNAVAILABLE"
        assert _triton_ready(url) == "StatusCode.UNAVAILABLE"  # plaintext


def test_bearer_token_covers_the_triton_port(engine_dir: Path, tmp_path: Path) -> None:
    import numpy as np
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    from tests.triton_clients import Streamer, inputs

    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with running_server(engine_dir, auth_token_file=str(token), triton_port=0) as srv:
        url = f"127.0.0.1:{srv.server.triton_port}"
        good = {"authorization": "Bearer s3cret"}
        assert _triton_ready(url) == "StatusCode.UNAUTHENTICATED"
        assert tg.InferenceServerClient(url).is_server_ready()  # KServe's health checks, like grpc.health
        client = tg.InferenceServerClient(url)
        assert client.get_model_metadata("ensemble", headers=good).name == "ensemble"
        tensors = inputs("ensemble", text_input="Hi", max_tokens=4, stream=True)
        denied = Streamer(url)  # refused when the stream opens, before any request is sent
        _, error = denied.queue.get(timeout=10)
        assert error is not None and "UNAUTHENTICATED" in str(error)
        with pytest.raises(InferenceServerException, match="no longer in valid state"):
            denied.send("ensemble", tensors)
        denied.close()
        allowed = tg.InferenceServerClient(url)
        results = []
        allowed.start_stream(callback=lambda result, error: results.append((result, error)), headers=good)
        allowed.async_stream_infer("ensemble", tensors, enable_empty_final_response=True)
        allowed.stop_stream()  # waits for the stream to end
        assert results and all(e is None for _, e in results)
        assert np.concatenate([r.as_numpy("text_output").reshape(-1) for r, _ in results]).size >= 1


def _https_status(port: int, pki: Path, client: str | None = None) -> int | str:
    """GET /v2/models/ensemble over HTTPS (the CA `ca` trusted, with a client certificate or none)."""
    import http.client
    import ssl

    ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if client:
        ctx.load_cert_chain(str(pki / f"{client}.crt"), str(pki / f"{client}.key"))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=10)
    try:
        conn.request("GET", "/v2/models/ensemble")
        return conn.getresponse().status
    except (ssl.SSLError, OSError) as exc:
        return type(exc).__name__
    finally:
        conn.close()


def test_tls_covers_the_triton_http_port(engine_dir: Path, pki: Path) -> None:
    import http.client

    overrides = {
        "tls_cert": str(pki / "server.crt"),
        "tls_key": str(pki / "server.key"),
        "tls_client_ca": str(pki / "ca.crt"),
        "triton_http_port": 0,
    }
    with running_server(engine_dir, **overrides) as srv:
        port = srv.server.triton_http_port
        assert _https_status(port, pki, client="client") == 200
        assert isinstance(_https_status(port, pki), str)  # no client certificate: the handshake fails
        assert isinstance(_https_status(port, pki, client="rogue-client"), str)
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((OSError, http.client.HTTPException)):  # plaintext to a TLS port
            plain.request("GET", "/v2/health/ready")
            plain.getresponse()
        plain.close()
