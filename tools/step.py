"""Time the steps of ``make test``: one line per step as it ends, and the whole table at the end.

    python3 tools/step.py LOG NAME -- command args...   # run one step, append "NAME seconds status" to LOG
    python3 tools/step.py LOG --summary                 # print the table of every step in LOG

Standard library only: it times the setup step too, before the virtual environment exists. A failing
step prints the table so far (so a red run still says where the minutes went) and exits with its status.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def summary(log: Path) -> str:
    """The steps in ``log`` as a table, with the total."""
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    width = max([len(r[0]) for r in rows] + [5])
    lines = [f"{'step':<{width}}  {'time':>9}  result"]
    lines += [f"{name:<{width}}  {minutes(float(s)):>9}  {status}" for name, s, status in rows]
    lines.append(f"{'total':<{width}}  {minutes(sum(float(r[1]) for r in rows)):>9}")
    return "\n".join(lines)


def minutes(seconds: float) -> str:
    """``754.2`` -> ``"12 min 34 s"``."""
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def run_step(log: Path, name: str, command: list[str]) -> int:
    """Run ``command``, append its line to ``log``, print it; on failure print the table so far."""
    start = time.perf_counter()
    status = subprocess.call(command)
    seconds = time.perf_counter() - start
    result = "ok" if status == 0 else f"FAILED (exit {status})"
    with log.open("a") as f:
        f.write(f"{name}\t{seconds:.1f}\t{result}\n")
    print(f"== step {name}: {result} in {minutes(seconds)}", flush=True)
    if status != 0:
        print("\n" + summary(log), flush=True)
    return status


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1] == "--summary":
        print(summary(Path(argv[0])))
        return 0
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    return run_step(Path(argv[0]), argv[1], argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
