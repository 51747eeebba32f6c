"""Run a command and report the peak resident memory of its whole process tree.

    .venv/bin/python tools/peak_rss.py --out runs/x/peak_rss.json -- .venv/bin/sao-train CONFIG

Samples /proc every `--interval` seconds (Linux): the RSS of every descendant (trainer, vLLM
engine server and its worker), summed. Writes {"peak_tree_rss_gib", "peak_by_command_gib",
"load_average_samples", "wall_s", "returncode"} to `--out` and stderr; exits with the
command's return code. RSS counts shared pages once per process, so the sum is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree(root: int) -> dict[int, tuple[str, int]]:
    """{pid: (command name, rss bytes)} of `root` and all its descendants."""
    children: dict[int, list[int]] = {}
    info: dict[int, tuple[str, int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            rss_pages = int(Path(f"/proc/{d}/statm").read_text().split()[1])
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
        name = " ".join(c.decode(errors="replace") for c in cmd[:3])[:80]
        info[int(d)] = (name, rss_pages * PAGE)
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in info:
            out[pid] = info[pid]
        todo.extend(children.get(pid, []))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    peak, by_cmd, loads = 0, {}, []
    while proc.poll() is None:
        tree = _tree(proc.pid)
        peak = max(peak, sum(r for _, r in tree.values()))
        for name, rss in tree.values():
            by_cmd[name] = max(by_cmd.get(name, 0), rss)
        if not loads or time.time() - loads[-1][0] > 60:
            loads.append((time.time(), os.getloadavg()[0]))
        time.sleep(args.interval)
    gib = 2**30
    res = {
        "peak_tree_rss_gib": round(peak / gib, 3),
        "peak_by_command_gib": {k: round(v / gib, 3) for k, v in by_cmd.items() if v > gib / 20},
        "load_average_samples": [round(x, 1) for _, x in loads],
        "wall_s": round(time.time() - t0, 1),
        "returncode": proc.returncode,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res), file=sys.stderr)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
