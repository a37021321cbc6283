"""Recorder: collects the statistics of every observed tensor and its gradient in one step.

``observe(key, tensor)`` computes the tensor's statistics at once (before any later
in-place op can change it) and registers a tensor hook that computes the statistics of
its gradient when backward reaches it. Tensor hooks add no autograd node, so in-place ops
on the observed value keep working. Entries stay on the tensor's device until
``records()`` assembles them into one tensor: one read for the whole step.
"""

from __future__ import annotations

import functools
import math
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Hashable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from lightning_scale.record import kernels, placements, placing, stats
from lightning_scale.record.channel_rows import ChannelRows
from lightning_scale.record.placing import BlockRow
from lightning_scale.record.settings import Settings
from lightning_scale.record.short_records import MAX_ELEMENTS, ShortRecords, batchable

__all__ = ["BACKWARD", "FORWARD", "HOST_READS_ENV", "Recorder", "active", "observe", "recording"]

#: The environment switch of ``host_reads`` (``settings.Settings.host_reads``).

FORWARD, BACKWARD = 0, 1
HOST_READS_ENV = "LIGHTNING_SCALE_HOST_READS"

_ACTIVE: Optional["Recorder"] = None


class Recorder:
    """Statistics of observed tensors (forward) and their gradients (backward), by key.

    Args:
        groups: statistic groups to compute (see ``stats.GROUPS``); with ``channels``, each
            tensor's channel row too (``channels``, ``channel_tensor``).
        host_reads: allow reading intermediate results on the host (fast on CPU; see
            ``stats.record_of``). ``None`` decides per tensor by its device, unless the
            settings force it (``LIGHTNING_SCALE_HOST_READS``: ``0`` device path forced,
            ``1`` host reads everywhere).
        settings: the environment switches (``settings.Settings``); None: read from the
            environment now (a recorder made outside ``ScaleMonitor``).

    Device-path records that the fused Triton kernel computes (``LIGHTNING_SCALE_KERNEL``,
    see ``lightning_scale.record.kernels``) are written straight into rows of a buffer on
    the device, which ``records()`` stacks.

    Raises:
        ValueError: ``LIGHTNING_SCALE_HOST_READS`` or ``LIGHTNING_SCALE_KERNEL`` is set to
            something else.
    """

    def __init__(
        self,
        groups: Sequence[str] = ("moments", "range"),
        host_reads: Optional[bool] = None,
        settings: Optional[Settings] = None,
    ) -> None:
        self.groups = tuple(groups)
        #: the ``channels`` group's rows (``stats.channels``), kept beside the records; None without it
        self.channels: Optional[ChannelRows] = ChannelRows() if "channels" in self.groups else None
        groups = tuple(g for g in self.groups if g != "channels")  # (the record's groups)
        self.settings = Settings.from_env().apply() if settings is None else settings
        self.host_reads = self.settings.host_reads if host_reads is None else host_reads
        self.kernel = self.settings.kernel
        self._buffer = _RowBuffer(stats.run_table.layout(groups).width)  # the device rows the fused kernel writes
        self._slots: Dict[Hashable, int] = {}  # key -> slot
        self._keys: List[Hashable] = []  # slot -> key
        self._rows: List[Tuple[int, int, Union[List[stats.Entry], Tensor, BlockRow]]] = []
        self._blocks: List[Tensor] = []  # row blocks (``add_rows``), read at ``records()`` as one
        self._block_rows = 0  # rows in ``_blocks``
        self._handles: List[Any] = []
        self._host_only = True  # every entry so far is a float (host-read records)
        self._previous: Optional[Tuple[Any, int, int]] = None  # (weakref, version, slot)
        self._same: Dict[int, List[int]] = {}  # slot -> slots that returned the same tensor
        self._grads: Dict[
            int, Tuple[Any, int, Union[List[stats.Entry], Tensor]]
        ] = {}  # id -> (weakref, version, entry)
        self._groups = groups
        #: the record layout: the built-in fields, then the user statistics' of ``groups``
        self.layout = stats.run_table.layout(groups)
        self.width = self.layout.width
        self._user_groups = tuple(g for g in groups if stats.run_table.is_user(g))
        self._short = ShortRecords(groups)  # host tensors of a few elements: taken together
        self._partials = placements.PartialSums()  # gradients no node reduces: summed at flush()
        self._fast = stats.fast_host_record(groups)  # host tensors above them: one read, few steps
        self.error: Optional[BaseException] = None
        #: keys whose values' log2 histogram (``stats.log2_histogram``) is also taken
        self.histogram_keys: set = set()
        self.histograms: Dict[Tuple[Hashable, int], Tensor] = {}
        self.device: Optional[torch.device] = None
        #: (key, FORWARD or BACKWARD) -> why its tensor was not recorded (``"sparse_coo layout"``)
        self.skipped: Dict[Tuple[Hashable, int], str] = {}
        # rows known only after backward (a compiled graph's gradient rows): taken at ``flush()``
        self._later: List[Tuple[List[Hashable], int, Callable[[], Optional[Tensor]]]] = []

    @property
    def keys(self) -> List[Hashable]:
        """Observed keys, in the order they were first seen (execution order)."""
        return list(self._keys)

    def slot(self, key: Hashable) -> int:
        if key not in self._slots:
            self._slots[key] = len(self._keys)
            self._keys.append(key)
        return self._slots[key]

    def observe(self, key: Hashable, x: Tensor, forward: bool = True) -> None:
        """Record ``x`` (forward) now and its gradient (backward) when it arrives. A tensor
        of another layout than strided (sparse, mkldnn) is not recorded: ``skipped`` says so.
        ``forward=False``: the gradient only (another rank records the same value)."""
        slot = self._slots.get(key)  # (one lookup: this runs after every node of a tracked step)
        if slot is None:
            slot = self.slot(key)
        if not forward:
            pass
        elif placements.is_distributed(x):  # a DTensor: this rank's part of the full tensor
            self._add_part(slot, FORWARD, x)
        elif x.layout is not torch.strided:
            self._skip(slot, FORWARD, x)
        else:
            prev = self._previous
            version = -1 if x.is_inference() else x._version  # inference tensors have no counter
            if prev is not None and prev[0]() is x and prev[1] == version >= 0 and prev[2] != slot:
                # The node returned its input itself (dropout with p=0, .contiguous(), .to()
                # to the same dtype): same values, same gradient. Reuse, do not recompute.
                self._same.setdefault(prev[2], []).append(slot)
                return
            self._previous = (weakref.ref(x), version, slot)
            self._add(slot, FORWARD, x)
        if x.requires_grad and torch.is_grad_enabled():
            self._hook_gradient(slot, x)

    def observe_gradient(self, key: Hashable, grad: Tensor) -> None:
        """Record ``grad`` as ``key``'s gradient (backward) now: a gradient-side tensor no hook
        hands over (torchao's float8 cast of a layer's output gradient, made in its backward)."""
        self._on_grad(self.slot(key), grad)

    def _hook_gradient(self, slot: int, x: Tensor) -> None:
        if not x.is_leaf:
            x.register_hook(functools.partial(self._on_grad, slot))
            return
        # A hook on a leaf (a parameter) outlives the step: it removes itself after the
        # one gradient it was registered for; clear() removes those still waiting.
        box: List[Any] = []
        box.append(x.register_hook(functools.partial(self._on_leaf_grad, slot, box)))
        self._handles.append(box[0])

    def add_rows(self, keys: Sequence[Hashable], direction: int, rows: Tensor) -> None:
        """Records computed elsewhere (the statistic rows a compiled graph returns): ``rows[i]``,
        a float64 ``[len(FIELDS)]`` row on the device, is ``keys[i]``'s record in ``direction``
        (``FORWARD`` or ``BACKWARD``). Kept on the device, merged like observed records."""
        if len(keys) != rows.shape[0] or rows.shape[1:] != (self.width,):
            raise ValueError(f"`rows` must be [{len(keys)}, {self.width}], got {list(rows.shape)}")
        if self.device is None:
            self.device = rows.device
        start = self._block_rows
        self._blocks.append(rows)  # (kept whole: no tensor op per row, here or when read)
        self._block_rows += len(keys)
        for i, key in enumerate(keys):
            self._rows.append((self.slot(key), direction, BlockRow(start + i)))

    def add_rows_later(self, keys: Sequence[Hashable], direction: int, rows: Callable[[], Optional[Tensor]]) -> None:
        """As ``add_rows``, with rows that exist only once backward has run: ``rows()`` is
        called by ``flush()`` (and so by ``records()``); None means no rows (no backward)."""
        for key in keys:
            self.slot(key)
        self._later.append((list(keys), direction, rows))

    def _add_part(self, slot: int, direction: int, x: Tensor) -> None:
        """Record this rank's disjoint part of the DTensor ``x`` (``placements.local_part``)."""
        local, why = placements.local_part(x, parameter=direction == FORWARD and x.is_leaf)
        if why is not None:
            self.skipped[(self._keys[slot], direction)] = why
        elif local is not None:
            self._add(slot, direction, local)

    def _skip(self, slot: int, direction: int, x: Tensor) -> None:
        """No statistics for ``x``: they are defined here for strided tensors only."""
        self.skipped[(self._keys[slot], direction)] = f"{str(x.layout).replace('torch.', '')} layout"

    def _on_leaf_grad(self, slot: int, box: List[Any], grad: Tensor) -> None:
        box[0].remove()
        self._on_grad(slot, grad)

    def _on_grad(self, slot: int, grad: Tensor) -> None:
        if placements.is_partial(grad) and self._partials.add((slot, BACKWARD), grad):
            return  # (kept whatever the error state: every rank joins their reduction in ``flush``)
        if self.error is not None:
            return
        if grad.layout is not torch.strided:  # (a sparse embedding's weight gradient)
            self._skip(slot, BACKWARD, grad)
            return
        try:
            if placements.is_distributed(grad):  # (a DTensor's gradient: its part, as its value's)
                self._add_part(slot, BACKWARD, grad)
                return
            # Autograd hands the very same gradient tensor to several nodes (an add passes
            # its output's gradient to both inputs: the residual stream): unchanged since
            # (same version), it has the same statistics. Reuse, do not recompute.
            seen, version = self._grads.get(id(grad)), grad._version
            if seen is not None and seen[0]() is grad and seen[1] == version:
                self._rows.append((slot, BACKWARD, seen[2]))
                if self.histogram_keys:
                    self._histogram(slot, BACKWARD, grad)
                if self.channels is not None:
                    self.channels.add(slot, BACKWARD, grad)
                return
            self._grads[id(grad)] = (weakref.ref(grad), version, self._add(slot, BACKWARD, grad))
        except Exception as err:  # noqa: BLE001 - never break the user's backward
            self.error = err

    def _add(self, slot: int, direction: int, x: Tensor) -> Union[List[stats.Entry], Tensor]:
        if self.device is None:
            self.device = x.device
        host = x.is_cpu if self.host_reads is None else self.host_reads
        n = x.numel()
        if host and n <= MAX_ELEMENTS and batchable(x, self._groups):  # (numel first: most tensors are long)
            entry = self._short.add(x)
        else:
            self._host_only = self._host_only and host
            fast = self._fast(x) if host and n > MAX_ELEMENTS and self._fast is not None else None
            if fast is not None:
                entry = fast
            elif not host and n and kernels.uses_triton(x, self.kernel):
                entry = self._triton(x)
            else:
                entry = stats.record_of(x, self._groups, host, self.kernel, self.layout)
        self._rows.append((slot, direction, entry))
        if self.histogram_keys:
            self._histogram(slot, direction, x)
        if self.channels is not None:
            self.channels.add(slot, direction, x)
        return entry

    def _triton(self, x: Tensor) -> Tensor:
        """``x``'s record in a row of the buffer: the fused kernel's groups, the reference the rest
        (the blocks of a strided last dimension, user statistics)."""
        entry = self._buffer.take(x.device)
        fields = entry if not self._user_groups else entry[: len(stats.FIELDS)]  # (the kernel's columns)
        left = kernels.record_into(x, self._groups, fields)  # (user statistics: left to the reference)
        if left:
            cols, values = stats.reference.columns(x, left, self.layout)
            entry[cols] = values
        return entry

    def _histogram(self, slot: int, direction: int, x: Tensor) -> None:
        key = self._keys[slot]
        if key in self.histogram_keys:
            h = stats.log2_histogram(x)
            prev = self.histograms.get((key, direction))
            self.histograms[(key, direction)] = h if prev is None else prev + h

    def records(
        self, keys: Optional[Sequence[Hashable]] = None, aliases: Optional[Mapping[Hashable, Hashable]] = None
    ) -> Tensor:
        """One ``[len(keys), 2, len(FIELDS)]`` float64 tensor on the observed device.

        Row ``[i, FORWARD]`` is key ``i``'s forward record, ``[i, BACKWARD]`` its
        gradient's; a key seen more than once in a direction has its records merged; a
        key never seen has an empty record (count 0); a key in ``aliases`` (never observed
        itself) gets its source key's record, whether or not the source is among ``keys``.
        Nothing is read to the host.
        """
        keys = self.keys if keys is None else list(keys)
        self.flush()
        out = torch.zeros(len(keys), 2, self.width, dtype=torch.float64, device=self.device)
        targets = self._targets(keys, aliases or {})
        entries: List[Union[List[stats.Entry], Tensor]] = []
        dst: List[int] = []  # flat output row (key * 2 + direction) of each placement
        src: List[int] = []  # its entry (a block's row: -1 - its row in the blocks)
        for slot, d, entry in self._rows:
            where = targets.get(slot)
            if not where:
                continue
            if type(entry) is BlockRow:
                at = -1 - entry.at
            else:
                at = len(entries)
                entries.append(entry)
            for i in where:
                dst.append(i * 2 + d)
                src.append(at)
        if not dst:
            return out
        # each entry once (a record shared by aliases is placed, not copied, per key); the
        # blocks' rows after them
        assembled = self._assembled(entries)
        if self._blocks:
            src = [j if j >= 0 else len(entries) - 1 - j for j in src]
        placing.place(out.view(-1, self.width), assembled, dst, src)
        return out

    def _assembled(self, entries: List[Union[List[stats.Entry], Tensor]]) -> Tensor:
        """The records of ``entries`` (``stats.assemble``), then the blocks' rows: one tensor."""
        parts = (
            [stats.assemble(entries, device=self.device, host_only=self._host_only, width=self.width)]
            if entries
            else []
        )
        parts += self._blocks
        parts = [p if p.device == self.device else p.to(self.device) for p in parts]  # (same device: no copy)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def flush(self) -> None:
        """Compute the records of the short tensors observed so far (``ShortRecords``).
        ``records()`` flushes first; call it before reading ``error`` to have their
        failure there too (kept in ``error``, never raised: monitoring must not break a step)."""
        if len(self._partials):
            self._reduce_partials()
        if self.error is not None:
            return
        try:
            self._short.flush()
            later, self._later = self._later, []
            for keys, direction, rows in later:
                taken = rows()
                if taken is not None:
                    self.add_rows(keys, direction, taken)
        except Exception as err:  # noqa: BLE001 - reported by the owner of the recorder
            self.error = err

    def _reduce_partials(self) -> None:
        """Record the ``Partial`` gradients kept this step, summed over their ranks (one
        collective per mesh group: ``placements.PartialSums``)."""
        try:
            for (slot, direction), summed in self._partials.reduce():
                if summed is not None and self.error is None:
                    self._add(slot, direction, summed)
        except Exception as err:  # noqa: BLE001 - reported by the owner of the recorder
            self.error = err

    def _targets(self, index: Sequence[Hashable], aliases: Mapping[Hashable, Hashable]) -> Dict[int, List[int]]:
        """Slot -> the indices (in ``index``, the keys asked for) of every key its records
        answer: its own key, keys whose nodes returned the very tensor it produced (seen at
        run time) and ``aliases`` (views, module outputs; known from the graph),
        transitively. The same from step to step: cached on every input."""
        same = tuple((s, tuple(t)) for s, t in self._same.items())
        return placing.targets(tuple(self._keys), tuple(index), tuple(aliases.items()), same)

    def histogram_tensor(self, keys: Sequence[Hashable]) -> Tensor:
        """The log2 histograms of ``keys``: ``[len(keys), 2, bins]`` float64 counts on the
        observed device, zero where a key's direction had none. Nothing is read to the host."""
        bins = stats.LOG2_HI - stats.LOG2_LO
        out = torch.zeros(len(keys), 2, bins, dtype=torch.float64, device=self.device)
        for i, key in enumerate(keys):
            for d in (FORWARD, BACKWARD):
                h = self.histograms.get((key, d))
                if h is not None:
                    out[i, d] = h  # the same device: a device-side copy
        return out

    def channel_tensor(self, keys: Sequence[Hashable], aliases: Optional[Mapping[Hashable, Hashable]] = None) -> Tensor:
        """The channel rows of ``keys`` (``stats.channels``), placed as ``records`` places records:
        ``[len(keys), 2, CHANNEL_WIDTH]`` float64 on the observed device, zeros (no channel)
        where a key's direction had none or without the ``channels`` group. Nothing is read back."""
        rows = self.channels if self.channels is not None else ChannelRows()
        return rows.tensor(self._targets(list(keys), aliases or {}), len(keys), self.device)

    def clear(self) -> None:
        """Forget this step's entries and remove its hooks (keys and their order are kept)."""
        self._rows.clear()
        self._blocks.clear()
        self._block_rows = 0
        if self.channels is not None:
            self.channels.clear()
        self._host_only = True
        self._previous = None
        self._same.clear()
        self._grads.clear()
        self._short.clear()
        self._buffer.clear()
        self.histograms.clear()
        self.skipped.clear()
        self._later.clear()
        self._partials.clear()
        self.error = None
        self.remove_hooks()

    def remove_hooks(self) -> None:
        """Remove gradient hooks still registered on leaf tensors (parameters, inputs)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _RowBuffer:
    """Record rows on the device, handed out one by one and reused after ``clear()``:
    chunks of ``CHUNK`` rows, never moved (a kernel may still be writing a row)."""

    CHUNK = 256

    def __init__(self, width: int) -> None:
        self.width = width
        self._chunks: Dict[torch.device, List[Tensor]] = {}
        self._used: Dict[torch.device, int] = {}

    def take(self, device: torch.device) -> Tensor:
        chunks = self._chunks.setdefault(device, [])
        used = self._used.get(device, 0)
        if used == len(chunks) * self.CHUNK:
            chunks.append(torch.full((self.CHUNK, self.width), math.nan, dtype=torch.float64, device=device))
        self._used[device] = used + 1
        return chunks[used // self.CHUNK][used % self.CHUNK]

    def clear(self) -> None:
        """Hand the rows out again (``records()`` has copied them, in stream order)."""
        self._used.clear()


def active() -> Optional[Recorder]:
    """The recorder that ``observe`` currently feeds, if any."""
    return _ACTIVE


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Route ``observe`` calls (from instrumented graphs) to ``recorder`` in this block."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, recorder
    try:
        yield recorder
    finally:
        _ACTIVE = previous


@torch.compiler.disable
def observe(x: Any, key: Hashable, forward: bool = True) -> None:
    """Called by instrumented graphs after each node: record floating tensors.

    Opaque to TorchDynamo: when the user compiles code that runs a tracked forward,
    dynamo calls it as it is instead of tracing the recorder (and recompiling per key).

    A failure while taking statistics is kept in ``recorder.error`` and never reaches
    the model: monitoring must not break a training step.
    """
    rec = _ACTIVE
    if rec is not None and rec.error is None and isinstance(x, Tensor) and x.is_floating_point():
        try:
            rec.observe(key, x, forward)
        except Exception as err:  # noqa: BLE001 - reported by the owner of the recorder
            rec.error = err
