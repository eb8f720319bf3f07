"""grpc.health.v1 check for scripts and container health checks: python -m clients.health --target HOST:PORT

Exits 0 when the service reports SERVING, 1 otherwise (NOT_SERVING, unreachable, timeout).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.common import HelpFormatter, add_connection_args, open_channel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        formatter_class=HelpFormatter,
        prog="python -m clients.health",
        description=__doc__.splitlines()[0],
    )
    add_connection_args(p)
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=2.0)
    args = p.parse_args(argv)
    try:
        with open_channel(args) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as err:
        print(f"{err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
