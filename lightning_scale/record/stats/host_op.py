"""The host path as one opaque graph op: a tensor's record for compiled graphs on the CPU.

``host_record(x, groups)`` gives ``x``'s record (``stats.FIELDS``, float64) as the host path
computes it, then, with ``channels``, its channel row (``record_size`` elements in all): the
native kernel's one read where it takes ``x`` (``fast_host_record``, at any size: the
recorder batches short tensors, a graph op cannot, and torch's exact short path costs ~20 us
a tensor, the kernel ~3), else ``record_of(x, groups, host_reads=True)`` (torch code for any
other stride, dtype or group), and ``channels.channel_row``. The vectors of a graph's
tensors, concatenated, are their records as they are (``RecordLayout``: a view, no finish).

It is a ``torch.library`` op (``lightning_scale::host_record``, registered once per process
on import, with a fake that gives its size), so a compiler keeps it as one call: no
statistic kernels to generate and compile, and a read at the host kernel's speed. The
compiled route (``capture.compiled``) inserts it in a graph whose tensors are all on the
CPU, and the traceable ops elsewhere (they compile into the accelerator's kernels);
``LIGHTNING_SCALE_COMPILED_STATS`` (``settings.Settings.compiled_stats``) chooses (``uses_host_op``).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Collection, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from lightning_scale.record.stats import fast_host_record, record_of, run_table
from lightning_scale.record.stats.channels import CHANNEL_WIDTH, channel_row
from lightning_scale.record.stats.fields import FIELDS, Col, Entry
from lightning_scale.record.stats.host import one_read_moments

__all__ = ["CHOICES", "ENV", "RecordLayout", "host_record", "host_records", "record_size", "uses_host_op"]

#: The environment variable that chooses the compiled route's statistics ops.
ENV = "LIGHTNING_SCALE_COMPILED_STATS"
#: ``auto``: the host op for CPU tensors, traceable ops elsewhere; ``host``: the host op for
#: CPU tensors (as auto); ``ops``: traceable ops on every device (how the tests run them on the CPU).
CHOICES = ("auto", "host", "ops")
_NAMESPACE, _OP, _OP_ALL = "lightning_scale", "host_record", "host_records"


def uses_host_op(device: torch.device, choice: str = "auto") -> bool:
    """Whether the compiled route records a tensor on ``device`` with ``host_record`` under
    ``choice`` (``CHOICES``: ``Settings.compiled_stats``).

    Raises:
        ValueError: ``choice`` is not one of ``CHOICES``.
    """
    if choice not in CHOICES:
        raise ValueError(f"`{ENV}` must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice != "ops" and device.type == "cpu"


def record_size(groups: Collection[str]) -> int:
    """Elements of ``host_record`` of any tensor: its record, then its channel row (``channels``)."""
    return run_table.layout(groups).width + (CHANNEL_WIDTH if "channels" in groups else 0)


def host_record(x: Tensor, groups: Collection[str] = ("moments", "range")) -> Tensor:
    """``x``'s record (``stats.FIELDS``, the host path's numbers) and, with ``channels``, its
    channel row: one float64 vector of ``record_size(groups)`` elements on ``x``'s device,
    by one call of the op.

    Args:
        x: a floating-point tensor with at least one element, in host memory; any strides.
        groups: which of ``GROUPS`` to compute ("moments" always is).

    Example:
        >>> from lightning_scale.record.stats.fields import IX
        >>> record = host_record(torch.tensor([1.0, 2.0, 3.0]), ("moments", "range"))
        >>> [float(record[IX[f]]) for f in ("count", "mean", "m2", "absmax", "nan", "inf")]
        [3.0, 2.0, 2.0, 3.0, 0.0, 0.0]
    """
    return getattr(getattr(torch.ops, _NAMESPACE), _OP)(x.detach(), ",".join(groups))


def host_records(xs: Sequence[Optional[Tensor]], groups: Collection[str] = ("moments", "range")) -> Tensor:
    """``host_record`` of each of ``xs`` (zeros, an empty record, for None: a gradient that
    backward did not reach), concatenated, by one call of the op (``lightning_scale::host_records``):
    the graph inputs of a compiled graph (its parameters) and their gradients, taken together.

    Args:
        xs: floating-point tensors in host memory (at least one), or None.
        groups: as for ``host_record``.
    """
    return getattr(getattr(torch.ops, _NAMESPACE), _OP_ALL)(
        [None if x is None else x.detach() for x in xs], ",".join(groups)
    )


class RecordLayout:
    """The ``host_record`` vectors of ``len(numels)`` tensors, concatenated: their records and
    channel rows, as views (the interface of ``traceable.PackedLayout``, nothing to finish).

    Args:
        numels: each tensor's element count, in packing order.
        groups: the groups ``host_record`` was given.
    """

    def __init__(self, numels: Sequence[int], groups: Collection[str]) -> None:
        self.numels = tuple(int(n) for n in numels)
        self.width = record_size(groups)
        self.fields = run_table.layout(groups).width
        self.sizes = (self.width,) * len(self.numels)
        self.channels = "channels" in groups

    def records(self, packed: Tensor) -> Tensor:
        """``[len(numels), width]`` float64 records (a view of ``packed``).

        Raises:
            ValueError: ``packed`` does not have ``sum(sizes)`` elements.
        """
        if packed.shape != (len(self.numels) * self.width,):
            raise ValueError(f"`packed` must have shape [{len(self.numels) * self.width}], got {list(packed.shape)}")
        return packed.view(len(self.numels), self.width)[:, : self.fields]

    def channel_rows(self, packed: Tensor) -> Optional[Tensor]:
        """``[len(numels), CHANNEL_WIDTH]`` channel rows (a view; None without ``channels``)."""
        if not self.channels:
            return None
        return packed.view(len(self.numels), self.width)[:, self.fields :]


_Short = Optional[Callable[[Tensor], Optional[List[Entry]]]]


@functools.lru_cache(maxsize=None)
def _plan(groups: str) -> Tuple[Tuple[str, ...], _Short, Optional[bool], np.ndarray]:
    """(the groups, the host path's short record, for groups within moments and range (the
    default ones) whether max |x| is taken (None for any other group: the general path), and
    the one-read path's record template: NaN but the zero NaN and Inf counts)."""
    chosen = tuple(groups.split(","))
    with_max = "range" in chosen if set(chosen) <= {"moments", "range"} else None
    template = np.full(len(FIELDS), math.nan)
    template[Col.NAN] = template[Col.INF] = 0.0
    return chosen, fast_host_record(chosen), with_max, template


#: The first error the op caught since ``take_error`` last read it: the op never raises (an
#: exception inside a compiled graph would end the user's step), its owner reports it.
_errors: List[BaseException] = []


def take_error() -> Optional[BaseException]:
    """The first error the op caught since the last call (None: none), forgotten here."""
    error = _errors[0] if _errors else None
    _errors.clear()
    return error


def _packed(x: Tensor, groups: str) -> Tensor:
    """``host_record``'s implementation: ``_values`` of ``x`` (``_kept``)."""
    return _kept(lambda: _values(x, groups), record_size(groups.split(",")))


def _packed_all(xs: List[Optional[Tensor]], groups: str) -> Tensor:
    """``host_records``' implementation: each tensor's ``_values`` (zeros for None: an empty
    record), concatenated (``_kept``)."""
    width = record_size(groups.split(","))
    return _kept(
        lambda: np.concatenate([_values(x, groups) if x is not None else np.zeros(width) for x in xs]), len(xs) * width
    )


def _kept(values: Callable[[], np.ndarray], size: int) -> Tensor:
    """``values()`` as a tensor, or ``size`` NaN where it failed: the ops never raise (an
    exception inside a compiled graph would end the user's step); the first error is kept
    for ``take_error``."""
    try:
        return torch.from_numpy(values())  # (a third of torch.tensor's time)
    except Exception as err:  # noqa: BLE001 - never raise into the user's compiled graph
        if not _errors:
            _errors.append(err)
        return torch.full((size,), math.nan, dtype=torch.float64)


def _values(x: Tensor, groups: str) -> np.ndarray:
    """The host path's record of ``x`` (then its channel row): for moments and range,
    ``one_read_moments`` where it gives them (``fast_host_record``'s numbers, without building
    its record); else ``fast_host_record`` where it takes ``x``, else ``record_of``."""
    if 0 in x.stride() and any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        x = x.contiguous()  # (expanded, as the gradient of a sum: one copy, read as the test's reference reads it)
    chosen, fast, with_max, template = _plan(groups)
    if with_max is not None:  # the common case in the fewest steps: the same numbers as ``fast`` gives
        got = one_read_moments(x, with_max)
        if got is not None:
            values = template.copy()
            values[Col.COUNT], values[Col.MEAN], values[Col.M2] = x.numel(), got[0], got[1]
            if with_max:
                values[Col.ABSMAX] = got[2]
            return values
        fast = None  # (its sums would be these again: straight to ``record_of``'s other passes)
    row = fast(x) if fast is not None else None
    if row is None:
        row = record_of(x, chosen, host_reads=True)
    values = np.array([float(v) for v in row], dtype=np.float64)
    if "channels" in chosen:
        values = np.concatenate([values, channel_row(x).to(torch.float64).numpy()])
    return values


def _fake(x: Tensor, groups: str) -> Tensor:
    return x.new_empty(record_size(tuple(groups.split(","))), dtype=torch.float64)


def _fake_all(xs: List[Optional[Tensor]], groups: str) -> Tensor:
    given = next(x for x in xs if x is not None)
    return given.new_empty(len(xs) * record_size(tuple(groups.split(","))), dtype=torch.float64)


def _registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"{_NAMESPACE}::{_OP}", "CPU")
    except RuntimeError:  # (no such operator yet)
        return False


def _register() -> Optional[torch.library.Library]:
    """Defines the ops once per process with a CPU kernel (a plain ``Library`` kernel: less
    than a third of ``custom_op``'s Python dispatch overhead, paid per recorded tensor and
    direction) and a fake that gives the size; None where they are defined already."""
    if _registered():
        return None
    library = torch.library.Library(_NAMESPACE, "FRAGMENT")
    library.define(f"{_OP}(Tensor x, str groups) -> Tensor")
    library.impl(_OP, _packed, "CPU")
    torch.library.register_fake(f"{_NAMESPACE}::{_OP}", _fake, lib=library)
    library.define(f"{_OP_ALL}(Tensor?[] xs, str groups) -> Tensor")
    library.impl(_OP_ALL, _packed_all, "CPU")
    torch.library.register_fake(f"{_NAMESPACE}::{_OP_ALL}", _fake_all, lib=library)
    return library


# (kept for the life of the process: a Library unregisters its ops when collected; a reload
# of this module finds the one it made before)
_LIBRARY = globals().get("_LIBRARY") or _register()
