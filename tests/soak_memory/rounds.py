"""Where the soak's memory goes: N rounds of tests/test_soak.py's traffic against one live server,
with the server's RSS outside its KV pool after each round, live Python objects by type (and a
tracemalloc snapshot with --tracemalloc), and with --trim the RSS again after glibc's malloc_trim.

    cd <checkout> && PYTHONPATH=$PWD python tests/soak_memory/rounds.py 4 --out /tmp/soak-mem [--trim] [--tracemalloc]

A diagnostic, not a test: it takes minutes a round on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import tracemalloc
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from live_server import ServerProcess  # noqa: E402
from test_soak import plan_round, resident_bytes, soak_round, wait_until_idle  # noqa: E402


def wait_for_file(path: Path) -> None:
    while not path.exists():
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rounds", type=int)
    parser.add_argument("--out", type=Path, required=True, help="directory for the server's dumps")
    parser.add_argument("--trim", action="store_true", help="malloc_trim after each round, and measure again")
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slower)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {"ROSEINFER_MEMDEBUG": str(args.out), "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"}
    if args.tracemalloc:
        env["ROSEINFER_TRACEMALLOC"] = "1"
    server = ServerProcess(env=env)
    pid = server.process.pid
    plans = plan_round(seed=13)
    try:
        print(f"idle: {resident_bytes(pid) / 2**20:.1f} MiB", flush=True)
        for number in range(1, args.rounds + 1):
            started = time.monotonic()
            outcomes = asyncio.run(soak_round(server.url, plans))
            wait_until_idle(server)
            rss = resident_bytes(pid)
            os.kill(pid, signal.SIGUSR1)
            wait_for_file(args.out / f"dump{number}.json")
            line = (f"round {number}: {time.monotonic() - started:.0f} s, "
                    f"{sum(o.status >= 500 for o in outcomes)} 5xx; RSS outside the KV pool {rss / 2**20:.1f} MiB")
            if args.trim:
                os.kill(pid, signal.SIGUSR2)
                wait_for_file(args.out / f"trim{number}")
                line += f", after malloc_trim {resident_bytes(pid) / 2**20:.1f} MiB"
            objects = sum(count for _, count in json.loads((args.out / f"dump{number}.json").read_text())["types"])
            print(f"{line}; {objects} Python objects (top 300 types)", flush=True)
        if args.tracemalloc and args.rounds > 1:
            first = tracemalloc.Snapshot.load(str(args.out / "snap1.tm"))
            last = tracemalloc.Snapshot.load(str(args.out / f"snap{args.rounds}.tm"))
            print(f"tracemalloc, round 1 -> {args.rounds}: the largest differences")
            for stat in last.compare_to(first, "lineno")[:10]:
                print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+6d} blocks  {stat.traceback[0]}")
    finally:
        print(f"server stopped: {server.stop()}", flush=True)


if __name__ == "__main__":
    main()
