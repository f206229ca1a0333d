"""Keep one CPU core busy (a pure-Python busy loop, one process) until killed, to run the tests on a
loaded machine the way CI's 2-core runner can be:

    python scripts/cpu_hog.py & HOG=$!; make test; kill $HOG

It prints its PID first. `--seconds N` ends it after N s anyway, so a forgotten hog never outlives
its run.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=None, help="stop after this many seconds (default: never)")
    args = p.parse_args()
    print(os.getpid(), flush=True)
    end = None if args.seconds is None else time.monotonic() + args.seconds
    n = 0
    while end is None or time.monotonic() < end:
        for _ in range(100_000):  # check the clock now and then, not every iteration
            n += 1


if __name__ == "__main__":
    main()
