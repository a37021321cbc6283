"""The comparison of two runs (``dashboard.compare``, ``compare_tables``) on runs built with
known values: closed-form differences, step alignment, the first divergence's order, every
bad input's message; and ``event_reader`` against TensorBoard's own reader on a real run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import numpy as np
import pytest
from _dashboard_logs import write_logs

from lightning_scale.dashboard import compare_tables, event_reader
from lightning_scale.dashboard.compare import THRESHOLD, align, compare
from lightning_scale.dashboard.data import RunData
from lightning_scale.dashboard.logdir import LogDir, NoRunError

LABELS = ["x", "l1.weight", "l1/linear", "l2/relu", "head/linear"]


def run(
    steps: Sequence[int] = (0, 10, 20),
    labels: Sequence[str] = LABELS,
    std: float = 1.0,
    stats: Optional[Dict[str, float]] = None,
    parameters: Sequence[str] = ("l1.weight",),
) -> RunData:
    """Every node direction at every step: ``std`` and each of ``stats`` at its value."""
    stats = stats or {}
    names = ["std", *stats]
    values = np.empty((len(steps), len(labels), 2, len(names)))
    values[..., 0] = std
    for k, v in enumerate(stats.values(), 1):
        values[..., k] = v
    return RunData(list(labels), set(parameters), list(steps), names, values)


def test_identical_runs_match_every_node_with_zero_differences() -> None:
    a = run(stats={"absmax": 4.0, "zeros": 0.25})
    cmp = compare(a, run(stats={"absmax": 4.0, "zeros": 0.25}))
    assert cmp.labels == LABELS and cmp.only_a == cmp.only_b == []
    assert cmp.stats == ["std", "absmax", "zeros"] and cmp.first_divergence is None
    assert (cmp.step_a, cmp.step_b, cmp.how) == (20, 20, "the latest step both runs tracked")
    assert np.all(cmp.difference == 0.0)
    rows = cmp.rows()
    assert len(rows) == 2 * len(LABELS)
    assert rows[0] == {
        "node": "x",
        "direction": "fwd",
        "a": {"std": 1.0, "absmax": 4.0, "zeros": 0.25},
        "b": {"std": 1.0, "absmax": 4.0, "zeros": 0.25},
        "difference": {"log2_std": 0.0, "log2_absmax": 0.0, "zeros": 0.0},
    }


def test_magnitudes_differ_in_octaves_and_fractions_as_logged() -> None:
    """B's std 8x A's: +3 octaves; absmax 1/4: -2 octaves; a fraction 0.1 -> 0.35: +0.25."""
    a = run(std=0.5, stats={"absmax": 2.0, "zeros": 0.1})
    b = run(std=4.0, stats={"absmax": 0.5, "zeros": 0.35})
    cmp = compare(a, b)
    assert cmp.diff("std") == pytest.approx(np.full((5, 2), 3.0))
    assert cmp.diff("absmax") == pytest.approx(np.full((5, 2), -2.0))
    assert cmp.diff("zeros") == pytest.approx(np.full((5, 2), 0.25))
    assert cmp.rows()[3]["difference"] == pytest.approx({"log2_std": 3.0, "log2_absmax": -2.0, "zeros": 0.25})


def test_nodes_and_statistics_of_one_run_only_are_named_not_compared() -> None:
    a = run(labels=["x", "shared/add", "a_only/mul"], stats={"kurtosis": 3.0})
    b = run(labels=["b_only/view", "x", "shared/add"], stats={"absmax": 1.0})
    cmp = compare(a, b)
    assert cmp.labels == ["x", "shared/add"]  # A's execution order
    assert (cmp.only_a, cmp.only_b) == (["a_only/mul"], ["b_only/view"])
    assert (cmp.stats, cmp.only_a_stats, cmp.only_b_stats) == (["std"], ["kurtosis"], ["absmax"])
    assert cmp.summary()["statistics"] == {"compared": ["std"], "only_a": ["kurtosis"], "only_b": ["absmax"]}


def _with_std(base: RunData, changes: Dict[tuple, float]) -> RunData:
    """``base`` with std set at ``(label, direction index)`` for every step."""
    values = base.values.copy()
    for (label, d), v in changes.items():
        values[:, base.labels.index(label), d, 0] = v
    return RunData(base.labels, base.parameters, base.steps, base.stats, values)


def test_first_divergence_is_the_first_forward_in_execution_order_then_the_last_backward() -> None:
    """A change in a layer moves its own forward and every earlier gradient: the first forward
    past the threshold wins over any backward; without one, the backward nearest the loss."""
    a = run()
    b = _with_std(a, {("l2/relu", 0): 2.0, ("head/linear", 0): 2.0, ("x", 1): 4.0, ("l1/linear", 1): 4.0})
    div = compare(a, b).first_divergence
    assert div is not None and (div.node, div.direction, div.difference) == ("l2/relu", "fwd", 1.0)
    assert (div.step_a, div.step_b, div.a, div.b) == (20, 20, 1.0, 2.0)
    backward_only = _with_std(a, {("x", 1): 4.0, ("l1/linear", 1): 0.25})
    div = compare(a, backward_only).first_divergence
    assert div is not None and (div.node, div.direction, div.difference) == ("l1/linear", "bwd", -2.0)


def test_the_threshold_is_strict_and_a_zero_std_in_one_run_only_diverges() -> None:
    a = run()
    at_threshold = _with_std(a, {("l1/linear", 0): 2.0})  # exactly one octave
    assert compare(a, at_threshold, threshold=1.0).first_divergence is None
    assert compare(a, at_threshold, threshold=0.99).first_divergence.node == "l1/linear"  # type: ignore[union-attr]
    assert THRESHOLD < 1.0 and compare(a, at_threshold).first_divergence.node == "l1/linear"  # type: ignore[union-attr]
    zero = _with_std(a, {("head/linear", 1): 0.0})
    div = compare(a, zero).first_divergence
    assert div is not None and (div.node, div.direction, div.difference, div.b) == ("head/linear", "bwd", -math.inf, 0)
    assert compare(a, zero).summary()["first_divergence"]["difference"] is None  # JSON has no -inf
    both_zero = _with_std(a, {("head/linear", 1): 0.0})
    assert compare(zero, both_zero).diff("std")[4, 1] == 0.0 and compare(zero, both_zero).first_divergence is None


def test_a_node_direction_logged_in_one_run_only_is_no_divergence() -> None:
    a = run()
    missing = _with_std(a, {("l1/linear", 1): math.nan})
    cmp = compare(a, missing)
    assert cmp.first_divergence is None and math.isnan(cmp.diff("std")[2, 1])
    row = [r for r in cmp.rows() if r["node"] == "l1/linear" and r["direction"] == "bwd"][0]
    assert row["b"] == {"std": None} and row["difference"] == {"log2_std": None}


def test_steps_align_by_default_on_the_latest_in_common_else_as_asked() -> None:
    a, b = run(steps=[0, 10, 20, 30]), run(steps=[0, 10, 20, 25])
    assert align(a, b) == (20, 20, "the latest step both runs tracked")
    assert align(a, b, step=27) == (20, 25, "each run's latest tracked step at or before 27")
    assert align(a, b, steps=(30, 25)) == (30, 25, "the given steps")
    cmp = compare(a, b, step=29)
    assert (cmp.step_a, cmp.step_b) == (20, 25)


def test_steps_that_cannot_be_aligned_are_one_clear_error_each() -> None:
    a, b = run(steps=[0, 10]), run(steps=[5, 15])
    with pytest.raises(ValueError, match=r"runs A and B tracked no step in common \(A: steps 0, 10; B: steps 5, 15\)"):
        align(a, b)
    with pytest.raises(ValueError, match=r"`steps` must name a step each run tracked, got 7,7: run A did not track "):
        align(a, b, steps=(7, 7))
    with pytest.raises(ValueError, match=r"run B did not track step 7 \(it tracked steps 5, 15\)"):
        align(a, b, steps=(7, 7))
    with pytest.raises(ValueError, match=r"`step` must be at or after each run's first tracked step, got 3: run B "):
        align(a, b, step=3)
    with pytest.raises(ValueError, match=r"give `step` or `steps`, not both"):
        align(a, b, step=10, steps=(10, 15))
    many = run(steps=list(range(0, 100, 10)))
    with pytest.raises(ValueError, match=r"A: 10 steps, 0..90; B: steps 5, 15"):
        align(many, b, names=("A", "B"))


def test_runs_without_a_common_node_or_with_a_bad_threshold_are_refused() -> None:
    with pytest.raises(ValueError, match=r"runs base and other have no node in common \(base logged 5 nodes"):
        compare(run(), run(labels=["other/add"]), names=("base", "other"))
    for bad in (0, -1.0, math.nan, True, "1"):
        with pytest.raises(ValueError, match=r"`threshold` must be a positive number of octaves, got "):
            compare(run(), run(), threshold=bad)  # type: ignore[arg-type]


def test_the_compare_views_tables_rank_and_mark_the_divergence() -> None:
    a = run(std=1.0)
    b = _with_std(a, {("l1/linear", 0): 8.0, ("l2/relu", 0): 2.0, ("head/linear", 1): 0.5})
    body = compare_tables.profile(a, b, None, names=("ra", "rb"))
    assert (body["run"], body["other"], body["step_a"], body["step_b"], body["steps"]) == (
        "ra",
        "rb",
        20,
        20,
        [0, 10, 20],
    )
    assert body["log2"] and body["matched"] == 5 and body["total"] == 10
    node = next(n for n in body["nodes"] if n["label"] == "l1/linear")
    assert node["fwd"] == [0.0, 3.0, 3.0] and node["diverges"] == [True, False]
    assert [(r["label"], r["dir"], r["difference"]) for r in body["ranked"][:3]] == [
        ("l1/linear", "fwd", 3.0),
        ("l2/relu", "fwd", 1.0),
        ("head/linear", "bwd", -1.0),
    ]
    assert [r["first"] for r in body["ranked"][:3]] == [True, False, False]
    assert body["first_divergence"]["node"] == "l1/linear"
    with pytest.raises(
        ValueError, match=r"`stat` must be one of the statistics both runs logged \['std'\], got 'zeros'"
    ):
        compare_tables.profile(a, b, None, "zeros")


def test_the_difference_heatmap_and_series_cover_the_steps_both_tracked() -> None:
    a = run(steps=[0, 10, 20])
    b = run(steps=[10, 20, 30], std=2.0)
    heat = compare_tables.heatmap(a, b)
    assert heat["steps"] == [10, 20] and heat["stat"] == "Δ log2 std" and heat["diverging"]
    assert heat["fwd"] == [[1.0, 1.0]] * 5 and heat["limit"] == 1.0
    series = compare_tables.series(a, b, "l2/relu")
    assert series["series"]["Δ log2 std/bwd"] == [1.0, 1.0]
    assert series["series"]["A log2 std/fwd"] == [0.0, 0.0] and series["series"]["B log2 std/fwd"] == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"tracked no step in common: the difference over steps needs steps both"):
        compare_tables.heatmap(a, run(steps=[5]))
    apart = compare_tables.profile(a, run(steps=[5, 15], std=2.0), None)  # no common step: A's latest, B's before it
    assert (apart["step_a"], apart["step_b"], apart["steps"]) == (20, 15, [0, 10, 20])


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_logs(tmp_path_factory.mktemp("logs"))


def _same(fast: RunData, slow: RunData) -> None:
    assert fast.labels == slow.labels and fast.steps == slow.steps and fast.stats == slow.stats
    assert fast.parameters == slow.parameters and fast.aliases == slow.aliases
    np.testing.assert_array_equal(fast.values, slow.values)


def test_the_event_reader_reads_what_tensorboards_reader_reads(real_run: Path) -> None:
    """Both prefixes of a real run (training, validation), from the run's directory and from
    the log directory above it, value for value (NaN where either has none)."""
    logs = LogDir(real_run)
    runs = event_reader.read_runs(real_run.parent)
    assert list(runs) == [real_run.name] and sorted(runs[real_run.name]) == ["", "val_"]
    for prefix in ("", "val_"):
        _same(runs[real_run.name][prefix], logs.load(None, prefix))
        name, one = event_reader.read_run(real_run, prefix)
        assert name == "."
        _same(one, logs.load(None, prefix))
    assert runs[real_run.name][""].ratios == {} and runs[real_run.name][""].code == {}  # records only


def test_read_run_wants_exactly_one_run(real_run: Path, tmp_path: Path) -> None:
    with pytest.raises(NoRunError, match=r"does not exist"):
        event_reader.read_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoRunError, match=r"holds no run written by ScaleMonitor"):
        event_reader.read_run(tmp_path / "empty")
    with pytest.raises(NoRunError, match=r"logged no node statistics under prefix 'test_' \(it has \['', 'val_'\]\)"):
        event_reader.read_run(real_run, "test_")
    two = tmp_path / "two"
    for name in ("a", "b"):
        (two / name).mkdir(parents=True)
        for f in real_run.iterdir():
            (two / name / f.name).write_bytes(f.read_bytes())
    with pytest.raises(NoRunError, match=r"holds 2 runs \(a, b\): pass one run's directory"):
        event_reader.read_run(two)


def test_a_truncated_or_corrupt_event_file_ends_where_tensorboard_stops(real_run: Path, tmp_path: Path) -> None:
    """A file cut inside its last step's records (still being written) reads the steps before;
    so does one whose last records fail their checksum."""
    [events] = [f for f in real_run.iterdir() if f.name.endswith(".scales")]
    raw = events.read_bytes()
    found = [m.start() for m in re.finditer(rb"scale_records/", raw) if raw[m.start() - 4 : m.start()] != b"val_"]
    last = found[-1]  # inside the last tracked training step's records
    whole = event_reader.read_runs(real_run)["."][""]
    cut = tmp_path / "cut"
    cut.mkdir()
    for damaged in (raw[: last + 40], raw[: last + 40] + bytes([raw[last + 40] ^ 0xFF]) + raw[last + 41 :]):
        (cut / events.name).write_bytes(damaged)
        partial = event_reader.read_runs(cut)["."][""]
        assert partial.steps == whole.steps[:-1]
        np.testing.assert_array_equal(partial.values, whole.values[:-1])


def test_the_plugins_compare_routes_answer_json_and_one_message_for_a_bad_run(tmp_path: Path) -> None:
    """The routes on a real data provider over two synthetic runs (the same records: no
    difference), and a run B that is not there, or has nothing under the prefix."""
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from werkzeug.test import Client

    from lightning_scale.dashboard.plugin import ScalesPlugin
    from lightning_scale.tools import synthetic

    for name in ("a", "b"):
        synthetic.main(["--nodes", "12", "--steps", "3", "--logdir", str(tmp_path / name)])
    mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    mux.AddRunsFromDirectory(str(tmp_path))
    mux.Reload()
    context = base_plugin.TBContext(data_provider=data_provider.MultiplexerDataProvider(mux, str(tmp_path)))
    apps = ScalesPlugin(context).get_plugin_apps()

    def get(route: str, status: int = 200, **params: str) -> Dict[str, Any]:
        response = Client(apps[route]).get(route, query_string=params)
        assert response.status_code == status, response.get_data(as_text=True)
        return json.loads(response.get_data(as_text=True))

    body = get("/compare", run="a", other="b", step="60")
    assert (body["matched"], body["step_a"], body["step_b"], body["first_divergence"]) == (12, 50, 50, None)
    assert {n["label"] for n in body["nodes"]} == set(synthetic.labels_of(12))
    assert all(n["fwd"][2] == 0.0 and n["bwd"][2] == 0.0 for n in body["nodes"])
    heat = get("/compare_heatmap", run="a", other="b", stat="absmax")
    assert heat["steps"] == [0, 50, 100] and heat["stat"] == "Δ log2 absmax" and heat["fwd"][0] == [0.0] * 3
    series = get("/compare_series", run="a", other="b", label=synthetic.labels_of(12)[3])
    assert series["series"]["Δ log2 std/bwd"] == [0.0] * 3
    assert get("/compare", 400, run="a", other="nope")["error"] == (
        "`other` must name a run with node statistics under prefix '' to compare with (runs: ['a', 'b']), got 'nope'"
    )
    assert get("/compare", 400, run="a", other="b", prefix="val_")["error"].startswith(
        "`other` must name a run with node statistics under prefix 'val_' to compare with (runs: []"
    )
    assert get("/compare", 400, run="a", other="b", stat="zeros")["error"].startswith("`stat` must be one of the")
