"""What a fresh KV pool's first touch costs on 4 KB against 2 MB pages (kvserve.cache.huge_pages).

    python benchmarks/first_touch.py --out docs/results/first_touch.json

A pool's pages are committed as its blocks are first handed out (zeroed), that is, while
serving. Each round allocates ``--mib`` MiB the way the engine allocates a pool, once on 4 KB and
once on 2 MB pages, and times its first fill (the page faults: the kernel's, and the host's where
a VM's memory is backed on demand) and a second fill (the memory alone). One thread.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from workloads import cpu_name

from kvserve.cache.huge_pages import empty_per_block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for round_index in range(args.rounds):
        for huge in (False, True):
            pool = empty_per_block((args.mib << 20,), torch.uint8, torch.device("cpu"), huge)
            start = time.perf_counter()
            pool.fill_(0)
            first = time.perf_counter() - start
            start = time.perf_counter()
            pool.fill_(1)
            second = time.perf_counter() - start
            del pool
            rows.append({"round": round_index, "pages": "2 MB" if huge else "4 KB", "first_touch_ms": 1e3 * first,
                         "second_fill_ms": 1e3 * second})
            print(f"round {round_index}, {rows[-1]['pages']} pages: first touch of {args.mib} MiB "
                  f"{1e3 * first:.0f} ms, second fill {1e3 * second:.0f} ms", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"cpu": cpu_name(), "mib": args.mib, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
