"""The callback's own event file in a TensorBoard run directory, which never fails a fit.

ScaleMonitor does not write through the TensorBoard logger's ``SummaryWriter``: a failure
there (a full disk, a directory gone read-only) would also fail Lightning's own writes
through it, and TensorBoard's writer thread raises into the process. Instead each run
directory gets one more event file (``events.out.tfevents.<time>.<host>.<pid>.<n>.scales``),
which TensorBoard reads with the logger's own (it reads every event file of a run).

``EventFile`` is written on the caller's thread (the ``Worker``), one append a step:

- **it stops at the first failure**, with one warning naming the directory, the error and
  the first step lost; later steps are dropped, training goes on;
- **it stops at a byte cap** (``Budget``, shared by a run's files: ``max_log_bytes``), with
  one warning; the file stays within the cap;
- its records' checksums (TFRecord framing) use google-crc32c's C code where installed:
  TensorBoard's own pure-Python CRC-32C costs ~0.3 us a byte, ~90 ms a step of ~6000
  scalars. Only this file's framing uses it; TensorBoard's writer is left as it is.
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

__all__ = ["SUFFIX", "Budget", "EventFile", "masked_crc32c", "varint"]

#: The end of our event files' names (TensorBoard reads any file whose name has ``tfevents``).
SUFFIX = ".scales"
_COUNTER = itertools.count()


def masked_crc32c(data: bytes) -> int:
    """TensorBoard's ``masked_crc32c`` (TFRecord framing), on google-crc32c's C code where installed."""
    crc = _crc32c()
    if crc is None:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboards

        return int(tensorboards(data))
    x = crc(bytes(data))
    return (((x >> 15) | ((x << 17) & 0xFFFFFFFF)) + 0xA282EAD8) & 0xFFFFFFFF


@functools.lru_cache(maxsize=1)
def _crc32c() -> Optional[Callable[[bytes], int]]:
    """google-crc32c's ``value`` if its C code is installed (its Python fallback is no faster)."""
    try:
        import google_crc32c
    except ImportError:
        return None
    return google_crc32c.value if google_crc32c.implementation == "c" else None


def _record(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, the data, its masked CRC."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


@dataclass
class Budget:
    """Bytes a run's event files may still take (``limit`` None: no cap)."""

    limit: Optional[int] = None
    used: int = 0
    warned: bool = False  # the one warning for reaching the limit was given

    def allows(self, size: int) -> bool:
        """Whether ``size`` more bytes stay within the limit."""
        return self.limit is None or self.used + size <= self.limit


class EventFile:
    """One event file of ours in ``log_dir``, opened at its first write.

    Args:
        log_dir: the run directory (the TensorBoard logger's ``log_dir``; local or a
            TensorBoard-supported remote path).
        warn: called once, with what was lost and from which step, when writing stops.
        budget: the run's byte cap, shared with its other files.

    Example::

        file = EventFile(str(tmp_path), print)
        file.add_scalars(b"...", step=0)  # (bytes of a Summary, see report.scalars)
        file.flush()
    """

    def __init__(self, log_dir: str, warn: Callable[[str], None], budget: Optional[Budget] = None) -> None:
        self.log_dir = log_dir
        self.warn = warn
        self.budget = budget if budget is not None else Budget()
        self.stopped: Optional[str] = None  # why writing stopped, once it has
        self.path: Optional[str] = None
        self._pending: List[bytes] = []
        self._first_step: Optional[int] = None  # of the pending records
        self._file: Any = None
        self._written = 0  # bytes of whole steps in the file

    def add_summary(self, summary: Any, step: Optional[int] = None) -> None:
        """Queue ``summary`` (a ``Summary`` or its serialized bytes) as an event at ``step``."""
        from tensorboard.compat.proto import event_pb2

        if self.stopped:
            return
        data = summary if isinstance(summary, bytes) else summary.SerializeToString()
        head = event_pb2.Event(wall_time=time.time(), step=int(step or 0)).SerializeToString()
        # an Event's field 5 (summary, length-delimited), appended to its other fields
        self._add(head + b"\x2a" + varint(len(data)) + data, step or 0)

    def flush(self) -> None:
        """Append the queued records to the file; on failure, stop with one warning."""
        if self.stopped or not self._pending:
            return
        data, self._pending = b"".join(self._pending), []
        step, self._first_step = self._first_step, None
        try:
            self._open().write(data)
            self._written += len(data)
        except Exception as err:  # noqa: BLE001 - a failing disk must not end the fit
            where = self.path or self.log_dir
            self._cut_partial()
            self._stop(f"writing to {where} failed ({type(err).__name__}: {err})", step)

    def _cut_partial(self) -> None:
        """A full disk takes part of a write: cut a local file back to its whole steps, so that a
        step is in it whole or not at all (best effort: another file system keeps what it took)."""
        try:
            if self.path is not None and os.path.isfile(self.path):
                os.truncate(self.path, self._written)
        except OSError:
            pass

    def close(self) -> None:
        """Flush and close (errors are warned once, never raised)."""
        self.flush()
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except Exception as err:  # noqa: BLE001 - closing must not end the fit
                self._stop(f"closing {self.path} failed ({type(err).__name__}: {err})", None)

    def _add(self, event: bytes, step: int) -> None:
        record = _record(event)
        if not self.budget.allows(len(record)):
            warn, self.budget.warned = not self.budget.warned, True
            self._stop(f"its event files reached `max_log_bytes`={self.budget.limit} bytes", step, warn)
            return
        self.budget.used += len(record)
        self._pending.append(record)
        self._first_step = step if self._first_step is None else self._first_step

    def _open(self) -> Any:
        if self._file is None:
            from tensorboard.compat import tf
            from tensorboard.compat.proto import event_pb2

            tf.io.gfile.makedirs(self.log_dir)
            name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
            self.path = os.path.join(self.log_dir, f"{name}.{next(_COUNTER)}{SUFFIX}")
            self._file = tf.io.gfile.GFile(self.path, "wb")
            version = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString()
            self._file.write(_record(version))
            self._written = len(_record(version))
        return self._file

    def _stop(self, why: str, step: Optional[int], warn: bool = True) -> None:
        self.stopped, self._pending = why, []  # (a step is written whole or not at all)
        if not warn:
            return
        since = f" from step {step} on" if step is not None else ""
        self.warn(
            f"ScaleMonitor: {why}; it writes nothing more there this run: the scale scalars, histograms, "
            f"text and dashboard records{since} are lost. Training continues."
        )


def varint(n: int) -> bytes:
    """Protobuf's base-128 encoding of a non-negative ``n``."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
