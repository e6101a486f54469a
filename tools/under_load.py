"""Run a command while another process keeps one core busy at the lowest priority, as a browser would.

    python3 tools/under_load.py -- make notebooks-default-model notebooks-test-model

The load is a pure-Python spin loop at ``nice 19`` on one core (a learner's laptop with a browser
tab open): it takes time from the notebooks only when a core would otherwise idle, but it shares
caches and memory bandwidth and wakes the scheduler, which is what makes timings wobble. It is
stopped when the command ends, however it ends. Standard library only.
"""

from __future__ import annotations

import subprocess
import sys

SPIN = "import os\nos.nice(19)\nwhile True:\n    pass\n"


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    load = subprocess.Popen([sys.executable, "-c", SPIN])
    print(f"under load: one core kept busy at nice 19 by pid {load.pid}", flush=True)
    try:
        return subprocess.call(argv[1:])
    finally:
        load.kill()
        load.wait()
        print("under load: the load is stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
