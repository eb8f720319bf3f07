"""What the command-line clients share: channels (TLS, auth), and sampling flags -> a GenerateRequest."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc

from protos.llm.v1 import llm_pb2


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, where it has one worth showing: not None (the server decides), an empty
    value or an off switch, and never twice (a help text that already names its default)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default == "" or default == [] or default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_connection_args(p: argparse.ArgumentParser, auth_help: str = "file holding the bearer token") -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="server address host:port")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to verify the server; enables TLS")
    p.add_argument("--tls-cert", help="client certificate (PEM), for mutual TLS")
    p.add_argument("--tls-key", help="client private key (PEM), for mutual TLS")
    p.add_argument("--tls-server-name", help="expected server name in its certificate (default: the target host)")
    p.add_argument("--auth-token-file", help=auth_help)


def _options(args: argparse.Namespace) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    if args.tls_server_name:
        options.append(("grpc.ssl_target_name_override", args.tls_server_name))
    return options


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if not args.tls_ca:
        return None
    key = Path(args.tls_key).read_bytes() if args.tls_key else None
    cert = Path(args.tls_cert).read_bytes() if args.tls_cert else None
    return grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes(), key, cert)


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    creds, options = _credentials(args), _options(args)
    if creds is not None:
        return grpc.secure_channel(args.target, creds, options=options)
    return grpc.insecure_channel(args.target, options=options)


def open_aio_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """The same channel for asyncio clients (load tester, stress tool); open it inside the running loop."""
    creds, options = _credentials(args), _options(args)
    if creds is not None:
        return grpc.aio.secure_channel(args.target, creds, options=options)
    return grpc.aio.insecure_channel(args.target, options=options)


def call_metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    if not args.auth_token_file:
        return []
    return [("authorization", f"Bearer {Path(args.auth_token_file).read_text().strip()}")]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling and stopping (unset: the server's defaults, which are vLLM's)")
    g.add_argument("--max-tokens", type=int, help="tokens to generate at most (server default 16)")
    g.add_argument("--temperature", type=float, help="softmax temperature, 0 = greedy (server default 1.0)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens, 0 = all")
    g.add_argument("--top-p", type=float, help="keep the smallest set with this cumulative probability, in (0, 1]")
    g.add_argument("--min-p", type=float, help="drop tokens less likely than min_p x the most likely, in [0, 1]")
    g.add_argument("--repetition-penalty", type=float, help="> 1 discourages tokens of the prompt and output")
    g.add_argument("--presence-penalty", type=float, help="subtracted once from generated tokens, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, help="subtracted per occurrence in the output, in [-2, 2]")
    g.add_argument("--seed", type=int, help="sampling seed: the same seed gives the same tokens")
    g.add_argument("--min-tokens", type=int, default=0, help="end-of-sequence is ignored until this many tokens")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--logprobs", type=int, help="log-probabilities of the chosen token and the top N (0-20)")
    g.add_argument("--priority", type=int, default=0, help="lower values are scheduled first")
    g.add_argument("--request-id", default="", help="id echoed in the final message and logs (default: made up)")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (at most one; docs/api.md#structured-outputs)")
    kind = g.add_mutually_exclusive_group()
    kind.add_argument("--json-schema", metavar="FILE", help="the output is JSON valid against this JSON schema file")
    kind.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    kind.add_argument("--regex", help="the output matches this regular expression")
    kind.add_argument("--grammar", metavar="FILE", help="the output matches this Lark grammar (start rule `start`)")
    kind.add_argument("--gbnf", metavar="FILE", help="the output matches this GBNF grammar (start rule `root`)")
    kind.add_argument("--choice", nargs="+", metavar="TEXT", help="the output is exactly one of these strings")
    g.add_argument("--no-any-whitespace", action="store_true", help="JSON without free whitespace")


def constraint_of(args: argparse.Namespace) -> llm_pb2.Constraint | None:
    """The Constraint the flags of add_constraint_args ask for (None: free text); files are read here."""
    c = llm_pb2.Constraint(disable_any_whitespace=args.no_any_whitespace)
    if args.json_schema:
        c.json_schema = Path(args.json_schema).read_text()
    elif args.json_object:
        c.json_object = True
    elif args.regex is not None:
        c.regex = args.regex
    elif args.grammar:
        c.lark_grammar = Path(args.grammar).read_text()
    elif args.gbnf:
        c.gbnf_grammar = Path(args.gbnf).read_text()
    elif args.choice:
        c.choice.choices.extend(args.choice)
    else:
        return None
    return c


def build_request(args: argparse.Namespace, prompt: str, chat: bool) -> llm_pb2.GenerateRequest:
    """Exactly what the flags say; the client does not second-guess the server's validation."""
    req = llm_pb2.GenerateRequest(request_id=args.request_id, priority=args.priority)
    if chat:
        req.messages.messages.add(role="user", content=prompt)
    else:
        req.prompt = prompt
    for name in (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    ):
        value = getattr(args, name)
        if value is not None:
            setattr(req.sampling, name, value)
    if args.max_tokens is not None:
        req.stopping.max_tokens = args.max_tokens
    req.stopping.min_tokens = args.min_tokens
    req.stopping.stop.extend(args.stop)
    req.stopping.stop_token_ids.extend(args.stop_token_id)
    req.stopping.ignore_eos = args.ignore_eos
    if args.logprobs is not None:
        req.output.logprobs = args.logprobs
    constraint = constraint_of(args) if hasattr(args, "json_schema") else None
    if constraint is not None:
        req.constraint.CopyFrom(constraint)
    return req
