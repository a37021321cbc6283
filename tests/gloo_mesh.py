"""A one-process gloo group and a one-device CPU mesh, for tests of DTensor code in one process."""

from __future__ import annotations

import contextlib
import socket
from typing import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@contextlib.contextmanager
def one_rank_mesh(dim: str) -> Iterator[DeviceMesh]:
    """A mesh of one CPU device whose only dimension is named ``dim``; the process group is
    destroyed on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=(dim,))
    finally:
        dist.destroy_process_group()
