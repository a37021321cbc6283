"""The host path as one opaque graph op: a tensor's packed statistics for compiled graphs on the CPU.

``host_packed_record(x, groups)`` gives the same packed vector layout as
``traceable.packed_record`` with the whole tensor as ONE row (``whole_packed_size``
elements): the row's ``ROW_FIELDS`` are the tensor's mean as the scaled shift, scale 1, the
sum of deviations 0, m2 as the sum of squares, its NaN and non-finite counts and max |x|;
then the fields of the other groups (``extra_fields``), then, with ``channels``, its channel
row. The numbers come from the host path: the native kernel's one read where it takes ``x``
(``fast_host_record``, at any size: the recorder batches short tensors, a graph op cannot,
and torch's exact short path costs ~20 us a tensor, the kernel ~3), else
``record_of(x, groups, host_reads=True)`` (torch code for any other stride, dtype or group),
and ``channels.channel_row``. ``PackedLayout(..., whole=...)`` finishes
both forms into records with the same code.

It is a ``torch.library`` op (``lightning_scale::host_packed_record``, registered once
per process on import, with a fake that gives its size), so a compiler keeps it as one call:
no statistic kernels to generate and compile, and a read at the host kernel's speed. The
compiled route (``capture.compiled``) inserts it for tensors on the CPU and the traceable ops
elsewhere (they compile into the accelerator's kernels); ``LIGHTNING_SCALE_COMPILED_STATS``
chooses (``uses_host_op``).
"""

from __future__ import annotations

import functools
import math
import os
from typing import Callable, Collection, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.stats import fast_host_record, record_of
from lightning_scale.record.stats.channels import CHANNEL_WIDTH, channel_row
from lightning_scale.record.stats.fields import IX, Col, Entry
from lightning_scale.record.stats.host import one_read_moments
from lightning_scale.record.stats.traceable import ROW_FIELDS, extra_fields

__all__ = ["CHOICES", "ENV", "host_packed_record", "uses_host_op", "whole_packed_size"]

#: The environment variable that chooses the compiled route's statistics ops.
ENV = "LIGHTNING_SCALE_COMPILED_STATS"
#: ``auto``: the host op for CPU tensors, traceable ops elsewhere; ``host``: the host op for
#: CPU tensors (as auto); ``ops``: traceable ops on every device (how the tests run them on the CPU).
CHOICES = ("auto", "host", "ops")
_NAMESPACE, _OP = "lightning_scale", "host_packed_record"


def uses_host_op(device: torch.device) -> bool:
    """Whether the compiled route records a tensor on ``device`` with ``host_packed_record``
    (read when a graph is instrumented).

    Raises:
        ValueError: ``LIGHTNING_SCALE_COMPILED_STATS`` is set to anything but ``CHOICES``.
    """
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"`{ENV}` must be one of {', '.join(CHOICES)}, got {value!r}")
    return value != "ops" and device.type == "cpu"


def whole_packed_size(groups: Collection[str]) -> int:
    """Elements of ``host_packed_record`` of any tensor: one row, the other fields, the channel row."""
    return len(ROW_FIELDS) + len(extra_fields(groups)) + (CHANNEL_WIDTH if "channels" in groups else 0)


def host_packed_record(x: Tensor, groups: Collection[str] = ("moments", "range")) -> Tensor:
    """``x``'s statistics as one float64 vector of ``whole_packed_size(groups)`` elements (see
    the module docstring), on ``x``'s device, by one call of the op.

    Args:
        x: a floating-point tensor with at least one element, in host memory; any strides.
        groups: which of ``GROUPS`` to compute ("moments" always is).

    Example:
        >>> packed = host_packed_record(torch.tensor([1.0, 2.0, 3.0]), ("moments", "range"))
        >>> packed.tolist()  # mean, scale 1, sum of deviations 0, m2, NaN, non-finite, max |x|
        [2.0, 1.0, 0.0, 2.0, 0.0, 0.0, 3.0]
    """
    return getattr(getattr(torch.ops, _NAMESPACE), _OP)(x.detach(), ",".join(groups))


_Short = Optional[Callable[[Tensor], Optional[List[Entry]]]]


@functools.lru_cache(maxsize=None)
def _plan(groups: str) -> Tuple[Tuple[str, ...], Tuple[int, ...], _Short, Optional[bool]]:
    """(the groups, the record columns packed after the row, the host path's short record,
    and for groups within moments and range, the default ones, whether max |x| is packed:
    None for any other group, which takes the general path)."""
    chosen = tuple(groups.split(","))
    with_max = "range" in chosen if set(chosen) <= {"moments", "range"} else None
    return chosen, tuple(IX[name] for name in extra_fields(chosen)), fast_host_record(chosen), with_max


#: The first error the op caught since ``take_error`` last read it: the op never raises (an
#: exception inside a compiled graph would end the user's step), its owner reports it.
_errors: List[BaseException] = []


def take_error() -> Optional[BaseException]:
    """The first error the op caught since the last call (None: none), forgotten here."""
    error = _errors[0] if _errors else None
    _errors.clear()
    return error


def _packed(x: Tensor, groups: str) -> Tensor:
    """The op's implementation: ``_record`` of ``x``, or NaN where it failed (the error is
    kept for ``take_error``)."""
    try:
        return _record(x, groups)
    except Exception as err:  # noqa: BLE001 - never raise into the user's compiled graph
        if not _errors:
            _errors.append(err)
        return torch.full((whole_packed_size(groups.split(",")),), math.nan, dtype=torch.float64)


def _record(x: Tensor, groups: str) -> Tensor:
    """The host path's record, rearranged: for moments and range, ``one_read_moments`` where
    it gives them (``fast_host_record``'s numbers, without building a record); else
    ``fast_host_record`` where it takes ``x``, else ``record_of``."""
    if 0 in x.stride() and any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        x = x.contiguous()  # (expanded, as the gradient of a sum: one copy, read as the test's reference reads it)
    chosen, columns, fast, with_max = _plan(groups)
    if with_max is not None:  # the common case in the fewest steps: the same numbers as ``fast`` gives
        got = one_read_moments(x, with_max)
        if got is not None:
            mean, m2, top = got
            return torch.from_numpy(np.array([mean, 1.0, 0.0, m2, 0.0, 0.0, top if with_max else math.nan]))
        fast = None  # (its sums would be these again: straight to ``record_of``'s other passes)
    row = fast(x) if fast is not None else None
    if row is None:
        row = record_of(x, chosen, host_reads=True)
    nan, inf = float(row[Col.NAN]), float(row[Col.INF])
    values = [float(row[Col.MEAN]), 1.0, 0.0, float(row[Col.M2]), nan, nan + inf, float(row[Col.ABSMAX])]
    values += [float(row[c]) for c in columns]
    packed = torch.from_numpy(np.array(values, dtype=np.float64))  # (a third of torch.tensor's time)
    if "channels" in chosen:
        packed = torch.cat([packed, channel_row(x).to(torch.float64)])
    return packed


def _fake(x: Tensor, groups: str) -> Tensor:
    return x.new_empty(whole_packed_size(tuple(groups.split(","))), dtype=torch.float64)


def _registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"{_NAMESPACE}::{_OP}", "CPU")
    except RuntimeError:  # (no such operator yet)
        return False


def _register() -> Optional[torch.library.Library]:
    """Defines the op once per process with a CPU kernel (a plain ``Library`` kernel: less
    than a third of ``custom_op``'s Python dispatch overhead, paid per recorded tensor and
    direction) and a fake that gives its size; None where it is defined already."""
    if _registered():
        return None
    library = torch.library.Library(_NAMESPACE, "FRAGMENT")
    library.define(f"{_OP}(Tensor x, str groups) -> Tensor")
    library.impl(_OP, _packed, "CPU")
    torch.library.register_fake(f"{_NAMESPACE}::{_OP}", _fake, lib=library)
    return library


# (kept for the life of the process: a Library unregisters its ops when collected; a reload
# of this module finds the one it made before)
_LIBRARY = globals().get("_LIBRARY") or _register()
