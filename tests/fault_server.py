"""`python -m service` with the FaultyRunner test double around the native runner, for process-level tests.

python -m tests.fault_server --fail-at-step N [--stall-at-step N --stall-seconds S] -- <python -m service flags>
Steps count from engine load, so the warm-up generation's steps (2 for its 2 tokens) come first.
"""

from __future__ import annotations

import argparse
import sys

from service import __main__ as service_main
from service.engine.core import EngineCore
from tests.doubles import FaultyRunner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fault_server")
    p.add_argument("--fail-at-step", type=int)
    p.add_argument("--stall-at-step", type=int)
    p.add_argument("--stall-seconds", type=float, default=0.0)
    p.add_argument("service_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    real_init = EngineCore.__init__

    def init(self, *a, **kw) -> None:
        real_init(self, *a, **kw)
        self.runner = FaultyRunner(self.runner, args.fail_at_step, args.stall_at_step, args.stall_seconds)

    EngineCore.__init__ = init
    rest = args.service_args[1:] if args.service_args[:1] == ["--"] else args.service_args
    return service_main.main(rest)


if __name__ == "__main__":
    sys.exit(main())
