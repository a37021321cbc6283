"""FSDP2 with compiled blocks (``fully_shard(block)``, then ``torch.compile(block)``) on 2 CPU
processes over gloo: training is bit-identical with and without the callback, every block is
seen inside under the uncompiled model's labels (no ``_orig_mod``), and the pooled values
equal test_distributed.py's independent float64 reference of every rank's tensors.

The blocks compile with AOTAutograd's eager backend here (``RUN_DIST_BACKEND=aot_eager``):
the route is the same as under Inductor (the user's backend compiles the instrumented
graphs), without minutes of C++ compiles on two ranks; Inductor's rows are checked in
tests/record/test_traceable.py and tests/test_compiled_training.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterator

import pytest
import torch

from test_distributed import ACTIVATIONS, PARAMETERS, REL, SCRIPT, _expected, _free_ports, _reference, _scalars, _wait

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Path]]:
    """The callback on and off, started together."""
    import subprocess
    import sys

    base = tmp_path_factory.mktemp("fsdp_compiled")
    procs = {}
    for mode, port in zip(("on", "off"), _free_ports(2)):
        out = base / mode
        out.mkdir()
        root = str(SCRIPT.parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RUN_DIST_BACKEND="aot_eager")
        cmd = [sys.executable, str(SCRIPT), str(out), "fsdp2_compiled", mode, "2", "auto"]
        procs[mode] = subprocess.Popen(
            cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    outputs = {mode: _wait(proc, timeout=600) for mode, proc in procs.items()}
    (base / "on" / "output.txt").write_text(outputs["on"])
    yield {mode: base / mode for mode in procs}


def test_training_is_bit_identical_with_and_without_the_callback(runs: Dict[str, Path]) -> None:
    on, off = torch.load(runs["on"] / "params.pt"), torch.load(runs["off"] / "params.pt")
    assert list(on) == list(off) and on
    for name in on:
        assert torch.equal(on[name], off[name]), name
    output = (runs["on"] / "output.txt").read_text()
    assert "compiled modules: model.layers.0, model.layers.1" in output
    assert "ScaleMonitor: " in output and "training continues untracked" not in output


def test_blocks_are_seen_inside_under_the_uncompiled_labels(runs: Dict[str, Path]) -> None:
    logged = _scalars(runs["on"])
    assert not [t for t in logged if "_orig_mod" in t]
    for label in ACTIVATIONS + PARAMETERS + ["model.layers.0.fc", "model.layers.1"]:
        assert f"scale/fwd/{label}" in logged and f"scale/bwd/{label}" in logged, label


def test_pooled_values_equal_the_float64_reference_of_every_ranks_tensors(runs: Dict[str, Path]) -> None:
    """Activations pooled over both ranks; parameters (each rank holds them whole in the
    compiled graph, unsharded by FSDP's hooks) counted once; gradients each rank's own."""
    logged = _scalars(runs["on"])
    for tag, value in _expected(_reference(runs["on"])).items():
        if tag in logged or not tag.endswith("/x"):
            assert logged[tag] == pytest.approx(value, rel=REL), tag
