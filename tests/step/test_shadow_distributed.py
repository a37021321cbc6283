"""The shadow pass on 2 CPU processes over gloo, under DDP, FSDP2 and tensor parallelism
(``tests/dist_scripts/run_shadow.py``): training with ``ScaleMonitor(shadow="always")`` is
bit-identical to training without the callback; the shadow logs exactly what tracking in
place logs (an eager model: the same tensors); both ranks call the same collectives in the
same order; and the shadow's backward triggers no gradient reduction: DDP all-reduces as many
gradient buckets, FSDP2 reduce-scatters as often, as without the callback."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.report.test_distributed import _free_ports

pytestmark = pytest.mark.timeout(900)
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "run_shadow.py"
STRATEGIES = ("ddp", "fsdp2", "tp")
RUNS = ("off", "always", "never")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """The output folder of each strategy's fits (started together; each launch runs its three
    fits in turn in the same rank processes)."""
    base = tmp_path_factory.mktemp("shadow")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    procs: Dict[str, "subprocess.Popen[str]"] = {}
    for strategy, port in zip(STRATEGIES, _free_ports(len(STRATEGIES))):
        procs[strategy] = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(base / strategy), strategy, *RUNS],
            cwd=ROOT,
            env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    done: Dict[str, str] = {}

    def get(strategy: str) -> Path:
        if strategy not in done:
            proc = procs[strategy]
            try:
                done[strategy], _ = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"{strategy} ranks hung")
            assert proc.returncode == 0, done[strategy][-3000:]
            assert "Traceback" not in done[strategy], done[strategy][-3000:]
        return base / strategy

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def calls(folder: Path, rank: int) -> List[Any]:
    return json.loads((folder / f"calls_rank{rank}.json").read_text())


def logged(folder: Path) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(folder / "logs" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: {e.step: e.value for e in acc.Scalars(t)} for t in acc.Tags()["scalars"] if t.startswith("scale/")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_shadow_trains_bit_identically_and_logs_what_in_place_tracking_logs(
    runs: Callable[[str], Path], strategy: str
) -> None:
    base = runs(strategy)
    off, shadowed = torch.load(base / "off" / "params.pt"), torch.load(base / "always" / "params.pt")
    assert list(off) == list(shadowed) and off
    for name in off:
        assert torch.equal(off[name], shadowed[name]), name
    assert json.loads((base / "always" / "shadowed.json").read_text()) == [True]
    got, want = logged(base / "always"), logged(base / "never")
    assert "scale/bwd/model.fc2" in got and "scale/fwd/model.head/linear" in got
    assert got == want and all(set(v) == {0, 2} for v in got.values())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_call_the_same_collectives_and_the_shadow_reduces_no_gradient(
    runs: Callable[[str], Path], strategy: str
) -> None:
    base = runs(strategy)
    for run in RUNS:
        assert calls(base / run, 0) == calls(base / run, 1), run
    plain = collections.Counter(name for name, _ in calls(base / "off", 0))
    shadowed = collections.Counter(name for name, _ in calls(base / "always", 0))
    if strategy == "ddp":
        assert plain["ddp_bucket"] == shadowed["ddp_bucket"] == 4  # one bucket a step, the shadow's none
    if strategy == "fsdp2":
        assert plain["reduce_scatter_single"] == shadowed["reduce_scatter_single"] > 0
        assert shadowed["all_gather_single"] > plain["all_gather_single"]  # (the shadow gathers the parameters again)
