"""Run a command and report its wall time and the peak memory of its whole process tree.

`/usr/bin/time -v` reports the largest single process; a parallel build's cost
is the sum over its concurrent nvcc jobs, which is what this samples.

    python tools/peak_rss.py -- flashgen build --arch sm80
"""
import os
import subprocess
import sys
import time


def tree_rss_kb(root: int) -> int:
    children, rss = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/status") as f:
                rss[int(pid)] = next((int(l.split()[1]) for l in f if l.startswith("VmRSS:")), 0)
            children.setdefault(int(fields[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total


def main() -> int:
    argv = sys.argv[1:]
    if argv and argv[0] == "--":
        argv = argv[1:]
    start = time.monotonic()
    proc = subprocess.Popen(argv)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss_kb(proc.pid))
        time.sleep(0.5)
    print(f"peak_rss: wall {time.monotonic() - start:.1f} s, peak tree RSS {peak / 1024 / 1024:.2f} GiB, "
          f"exit {proc.returncode}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
