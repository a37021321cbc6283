"""``lightning-scale compare`` on real runs written by ScaleMonitor (a tiny GPT, a few steps)
and read back: an identical rerun, a layer scaled at initialisation, every statistic group,
the readable table, and every kind of bad input as one line and exit status 2."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List

import pytest

from lightning_scale.record.stats.fields import ALL_STATISTICS
from lightning_scale.tools import synthetic
from lightning_scale.tools.cli import main
from tests.compare_runs import SCALED_LAYER, STEPS, fit

pytestmark = pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning")
EVERY = sorted(ALL_STATISTICS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "a": fit(root, "a"),
        "rerun": fit(root, "rerun"),
        "scaled": fit(root, "scaled", scaled=8.0),
        "every": fit(root, "every", statistics=EVERY, steps=1),
        "every_rerun": fit(root, "every_rerun", statistics=EVERY, steps=1),
    }


def compared(capsys: pytest.CaptureFixture[str], *args: Any) -> Dict[str, Any]:
    assert main(["compare", *map(str, args), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_identical_rerun_matches_every_node_without_divergence(
    runs: Dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = compared(capsys, runs["a"], runs["rerun"])
    assert out["a"] == {"run": str(runs["a"]), "step": STEPS - 1} and out["b"]["step"] == STEPS - 1
    assert out["steps"] == {"a": STEPS - 1, "b": STEPS - 1, "how": "the latest step both runs tracked"}
    assert out["matched"] > 80 and out["only_a"] == [] and out["only_b"] == []
    assert out["first_divergence"] is None and out["threshold"] == 0.5
    assert len({r["node"] for r in out["rows"]}) == out["matched"]
    for row in out["rows"]:
        assert row["a"] == row["b"], row  # the same numbers: a CPU rerun is bit-identical
        assert set(row["difference"].values()) <= {0.0}, row


def test_a_layer_scaled_at_initialisation_is_the_first_divergence(
    runs: Dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Weights x8 at initialisation: at step 0 the first divergence is that layer's, +3 octaves
    (its weight; its output about as much); nothing before it in the forward differs at all."""
    out = compared(capsys, runs["a"], runs["scaled"], "--step", "0")
    assert out["steps"] == {"a": 0, "b": 0, "how": "each run's latest tracked step at or before 0"}
    div = out["first_divergence"]
    assert div["node"].startswith(SCALED_LAYER) and div["direction"] == "fwd", div
    assert div["difference"] == pytest.approx(3.0, abs=0.1) and (div["step_a"], div["step_b"]) == (0, 0)
    forward = [r for r in out["rows"] if r["direction"] == "fwd"]
    first = [r["node"] for r in forward].index(div["node"])
    assert all(r["difference"]["log2_std"] == 0.0 for r in forward[:first])
    scaled_output = next(r for r in forward if r["node"] == f"{SCALED_LAYER}/linear")
    assert scaled_output["difference"]["log2_std"] > 2.5


def test_every_statistic_group_is_compared(runs: Dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Every statistic both runs logged is compared (magnitudes in octaves, the rest as logged);
    those only one run logged are named."""
    out = compared(capsys, runs["every"], runs["every_rerun"])
    assert sorted(out["statistics"]["compared"]) == EVERY and out["first_divergence"] is None
    for row in out["rows"]:
        assert set(row["difference"]) == {
            f"log2_{s}" if s in ("std", "absmax", "rms", "min_nonzero") else s for s in EVERY
        }
        for stat in EVERY:  # equal, or not finite in both (an exact cast's SNR is +inf)
            key = f"log2_{stat}" if f"log2_{stat}" in row["difference"] else stat
            assert row["a"][stat] == row["b"][stat] and row["difference"][key] in (0.0, None), (row["node"], stat)
    mixed = compared(capsys, runs["a"], runs["every"], "--step", "0")
    assert mixed["statistics"] == {
        "compared": ["std", "absmax"],
        "only_a": [],
        "only_b": sorted(set(EVERY) - {"std", "absmax"}),
    }


def test_the_table_names_steps_nodes_statistics_and_the_divergence(
    runs: Dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", str(runs["a"]), str(runs["scaled"]), "--steps", "0,0", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"A: {runs['a']} at step 0" and lines[1] == f"B: {runs['scaled']} at step 0 (the given steps)"
    assert lines[2].startswith("nodes: ") and lines[2].endswith(" matched, 0 only in A, 0 only in B")
    assert lines[3] == "statistics compared: std, absmax"
    assert lines[4].startswith("first divergence (|Δ log2 std| > 0.5 octaves") and f"{SCALED_LAYER}" in lines[4]
    assert "forward, +3.00 octaves" in lines[4]
    assert lines[6].startswith("node directions ranked by |Δ log2 std|, largest first: 3 of ")
    header, rows = lines[7].split(), lines[8:]
    assert header[:3] == ["#", "node", "dir"] and len(rows) == 3
    deltas = [float(r.split()[5]) for r in rows]
    assert deltas == sorted(deltas, key=abs, reverse=True) and deltas[0] == 3.0  # the scaled weight, x8
    assert main(["compare", str(runs["a"]), str(runs["every"]), "--step", "0"]) == 0
    text = capsys.readouterr().out
    others = ", ".join(sorted(set(EVERY) - {"std", "absmax"}))
    assert f"statistics compared: std, absmax (only B logged {others})" in text
    assert "first divergence: none (every matched node's |Δ log2 std| <= 0.5 octaves)" in text


def _error(capsys: pytest.CaptureFixture[str], *args: Any) -> str:
    assert main(["compare", *map(str, args)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("lightning-scale compare: error: ")
    return captured.err.strip()[len("lightning-scale compare: error: ") :]


def test_bad_input_is_one_line_and_exit_status_2(
    runs: Dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = runs["a"]
    assert _error(capsys, tmp_path / "missing", a) == f"`{tmp_path / 'missing'}` does not exist"
    (tmp_path / "empty").mkdir()
    assert "holds no run written by ScaleMonitor" in _error(capsys, a, tmp_path / "empty")
    assert _error(capsys, a.parent, a).startswith(f"`{a.parent}` holds 5 runs (a, every, every_rerun, rerun, scaled)")
    synthetic.main(["--nodes", "6", "--steps", "2", "--logdir", str(tmp_path / "other")])
    capsys.readouterr()
    assert _error(capsys, a, tmp_path / "other").startswith("runs A and B have no node in common (A logged ")
    message = _error(capsys, a, runs["scaled"], "--steps", "7,7")
    assert message == (
        "`steps` must name a step each run tracked, got 7,7: run A did not track step 7 (it tracked steps 0, 1, 2); "
        "run B did not track step 7 (it tracked steps 0, 1, 2)"
    )
    assert _error(capsys, a, a, "--step", "-1").startswith("`step` must be at or after each run's first tracked step")
    assert _error(capsys, a, a, "--prefix", "val_").startswith(f"`{a}` logged no node statistics under prefix 'val_'")
    assert _error(capsys, a, a, "--threshold", "0") == "`threshold` must be a positive number of octaves, got 0.0"
    assert _error(capsys, a, a, "--top", "-2").startswith("`--top` must be 0 (every row) or a positive number")


def test_argparse_refuses_malformed_steps_and_both_step_options(runs: Dict[str, Path]) -> None:
    for args in (["--steps", "3"], ["--steps", "a,b"], ["--step", "1", "--steps", "1,1"]):
        with pytest.raises(SystemExit) as exit_:
            main(["compare", str(runs["a"]), str(runs["a"]), *args])
        assert exit_.value.code == 2


def _nodes(rows: List[Dict[str, Any]]) -> List[str]:
    return list(dict.fromkeys(r["node"] for r in rows))


def test_json_is_strict_json_and_rows_follow_execution_order(
    runs: Dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--json`` prints one object that strict JSON parsers take (no NaN or Infinity);
    its rows follow run A's execution order, forward then backward per node."""
    assert main(["compare", str(runs["a"]), str(runs["scaled"]), "--step", "0", "--json"]) == 0
    text = capsys.readouterr().out
    out = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    assert text.count("\n") == 1 and set(out) >= {"matched", "only_a", "only_b", "first_divergence", "rows"}
    nodes = _nodes(out["rows"])
    assert nodes[0] == "model.tok.weight" and nodes.index("model.blocks.0.attn.qkv/linear") < nodes.index(
        f"{SCALED_LAYER}/linear"
    )
    assert all(r["direction"] in ("fwd", "bwd") for r in out["rows"])
    assert not any(isinstance(v, float) and math.isnan(v) for r in out["rows"] for v in r["difference"].values())


def test_the_command_compares_without_importing_torch(runs: Dict[str, Path]) -> None:
    """The whole process of ``lightning-scale compare`` is its import and its work: neither needs
    torch (about 0.9 s of a 2-core CPU to import), Lightning or TorchDynamo."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from lightning_scale.tools.cli import main\n"
        f"assert main(['compare', {str(runs['a'])!r}, {str(runs['scaled'])!r}, '--json']) == 0\n"
        "print(sorted(m for m in ('torch', 'lightning', 'torch._dynamo') if m in sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["first_divergence"] is not None
    assert done.stderr.strip().splitlines()[-1] == "[]"
