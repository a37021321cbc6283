"""report: annotated code whose numbers are the interpreter's, and tables that round-trip."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from typing import Dict, List, Tuple

import pytest
import torch
from torch import Tensor, fx, nn
from unit_scaling import utils as reference

from lightning_scale.tools import analyse as report
from lightning_scale.record import stats
from lightning_scale.capture import DeepTracer, capture
from lightning_scale.capture.interpreter import ScalePair, ScaleTrackingInterpreter
from lightning_scale.record.recorder import Recorder, recording

ANNOTATION = re.compile(r"^\s*(\w+) = .*;  \(-> ([-\d.e+]+|n/a), <- ([-\d.e+]+|n/a)\)$")


def annotations(code: str) -> Dict[str, Tuple[str, str]]:
    found = {}
    for line in code.splitlines():
        m = ANNOTATION.match(line)
        if m:
            found[m.group(1)] = (m.group(2), m.group(3))
    return found


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def inputs() -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 8, generator=g).requires_grad_(), torch.randn(32, 4, generator=g)


def test_annotations_are_the_interpreters_scales() -> None:
    torch.manual_seed(0)
    m = model()
    x, grad = inputs()
    code = report.analyse_module(m, x, grad)
    found = annotations(code)

    gm = fx.GraphModule(m, DeepTracer().trace(m))
    interp = ScaleTrackingInterpreter(gm)
    interp.run(x.detach().clone().requires_grad_()).backward(grad)
    scales = interp.scales
    recorded = [n for n in scales if n != "output"]
    assert list(found) == recorded  # every recorded node is annotated, in order
    for name, (fwd, bwd) in found.items():
        assert f"(-> {fwd}, <- {bwd})" == str(scales[name]), name
    assert '_1 = getattr(self, "1")(linear);  (-> ' in code  # BatchNorm1d stays a leaf


def test_annotations_match_eager_values_and_the_reference() -> None:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, grad = inputs()
    found = annotations(report.analyse_module(m, x, grad))
    xe = x.detach().clone().requires_grad_()
    hidden = m[0](xe)
    hidden.retain_grad()
    m(xe).backward(grad)  # recompute for the gradient of the first layer's output
    out = m[2](torch.relu(hidden))
    fwd, bwd = found["linear"]
    assert float(fwd) == pytest.approx(float(hidden.detach().std()), rel=5e-3)  # 3 digits
    assert float(found["linear_1"][0]) == pytest.approx(float(out.detach().std()), rel=5e-3)
    assert float(found["input_1"][1]) == pytest.approx(float(xe.grad.std()), rel=5e-3)

    theirs = annotations(reference.analyse_module(m, x.detach().clone().requires_grad_(), grad, syntax_highlight=False))
    assert list(theirs) == list(found)
    for name, (fwd, bwd) in found.items():
        assert float(fwd) == pytest.approx(float(theirs[name][0]), rel=1e-2)
        assert float(bwd) == pytest.approx(float(theirs[name][1]), rel=1e-2)


def test_analyse_module_without_recursion_and_with_a_scalar_loss() -> None:
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x, _ = inputs()
    code = report.analyse_module(m, x, torch.ones(32, 8), recurse_modules=False)
    assert "torch._C._nn.linear" not in code
    found = annotations(code)
    assert list(found) == ["input_1", "_0", "_1"]
    assert float(found["_1"][0]) == pytest.approx(float(m(x).detach().std()), rel=5e-3)

    class Loss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x).pow(2).mean()

    found = annotations(report.analyse_module(Loss(), x))  # plain .backward() on a scalar
    assert found["mean"] == ("0.0", "0.0")


def test_syntax_highlighting_colours_the_same_text() -> None:
    pytest.importorskip("pygments")
    m = nn.Linear(4, 4)
    x = torch.randn(8, 4, requires_grad=True)
    grad = torch.randn(8, 4)
    plain = report.analyse_module(m, x, grad)
    coloured = report.analyse_module(m, x, grad, syntax_highlight=True)
    assert "\x1b[" in coloured
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured).strip() == plain


def test_annotate_code() -> None:
    code = (
        'torch.fx._symbolic_trace.wrap("f")\n\n'
        "def forward(self, x):\n    y = x * 2;  x = None\n    z = f(y)\n    return z\n"
    )
    scales = {"y": ScalePair(1.0, 0.5), "x": ScalePair(2.0, None)}
    assert (
        report.annotate_code(code, scales)
        == "def forward(self, x):  (-> 2.0, <- n/a)\n    y = x * 2;  (-> 1.0, <- 0.5)\n    z = f(y)\n    return z"
    )


def test_annotate_code_with_labels_aligns_scales_and_flags_out_of_range() -> None:
    code = (
        "def forward(self, x):\n    linear = torch._C._nn.linear(x, w, b);  x = None\n"
        "    mul = linear * 1e-9\n    big = mul * 1e15\n    return big\n"
    )
    scales = {
        "x": ScalePair(1.0, None),
        "linear": ScalePair(0.5, 2.0**-15),
        "mul": ScalePair(5e-10, 1.0),
        "big": ScalePair(7e4, 1.0),
    }
    labels = {"x": "x", "linear": "net.0/linear", "mul": "net/mul", "big": "net/mul_1"}
    lines = report.annotate_code(code, scales, labels=labels).splitlines()
    sources = [
        "def forward(self, x):",
        "    linear = torch._C._nn.linear(x, w, b)",
        "    mul = linear",
        "    big = mul",
        "    return big",
    ]
    assert len({line.index(src) for line, src in zip(lines, sources)}) == 1  # the code starts in one column
    by_label = {label: line for line in lines for label in labels.values() if f" {label} " in line}
    assert (
        by_label["net.0/linear"].startswith("(-> 0.5, <- 3.05e-05)") and "!<" in by_label["net.0/linear"]
    )  # 2^-15 < 2^-14
    assert "!<" in by_label["net/mul"] and "!>" in by_label["net/mul_1"] and "!" not in by_label["x"]
    assert (
        "!" not in report.annotate_code(code, scales, labels=labels, flag="bf16").split("net/mul_1")[1].split("\n")[0]
    )
    with pytest.raises(ValueError, match="`flag` must be one of"):
        report.annotate_code(code, scales, labels=labels, flag="fp8")


# ---------------------------------------------------------------------------------------
# Tables


def tracked_records(groups: Tuple[str, ...]) -> Tuple[List[str], Tensor]:
    torch.manual_seed(3)
    m = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 2))
    cap = capture(m, "fx")
    rec = Recorder(groups=groups)
    with recording(rec):
        out = cap.tracked()(torch.randn(5, 6))  # the input needs no gradient
    out.sum().backward()
    records = rec.records(cap.node_labels, cap.aliases).cpu()
    rec.clear()
    return cap.node_labels, records


def test_records_table_has_a_row_per_node_and_direction_seen() -> None:
    keys, records = tracked_records(("moments", "range", "formats"))
    rows = report.records_table(keys, records)
    assert [(r["node"], r["direction"]) for r in rows if r["node"] == "input"] == [("input", "forward")]
    assert len(rows) == int((records[..., 0] > 0).sum())
    assert set(rows[0]) == {"node", "direction", *stats.STATISTICS}
    for row in rows:
        d = 0 if row["direction"] == "forward" else 1
        rec = records[keys.index(row["node"]), d]
        for name in stats.STATISTICS:
            want = float(stats.statistic(rec, name))
            assert row[name] == want or (math.isnan(want) and math.isnan(row[name])), (row["node"], name)
    some = report.records_table(keys, records, names=("std", "absmax"))
    assert set(some[0]) == {"node", "direction", "std", "absmax"}


def same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("groups", [("moments",), ("moments", "range", "formats")])
def test_csv_round_trips(groups: Tuple[str, ...]) -> None:
    rows = report.records_table(*tracked_records(groups))
    back = list(csv.DictReader(io.StringIO(report.table_to_csv(rows))))
    assert len(back) == len(rows)
    for row, got in zip(rows, back):
        assert list(got) == list(row)
        for k, v in row.items():
            parsed = got[k] if isinstance(v, str) else float(got[k])
            assert same(parsed, v), (row["node"], k, got[k], v)


@pytest.mark.parametrize("groups", [("moments",), ("moments", "range", "formats")])
def test_json_round_trips_with_non_finite_values_as_null(groups: Tuple[str, ...]) -> None:
    rows = report.records_table(*tracked_records(groups))
    back = json.loads(report.table_to_json(rows))
    nonfinite = 0
    for row, got in zip(rows, back, strict=True):
        assert list(got) == list(row)
        for k, v in row.items():
            if isinstance(v, float) and not math.isfinite(v):
                assert got[k] is None
                nonfinite += 1
            else:
                assert got[k] == v, (row["node"], k)
    if groups == ("moments",):
        assert nonfinite > 0  # absmax was not computed: NaN, written as null


def test_empty_tables() -> None:
    assert report.table_to_csv([]) == ""
    assert json.loads(report.table_to_json([])) == []
    assert report.records_table(["a"], torch.zeros(1, 2, len(stats.FIELDS), dtype=torch.float64)) == []
