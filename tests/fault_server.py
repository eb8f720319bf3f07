"""`python -m service` with the FaultyRunner test double around the native runner, for process-level tests.

python -m tests.fault_server [--fail-at-step N | --stall-at-step N | --fail-when-decoding N |
    --stall-when-decoding N | --on-signal fail|stall] [--stall-seconds S] -- <python -m service flags>
Steps count from engine load, so the warm-up generation's steps (2 for its 2 tokens) come first. The
--*-when-decoding faults hit the first step in which N requests decode together, and with --on-signal SIGUSR1
arms the fault for the next step: either way nothing depends on how fast the engine runs.
"""

from __future__ import annotations

import argparse
import signal
import sys

from service import __main__ as service_main
from service.engine.core import EngineCore
from tests.doubles import FaultyRunner


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fault_server")
    p.add_argument("--fail-at-step", type=int)
    p.add_argument("--stall-at-step", type=int)
    p.add_argument("--fail-when-decoding", type=int, help="fail the first step in which N sequences decode")
    p.add_argument("--stall-when-decoding", type=int, help="stall the first step in which N sequences decode")
    p.add_argument("--on-signal", choices=("fail", "stall"), help="SIGUSR1 arms this fault for the next step")
    p.add_argument("--stall-seconds", type=float, default=600.0)
    p.add_argument("service_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    real_init = EngineCore.__init__
    runners: list[FaultyRunner] = []

    def init(self, *a, **kw) -> None:  # runs in the worker thread that loads the engine
        real_init(self, *a, **kw)
        self.runner = FaultyRunner(
            self.runner,
            args.fail_at_step,
            args.stall_at_step,
            args.stall_seconds,
            args.fail_when_decoding,
            args.stall_when_decoding,
        )
        runners.append(self.runner)

    def arm(*_: object) -> None:
        for runner in runners:
            runner.fail_next() if args.on_signal == "fail" else runner.stall_next()

    EngineCore.__init__ = init
    if args.on_signal:
        signal.signal(signal.SIGUSR1, arm)  # the main thread's: signal handlers cannot be set elsewhere
    rest = args.service_args[1:] if args.service_args[:1] == ["--"] else args.service_args
    return service_main.main(rest)


if __name__ == "__main__":
    sys.exit(main())
