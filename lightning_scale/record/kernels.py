"""Which kernel computes statistics on the device path: Triton's fused one or torch's.

``LIGHTNING_SCALE_KERNEL`` (``settings.Settings.kernel``, read where the core is entered and
passed down as ``kernel``):

- ``auto`` (default): the fused Triton kernel (``lightning_scale.record.triton_stats``,
  one read per tensor) where Triton is importable and the tensor is on a CUDA device
  (ROCm included), torch's kernels otherwise;
- ``triton``: the Triton kernel on every device; a CPU tensor needs Triton's interpreter
  (``TRITON_INTERPRET=1`` set before triton is imported: how the tests run the kernel);
- ``torch``: torch's kernels.

float64 tensors, and dtypes other than float32, bfloat16 and float16, always take
torch's kernels. The host path (CPU tensors with host reads) does not look at this.
"""

from __future__ import annotations

import functools
from typing import Collection, FrozenSet, Mapping, Optional

import torch
from torch import Tensor

from lightning_scale.record.settings import Settings

__all__ = ["CHOICES", "DTYPES", "ENV", "choice", "record_into", "status", "triton_missing", "uses_triton"]

ENV = "LIGHTNING_SCALE_KERNEL"
CHOICES = ("auto", "triton", "torch")
#: Input dtypes the Triton kernel reads.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def choice(environ: Optional[Mapping[str, str]] = None) -> str:
    """The value of ``LIGHTNING_SCALE_KERNEL`` (``auto`` when unset or empty), as
    ``Settings.from_env`` reads it.

    Raises:
        ValueError: it is set to anything but ``auto``, ``triton`` or ``torch``.
    """
    return Settings.from_env(environ).kernel


@functools.lru_cache(maxsize=1)
def triton_missing() -> Optional[str]:
    """None where the Triton kernel can be imported, else why not."""
    try:
        from lightning_scale.record import triton_stats  # noqa: F401 - the import is the check
    except Exception as err:  # noqa: BLE001 - any failure means: torch's kernels
        return f"{type(err).__name__}: {err}"
    return None


def _interpreted() -> bool:
    from lightning_scale.record import triton_stats

    return triton_stats.interpreted()


def uses_triton(x: Tensor, kernel: Optional[str] = None) -> bool:
    """Whether the device-path statistics of ``x`` take the Triton kernel under ``kernel``
    (``CHOICES``; None: ``auto``).

    Raises:
        RuntimeError: ``triton`` is asked for where it cannot run: Triton is not
            importable, or ``x`` is on the CPU without the interpreter.
    """
    kernel = "auto" if kernel is None else kernel
    if kernel == "torch" or x.dtype not in DTYPES:
        return False
    if kernel == "auto":
        return x.is_cuda and triton_missing() is None and not _interpreted()
    missing = triton_missing()
    if missing is not None:
        raise RuntimeError(
            f"`{ENV}=triton` but Triton cannot be imported ({missing}); `pip install triton` or set `{ENV}=auto`"
        )
    if x.device.type == "cpu" and not _interpreted():
        raise RuntimeError(
            f"`{ENV}=triton` on a CPU tensor needs Triton's interpreter: "
            "set TRITON_INTERPRET=1 before triton is imported"
        )
    return True


def record_into(x: Tensor, groups: Collection[str], row: Tensor) -> FrozenSet[str]:
    """``triton_stats.record_into`` (see there): returns the asked groups left to torch code."""
    from lightning_scale.record import triton_stats

    return triton_stats.record_into(x, groups, row)


def status(device: torch.device, host_reads: Optional[bool] = None, kernel: Optional[str] = None) -> str:
    """One line for the logs: which kernel computes the device-path statistics on
    ``device``, and why (``host_reads``: the recorder's setting, None = by device; ``kernel``:
    ``Settings.kernel``, None: as the environment says).

    Raises:
        ValueError: ``LIGHTNING_SCALE_KERNEL`` has a bad value.
    """
    kernel = choice() if kernel is None else kernel
    if device.type == "cpu" and host_reads is not False:
        return f"statistics on the host path (native kernel or torch's); {ENV} applies to the device path"
    if kernel == "torch":
        return f"device statistics: torch's kernels ({ENV}=torch)"
    missing = triton_missing()
    fails = (
        f"device statistics: {ENV}=triton will fail: " if kernel == "triton" else "device statistics: torch's kernels "
    )
    if missing is not None:
        return fails + f"(Triton not importable: {missing})"
    interpreted = _interpreted()
    if kernel == "auto" and (device.type != "cuda" or interpreted):
        return f"device statistics: torch's kernels (auto: Triton runs on CUDA devices; this is {device.type})"
    if device.type == "cpu" and not interpreted:
        return fails + "(a CPU tensor needs TRITON_INTERPRET=1 before triton is imported)"
    mode = " under Triton's interpreter" if interpreted else ""
    return f"device statistics: fused Triton kernel{mode} (one read per tensor, two with fp8)"
