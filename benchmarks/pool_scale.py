"""Collectives, bytes per rank and host memory of ``pool_step`` at 2 to 16 gloo ranks.

``python benchmarks/pool_scale.py [NODES] [--worlds 2 4 ...]``: the table of docs/distributed.md. For each
world size, ``tests/dist_scripts/run_pool.py`` runs that many processes (CPU, gloo, no
Lightning) on a synthetic record of NODES nodes (default 2,178: the node labels of the
32-layer Llama-like model under dynamo capture), with ``rank_spread``, every tenth node
replicated and value histograms of 2 nodes in 200. Each rank counts the collectives it
calls and the bytes of their tensors, and the peak RSS the pool adds (glibc's mmap
threshold fixed at 128 KiB, so large buffers are returned to the system and seen).
Printed per world size: the collectives, the bytes each rank sends into them (received
alike: every one is a reduction), the largest peak RSS any rank added and rank 0's, and
the pool's wall time on rank 0 (2 cores shared by every rank: it grows with the world
here, not on a cluster).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist_scripts" / "run_pool.py"
WORLDS = (2, 4, 8, 16)


def run(world: int, nodes: int) -> List[Dict[str, Any]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "MALLOC_MMAP_THRESHOLD_": "131072",
        "OMP_NUM_THREADS": "1",
    }
    with tempfile.TemporaryDirectory() as out:
        procs = [
            subprocess.Popen([sys.executable, str(SCRIPT), out, str(r), str(world), str(nodes)], env=env)
            for r in range(world)
        ]
        if any(p.wait(timeout=600) for p in procs):
            raise SystemExit(f"a rank failed at world {world}")
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def main(nodes: int, worlds: Sequence[int] = WORLDS) -> None:
    print(f"{nodes} nodes")
    print("| ranks | collectives | bytes per rank | peak RSS added, largest rank | rank 0 | pool time, rank 0 |")
    print("|---:|---|---:|---:|---:|---:|")
    for world in worlds:
        ranks = run(world, nodes)
        calls = ranks[0]["calls"]
        assert all(r["calls"] == calls for r in ranks)
        names = ", ".join(f"{name} {op}" for name, op, _ in calls)
        total = sum(size for _, _, size in calls)
        peak = max(r["peak_rss_added"] for r in ranks)
        print(
            f"| {world} | {len(calls)}: {names} | {total:,} | {peak / 2**20:.1f} MiB | "
            f"{ranks[0]['peak_rss_added'] / 2**20:.1f} MiB | {ranks[0]['seconds'] * 1e3:.0f} ms |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nodes", nargs="?", type=int, default=2178, help="nodes in the synthetic record (2178)")
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS), help="world sizes (2 4 8 16)")
    args = parser.parse_args()
    main(args.nodes, args.worlds)
