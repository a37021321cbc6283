"""Reading a run's SCALES records straight from its event files: the command-line tools' fast path.

TensorBoard's event multiplexer (``logdir.LogDir``, the dashboard's reader) parses and
checksums every event of a run, the per-node scalars included: 21 s of CPU time here for a
run of 10,000 nodes over 100 tracked steps with ``ScaleMonitor``'s default ``max_tags=1000``
(this reader: 0.2 s, the same values), minutes without the cap. The records hold
every node's statistics anyway, so this reader reads each event file once, finds the events
that carry the ``scales`` plugin's tensors by their tag in the raw bytes, parses and
checksums only those, and builds the ``RunData`` with ``data.from_records``, the
dashboard's own placing: the same labels, steps, statistics and values as the dashboard
(its tests compare the two on real runs). It reads the records only: no update ratios and
no annotated code (``RunData.ratios`` and ``RunData.code`` stay empty).

Runs are named as TensorBoard names them: each directory under ``path`` that holds event
files (a name with ``tfevents``), relative to ``path`` (``"."`` for ``path`` itself); its
files are read in name order (their names start with the time they were opened), and a
step recorded twice (a resumed run) keeps its last record.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Dict, Iterator, List, NamedTuple, Tuple, Union

from lightning_scale.dashboard import data, metadata

__all__ = ["event_files", "read_run", "read_runs"]

_HEADER = struct.Struct("<QI")  # TFRecord: data length, masked CRC of the length
_MARKS = (metadata.TAG.encode(), metadata.RECORDS.encode())  # tags of the events parsed


class Datum(NamedTuple):
    """A tensor read back, as TensorBoard's data provider hands one over."""

    step: int
    numpy: Any


def event_files(path: Union[str, "os.PathLike[str]"]) -> Dict[str, List[Path]]:
    """``{run name: its event files in name order}`` for every directory under ``path`` that holds some."""
    root = Path(path)
    out: Dict[str, List[Path]] = {}
    for folder, _, names in sorted(os.walk(root)):
        files = sorted(Path(folder) / n for n in names if "tfevents" in n)
        if files:
            out[os.path.relpath(folder, root)] = files
    return out


def read_runs(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Dict[str, data.RunData]]:
    """``{run name: {tag prefix: RunData}}`` of every run under ``path`` that holds SCALES
    records (``""`` training, ``"val_"`` validation); runs without records are left out."""
    out = {}
    for run, files in event_files(path).items():
        per_prefix = _run_data(files)
        if per_prefix:
            out[run] = per_prefix
    return out


def read_run(path: Union[str, "os.PathLike[str]"], prefix: str = "") -> Tuple[str, data.RunData]:
    """The one run at or under ``path`` (a run's directory, or a log directory holding exactly
    one run): its name and its ``RunData`` under the tag ``prefix``. Logs without records
    (written before them) are read from their scalars through ``logdir.LogDir``.

    Raises:
        NoRunError: ``path`` does not exist, holds no run, holds several, or its run logged
            nothing under ``prefix``.
    """
    from lightning_scale.dashboard.logdir import LogDir, NoRunError

    if not Path(path).exists():
        raise NoRunError(f"`{path}` does not exist")
    runs = read_runs(path)
    if not runs:  # no records: scalars only (or nothing, which LogDir says)
        logs = LogDir(path)
        name = logs.run_name(None)
        return name, logs.load(name, prefix)
    if len(runs) > 1:
        raise NoRunError(f"`{path}` holds {len(runs)} runs ({', '.join(sorted(runs))}): pass one run's directory")
    [(name, per_prefix)] = runs.items()
    if prefix not in per_prefix:
        raise NoRunError(f"`{path}` logged no node statistics under prefix {prefix!r} (it has {sorted(per_prefix)})")
    return name, per_prefix[prefix]


def _run_data(files: List[Path]) -> Dict[str, data.RunData]:
    docs: Dict[str, List[Tuple[int, Dict[str, Any]]]] = {}
    read: Dict[str, Dict[str, List[Datum]]] = {}
    for tag, datum in (item for f in files for item in _tensors(f)):
        if tag.endswith(metadata.TAG):
            docs.setdefault(tag[: -len(metadata.TAG)], []).append((datum.step, metadata.decode(datum.numpy)))
        elif tag.rsplit("/", 1)[0].endswith(metadata.RECORDS):
            prefix = tag.rsplit("/", 1)[0][: -len(metadata.RECORDS)]
            read.setdefault(prefix, {}).setdefault(tag, []).append(datum)
    extra: Dict[str, Any] = {"ratios": {}, "code": {}}
    return {
        prefix: data.from_records(sorted(docs[prefix], key=lambda p: p[0]), read[prefix], extra)
        for prefix in sorted(docs)
        if prefix in read
    }


def _tensors(path: Path) -> Iterator[Tuple[str, Datum]]:
    """``(tag, datum)`` of every ``scales`` tensor summary in one event file."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    for raw in _records(path):
        event = event_pb2.Event.FromString(raw)
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == metadata.PLUGIN_NAME and value.HasField("tensor"):
                yield value.tag, Datum(event.step, tensor_util.make_ndarray(value.tensor))


def _records(path: Path) -> Iterator[bytes]:
    """The data of each complete TFRecord whose bytes name a ``scales`` tag; a record whose
    checksum fails ends the file, as in TensorBoard's reader (a file still being written)."""
    crc = _masked_crc32c()
    with _mapped(path) as buf:
        at, end = 0, len(buf)
        while at + _HEADER.size <= end:
            length, length_crc = _HEADER.unpack_from(buf, at)
            first, last = at + _HEADER.size, at + _HEADER.size + length
            if last + 4 > end or crc(buf[at : at + 8]) != length_crc:
                return
            if any(buf.find(mark, first, last) >= 0 for mark in _MARKS):
                raw = buf[first:last]
                if crc(raw) != struct.unpack_from("<I", buf, last)[0]:
                    return
                yield raw
            at = last + 4


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[Any]:
    """The file's bytes, memory-mapped (``b""`` for an empty file, which mmap refuses)."""
    with open(path, "rb") as f:
        if not os.fstat(f.fileno()).st_size:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            yield buf


def _masked_crc32c() -> Any:
    """TFRecord's masked CRC-32C, on google-crc32c's C code where installed (TensorBoard's own
    pure-Python CRC costs ~0.3 us a byte)."""
    try:
        import google_crc32c
    except ImportError:
        google_crc32c = None
    if google_crc32c is None or google_crc32c.implementation != "c":
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        return masked_crc32c

    def masked(chunk: bytes) -> int:
        x = google_crc32c.value(bytes(chunk))
        return (((x >> 15) | ((x << 17) & 0xFFFFFFFF)) + 0xA282EAD8) & 0xFFFFFFFF

    return masked
