"""The writer's vectorised scalars, summary counts and worst-nodes table against the
per-value definitions (``dashboard.headroom``) and protobuf's own encoding."""

import math
from pathlib import Path

import pytest
import torch
from tensorboard.compat.proto.summary_pb2 import Summary

from lightning_scale.record import stats
from lightning_scale.dashboard import headroom
from lightning_scale.report.event_file import SUFFIX, EventFile, masked_crc32c
from lightning_scale.report.scalars import DIRECTIONS, scalar_metrics, summary_bytes, summary_metrics
from lightning_scale.report.tables import worst_table
from lightning_scale.report.values import StepValues


def _records() -> torch.Tensor:
    """Nodes with spreads from 2^-30 to 2^20 both ways, one absent gradient, one zero tensor."""
    torch.manual_seed(0)
    rows = []
    for i in range(12):
        for d in range(2):
            x = torch.randn(300, dtype=torch.float64) * 2.0 ** (-30 + 5 * i - 3 * d)
            rows.append(stats.record_of(x * 0 if i == 4 else x, ("moments", "range", "formats")))
    rec = stats.assemble(rows).view(12, 2, -1)
    rec[7, 1] = 0.0  # count 0: the gradient never arrived
    return rec


def test_scalar_metrics_match_the_statistics_one_by_one() -> None:
    rec, labels = _records(), [f"n{i}" for i in range(12)]
    out = scalar_metrics(labels, StepValues(rec), ["std", "absmax", "zeros"], log2=True)
    expected = {}
    for name in ("std", "absmax", "zeros", "scale_log2"):
        for i, label in enumerate(labels):
            for tag, d in DIRECTIONS:
                if rec[i, d, 0] == 0:
                    continue
                value = stats.summarise(rec[i, d], ["std" if name == "scale_log2" else name])
                v = next(iter(value.values()))
                if name == "scale_log2":
                    v = headroom.log2(v)
                    if math.isnan(v):
                        continue
                expected[f"{'scale' if name == 'std' else name}/{tag}/{label}"] = v
    assert list(out) == list(expected)  # same tags, same order
    for tag, v in expected.items():
        assert math.isclose(out[tag], v, rel_tol=1e-12), tag
    assert "scale_log2/fwd/n4" not in out  # std 0: no log2


def test_summary_counts_and_worst_table_follow_headroom() -> None:
    rec, labels = _records(), [f"n{i}" for i in range(12)]
    out = summary_metrics(StepValues(rec))
    rows = []
    for tag, d in DIRECTIONS:
        present = [i for i in range(12) if rec[i, d, 0] > 0]
        std = [float(stats.statistic(rec[i, d], "std")) for i in present]
        absmax = [float(rec[i, d, stats.FIELDS.index("absmax")]) for i in present]
        for key, count in headroom.below_normal_counts(std, absmax).items():
            assert out[f"scale_summary/{tag}/{key}"] == count, key
        rows += [
            {"label": labels[i], "dir": tag, **headroom.headroom(s, a, "fp16")} for i, s, a in zip(present, std, absmax)
        ]
    assert out["scale_summary/bwd/below_normal_fp16"] > 0 and out["scale_summary/fwd/above_max_fp16"] > 0
    table = worst_table(labels, StepValues(rec), k=5).splitlines()[4:]
    ranked = headroom.rank(rows, "headroom")[:5]
    assert [(r.split("|")[2].strip(" `"), r.split("|")[3].strip()) for r in table] == [
        (r["label"], r["dir"]) for r in ranked
    ]


def test_summary_bytes_are_protobufs_encoding() -> None:
    tags = ["scale/fwd/a", "x" * 300 + "/\u00e9", "t"]
    values = [1.5, 1e300, math.nan]
    ours = summary_bytes(tags, values)
    reference = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in zip(tags, values)])
    assert ours == reference.SerializeToString()
    assert Summary.FromString(ours).value[1].simple_value == math.inf


def test_our_event_files_checksums_are_tensorboards_and_leave_its_writer_alone(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader as EventFileLoader
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
    from tensorboard.summary.writer import record_writer

    torch.manual_seed(0)
    for n in (0, 1, 12, 1000):
        data = bytes(torch.randint(0, 256, (n,), dtype=torch.uint8).tolist())
        assert masked_crc32c(data) == pywrap_tensorflow.masked_crc32c(data)
    file = EventFile(str(tmp_path), warn=pytest.fail)
    file.add_summary(summary_bytes(["scale/fwd/a", "scale/bwd/a"], [0.25, 2.0**-20]), step=3)
    file.close()
    assert file.path is not None and file.path.endswith(SUFFIX) and "tfevents" in Path(file.path).name
    events = list(EventFileLoader(file.path).Load())  # TensorBoard's reader checks every record's CRC
    assert events[0].file_version == "brain.Event:2" and events[1].step == 3
    assert [(v.tag, v.simple_value) for v in events[1].summary.value] == [
        ("scale/fwd/a", 0.25),
        ("scale/bwd/a", 2.0**-20),
    ]
    raw = bytearray(Path(file.path).read_bytes())
    raw[-3] ^= 1  # one flipped bit in the last record's data CRC: TensorBoard's reader drops that record
    Path(file.path).write_bytes(bytes(raw))
    assert len(list(EventFileLoader(file.path).Load())) == 1
    assert record_writer.masked_crc32c is pywrap_tensorflow.masked_crc32c  # nothing of TensorBoard's is replaced
