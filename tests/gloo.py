"""Gloo helpers for tests: a one-process mesh for DTensor code, and N rank processes of a
script under ``tests/dist_scripts`` that each save ``rank{r}.pt``."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, Iterator, List, Mapping, Sequence

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_rank_mesh(dim: str) -> Iterator[DeviceMesh]:
    """A mesh of one CPU device whose only dimension is named ``dim``; the process group is
    destroyed on exit."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=(dim,))
    finally:
        dist.destroy_process_group()


def load_script(path: Path) -> ModuleType:
    """The script at ``path`` imported as a module (its helpers give the tests' references)."""
    spec = importlib.util.spec_from_file_location(f"_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Ranks:
    """``world`` processes of a script over gloo, started by ``start_ranks``."""

    def __init__(self, script: Path, out: Path, procs: "List[subprocess.Popen[str]]", timeout: float) -> None:
        self.script, self.out, self.procs, self.timeout = script, out, procs, timeout

    def wait(self) -> List[Dict[str, Any]]:
        """Fail the test if a rank hangs or fails; each rank's saved ``rank{r}.pt``."""
        try:
            logs = [p.communicate(timeout=self.timeout)[0] for p in self.procs]
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"{self.script.name} ranks hung")
        for p, log in zip(self.procs, logs):
            assert p.returncode == 0, log[-3000:]
        return [torch.load(self.out / f"rank{r}.pt", weights_only=False) for r in range(len(self.procs))]

    def stop(self) -> None:
        """Kill the ranks still running (a test that started them was not run)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def start_ranks(
    script: Path, out: Path, world: int, args: Sequence[str] = (), env: Mapping[str, str] = {}, timeout: float = 180
) -> Ranks:
    """Start ``script OUT RANK WORLD *args`` as ``world`` processes over gloo (one thread
    each). Started early, the ranks run while other tests do (much of a rank's time is
    start-up); ``Ranks.wait`` collects them."""
    port = str(free_port())
    full = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **env}
    full["OMP_NUM_THREADS"] = "1"
    cmd = lambda r: [sys.executable, str(script), str(out), str(r), str(world), *args]  # noqa: E731
    procs = [
        subprocess.Popen(cmd(r), env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    return Ranks(script, out, procs, timeout)


def run_ranks(
    script: Path, out: Path, world: int, args: Sequence[str] = (), env: Mapping[str, str] = {}, timeout: float = 180
) -> List[Dict[str, Any]]:
    """Run ``script OUT RANK WORLD *args`` as ``world`` processes over gloo (one thread each),
    fail the test if one hangs or fails, and return each rank's saved ``rank{r}.pt``."""
    return start_ranks(script, out, world, args, env, timeout).wait()
