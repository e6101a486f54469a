"""Time the steps of ``make test``: one line per step as it ends, and the whole table at the end.

    python3 tools/step.py LOG NAME -- command args...   # run one step, append "NAME seconds status" to LOG
    python3 tools/step.py LOG --side-by-side "CMD A" "CMD B"   # run two lanes of steps at once (shell commands)
    python3 tools/step.py LOG --summary                 # print the table of every step in LOG

Side by side: each lane is a shell command (``make test-lane-a``) whose own steps log as usual, marked with
their lane; their output goes to ``LOG``'s folder (``lane-a.log``, ...) and is printed whole, lane after lane,
when both have ended, so two runs never interleave. The table then shows each lane's steps and one ``wall``
row, the time both took together, which is what the total counts.

Standard library only: it times the setup step too, before the virtual environment exists. A failing
step prints the table so far (so a red run still says where the minutes went) and exits with its status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

LANE_ENV = "WORKBOOK_STEP_LANE"


def summary(log: Path) -> str:
    """The steps in ``log`` as a table, with the total (a lane's steps count through their ``wall`` row)."""
    rows = [line.split("\t") for line in log.read_text().splitlines() if line.strip()] if log.exists() else []
    rows = [r + [""] * (4 - len(r)) for r in rows]  # name, seconds, status, lane ("" outside a lane)
    label = lambda r: f"  lane {r[3]}: {r[0]}" if r[3] else r[0]  # noqa: E731
    width = max([len(label(r)) for r in rows] + [5])
    lines = [f"{'step':<{width}}  {'time':>9}  result"]
    lines += [f"{label(r):<{width}}  {minutes(float(r[1])):>9}  {r[2]}" for r in rows]
    lines.append(f"{'total':<{width}}  {minutes(sum(float(r[1]) for r in rows if not r[3])):>9}")
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
    lane = os.environ.get(LANE_ENV, "")
    with log.open("a") as f:
        f.write(f"{name}\t{seconds:.1f}\t{result}" + (f"\t{lane}" if lane else "") + "\n")
    print(f"== step {name}: {result} in {minutes(seconds)}", flush=True)
    if status != 0:
        print("\n" + summary(log), flush=True)
    return status


def side_by_side(log: Path, commands: list[str]) -> int:
    """Run each shell command in ``commands`` as a lane (a, b, ...) at once; replay their output; log ``wall``."""
    start = time.perf_counter()
    lanes = []
    for lane, command in zip("abcdefgh", commands):
        out = (log.parent / f"lane-{lane}.log").open("w")
        lanes.append((lane, command, out, subprocess.Popen(command, shell=True, stdout=out, stderr=subprocess.STDOUT,
                                                           env={**os.environ, LANE_ENV: lane})))
    print(f"== side by side: " + "; ".join(f"lane {lane}: {command}" for lane, command, _, _ in lanes), flush=True)
    statuses = []
    for lane, command, out, proc in lanes:
        statuses.append(proc.wait())
        out.close()
        print(f"== lane {lane} ended ({'ok' if statuses[-1] == 0 else f'exit {statuses[-1]}'}) after "
              f"{minutes(time.perf_counter() - start)}", flush=True)
    for lane, command, out, _ in lanes:
        print(f"\n==================== lane {lane}: {command} ====================", flush=True)
        sys.stdout.write(Path(out.name).read_text())
    status = next((s for s in statuses if s != 0), 0)
    with log.open("a") as f:
        f.write(f"wall ({' + '.join(f'lane {lane}' for lane, *_ in lanes)})\t{time.perf_counter() - start:.1f}\t"
                f"{'ok' if status == 0 else 'FAILED'}\n")
    if status != 0:
        print("\n" + summary(log), flush=True)
    return status


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1] == "--summary":
        print(summary(Path(argv[0])))
        return 0
    if len(argv) >= 3 and argv[1] == "--side-by-side":
        return side_by_side(Path(argv[0]), argv[2:])
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    return run_step(Path(argv[0]), argv[1], argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
