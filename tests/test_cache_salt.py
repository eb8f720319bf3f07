"""The prefix cache as a side channel, and the cache salt that closes it (issue 15).

Without salts, a client learns from Usage.cached_prompt_tokens (and TTFT) whether another client sent a prompt:
a right guess of a secret in the first KV block is served from the cache, wrong guesses are not. Requests share
prefix blocks only under the same cache_salt; with --cache-salt-per-token, only under the same bearer token.
Real gRPC servers on 127.0.0.1 over the tiny model; every KV block comes back after each test.
"""

from __future__ import annotations

import contextvars
import queue
from pathlib import Path

import grpc
import pytest

from protos.llm.v1 import llm_pb2
from service.__main__ import config_from_args, parse_args
from service.api.interceptors import TENANT_SALT, AuthInterceptor, cache_salt, read_tokens, token_salt
from tests.engines import build_tiny
from tests.servers import ServerThread, generate, make_config, running_server

pytestmark = pytest.mark.server

SECRET = "{} is the condition code of patient Jane Doe, admitted on Monday to ward 3."  # the code: first block
TOKENS = "# tenants of this server\nalpha-token\n\n  beta-token  \n# retired: gamma-token\n"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny(tmp_path_factory, "tiny-salt", max_batch_size=8, max_num_tokens=64, max_seq_len=512)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text(TOKENS)
    return path


def _complete(srv: ServerThread, prompt: str, salt: str = "", token: str | None = None) -> llm_pb2.Complete:
    req = llm_pb2.GenerateRequest(
        prompt=prompt,
        cache_salt=salt,
        sampling=llm_pb2.SamplingParams(temperature=0),
        stopping=llm_pb2.StoppingParams(max_tokens=2, ignore_eos=True),
    )
    metadata = [("authorization", f"Bearer {token}")] if token else None
    _, complete = generate(srv.stub(), req, metadata=metadata, timeout=30)
    assert complete is not None
    return complete


def _cached(srv: ServerThread, prompt: str, salt: str = "", token: str | None = None) -> int:
    return _complete(srv, prompt, salt, token).usage.cached_prompt_tokens


def _full_hit(srv: ServerThread, prompt: str) -> int:
    """cached_prompt_tokens of a prompt whose every full block is cached (the last token is always computed)."""
    n = len(srv.server.backend.tokenizer.encode(prompt))
    bs = srv.server.backend.info.kv_block_size
    assert n > 2 * bs  # the secret sits in the first block, and more than one block can be shared
    return (n - 1) // bs * bs


def test_a_guess_shows_without_salts_and_not_across_salts(engine_dir: Path) -> None:
    with running_server(engine_dir) as srv:
        # the side channel, kept by default: unsalted requests share prefix blocks
        assert _cached(srv, SECRET.format(417)) == 0  # client A
        guesses = {code: _cached(srv, SECRET.format(code)) for code in (415, 416, 417, 418)}  # client B
        assert guesses == {415: 0, 416: 0, 417: _full_hit(srv, SECRET.format(417)), 418: 0}
        # A salts its prompt: B learns nothing, whether B salts its guesses or not
        secret = SECRET.format(523)
        assert _cached(srv, secret, salt="tenant-a") == 0
        assert {code: _cached(srv, SECRET.format(code), salt="tenant-b") for code in (522, 523, 524)} == {
            522: 0,
            523: 0,
            524: 0,
        }
        assert _cached(srv, secret) == 0
        assert _cached(srv, secret, salt="tenant-a") == _full_hit(srv, secret)  # A still shares with itself
        assert srv.idle()


def test_salt_per_token_keeps_tenants_apart(engine_dir: Path, token_file: Path) -> None:
    prompt = SECRET.format(777)
    with running_server(engine_dir, auth_token_file=str(token_file), cache_salt_per_token=True) as srv:
        assert _cached(srv, prompt, token="alpha-token") == 0
        assert _cached(srv, prompt, token="beta-token") == 0  # another tenant, the same prompt
        assert _cached(srv, prompt, token="alpha-token") == _full_hit(srv, prompt)  # the same token twice
        assert _cached(srv, prompt, token="beta-token") == _full_hit(srv, prompt)
        # a client salt narrows a tenant's sharing further, and cannot bridge two tenants
        assert _cached(srv, prompt, salt="shared", token="alpha-token") == 0
        assert _cached(srv, prompt, salt="shared", token="beta-token") == 0
        assert _cached(srv, prompt, salt="shared", token="alpha-token") == _full_hit(srv, prompt)
        for token in (None, "gamma-token", "# tenants of this server"):  # comment lines are no tokens
            with pytest.raises(grpc.RpcError) as err:
                _cached(srv, prompt, token=token)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert srv.idle()


def test_several_tokens_without_the_flag_share_as_before(engine_dir: Path, token_file: Path) -> None:
    prompt = SECRET.format(778)
    with running_server(engine_dir, auth_token_file=str(token_file)) as srv:
        assert _cached(srv, prompt, token="alpha-token") == 0
        assert _cached(srv, prompt, token="beta-token") == _full_hit(srv, prompt)
        assert srv.idle()


def _triton_generate(url: str, token: str, prompt: str) -> None:
    """One request over the Triton front door's ModelStreamInfer (each request runs in a task of its own)."""
    import tritonclient.grpc as tg

    from tests.triton_clients import inputs, is_final

    client, results = tg.InferenceServerClient(url), queue.Queue()
    client.start_stream(
        lambda result, error: results.put((result, error)), headers={"authorization": f"Bearer {token}"}
    )
    tensors = inputs("ensemble", text_input=prompt, max_tokens=2, stream=True)
    client.async_stream_infer("ensemble", tensors, enable_empty_final_response=True)
    try:
        result, error = results.get(timeout=30)
        while error is None and not is_final(result):
            result, error = results.get(timeout=30)
        assert error is None, error
    finally:
        client.stop_stream()
        client.close()


def test_salt_per_token_covers_the_triton_front_door(engine_dir: Path, token_file: Path) -> None:
    prompt = SECRET.format(779)
    overrides = {"auth_token_file": str(token_file), "cache_salt_per_token": True, "triton_port": 0}
    with running_server(engine_dir, **overrides) as srv:
        _triton_generate(f"127.0.0.1:{srv.server.triton_port}", "alpha-token", prompt)
        assert _cached(srv, prompt, token="beta-token") == 0  # alpha's blocks, cached under alpha's salt
        assert _cached(srv, prompt, token="alpha-token") == _full_hit(srv, prompt)
        assert srv.idle()


def test_cache_salt_is_bounded_in_bytes(engine_dir: Path) -> None:
    with running_server(engine_dir) as srv:
        assert _complete(srv, "Hi", salt="é" * 128).finish_reason == llm_pb2.FINISH_REASON_LENGTH  # 256 bytes
        with pytest.raises(grpc.RpcError) as err:
            _complete(srv, "Hi", salt="é" * 129)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "cache_salt allows at most 256 bytes, got 258"
        assert srv.idle()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"cache_salt_per_token": True}, "--cache-salt-per-token needs --auth-token-file"),
        (
            {"cache_salt_per_token": True, "backend_name": "triton", "backend.triton.url": "127.0.0.1:1"},
            "the triton backend cannot pass a cache salt",
        ),
    ],
)
def test_salt_per_token_refuses_to_start_where_it_cannot_work(
    engine_dir: Path, token_file: Path, overrides: dict, message: str
) -> None:
    if overrides.get("backend_name") == "triton":
        overrides = {**overrides, "auth_token_file": str(token_file)}
    srv = ServerThread(make_config(engine_dir, **overrides))
    try:
        with pytest.raises(ValueError, match=message):
            srv.start()
    finally:
        srv.stop()


# ---- the pieces ----------------------------------------------------------------------------------------------------


def test_token_files(tmp_path: Path) -> None:
    single = tmp_path / "single"
    single.write_text("s3cret\n")
    assert read_tokens(str(single)) == ("s3cret",)  # today's one-token file
    several = tmp_path / "several"
    several.write_text(TOKENS)
    assert read_tokens(str(several)) == ("alpha-token", "beta-token")
    empty = tmp_path / "empty"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no token"):
        read_tokens(str(empty))


def test_each_token_authenticates_and_has_its_own_salt() -> None:
    auth = AuthInterceptor(("alpha-token", "beta-token"), salt_per_token=True)
    assert auth.match("Bearer alpha-token") == b"alpha-token" and auth.match("bearer  beta-token ") == b"beta-token"
    assert auth.match("Bearer gamma-token") is None and auth.match("alpha-token") is None
    salts = {token_salt(b"alpha-token"), token_salt(b"beta-token")}
    assert len(salts) == 2 and all(len(s) == 64 and "token" not in s for s in salts)  # a keyed hash, not the token
    assert AuthInterceptor("s3cret").allows("Bearer s3cret")  # one token, as before


def test_the_effective_salt_puts_the_tenant_first() -> None:
    assert cache_salt("") == "" and cache_salt("x") == "x"  # no tenant: the client's salt as given

    def as_tenant(tenant: str, client: str) -> str:
        TENANT_SALT.set(tenant)
        return cache_salt(client)

    alpha, beta = token_salt(b"alpha-token"), token_salt(b"beta-token")
    run = contextvars.copy_context().run
    assert run(as_tenant, alpha, "") == f"{alpha}:" != run(as_tenant, beta, "")
    assert run(as_tenant, alpha, "x") != run(as_tenant, beta, "x")
    assert run(as_tenant, alpha, f"{beta}:") != f"{beta}:"  # a client cannot claim another tenant's salt
    assert TENANT_SALT.get() == ""  # each call's value stays in its own context


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args(parse_args(["--engine", "e"])).cache_salt_per_token is False
    assert config_from_args(parse_args(["--engine", "e", "--cache-salt-per-token"])).cache_salt_per_token is True
    monkeypatch.setenv("LLM_CACHE_SALT_PER_TOKEN", "1")
    assert config_from_args(parse_args(["--engine", "e"])).cache_salt_per_token is True
