"""Several processes: DDP, ddp_spawn and FSDP2 (ModelParallelStrategy) on 2 CPU processes
over gloo, against an independent float64 reference of both ranks' tensors; and
``distributed.pool`` itself in 2 gloo processes: exact merge, replicated tensors, label
mismatches and failures raised on every rank without a hang."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor

from lightning_scale.report import pool as distributed
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "dist_scripts" / "run_dist.py"
REL = 1e-5  # TensorBoard stores scalars as float32
STRATEGIES = ["ddp", "ddp_spawn", "fsdp2"]
ACTIVATIONS = ["model.layers.0.fc/linear", "model.layers.0.act/relu", "model.layers.1.fc/linear"]
PARAMETERS = [f"model.layers.{i}.fc.{p}" for i in (0, 1) for p in ("weight", "bias")]

Run = Tuple[Path, Path]  # output folders of a run and of the run without the callback


# ---- running the training script --------------------------------------------------------


def _start(out: Path, strategy: str, callback: str, port: int) -> "subprocess.Popen[str]":
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # distinct ports for runs started together
    cmd = [sys.executable, str(SCRIPT), str(out), strategy, callback]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait(proc: "subprocess.Popen[str]", timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own group: rank 1 goes too
        out, _ = proc.communicate()
        pytest.fail(f"training script timed out:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Run]]:
    """Trains every strategy with and without the callback, all runs at once (much of
    a run is process start-up and Lightning's launch delay); waits for the one asked."""
    base = tmp_path_factory.mktemp("runs")
    modes = [(s, cb) for s in STRATEGIES for cb in ("on", "off")] + [("ddp", "fail")]
    ports = _free_ports(len(modes))
    procs = {(s, cb): _start(base / s / cb, s, cb, port) for (s, cb), port in zip(modes, ports)}
    finished: Dict[Tuple[str, str], Path] = {}

    def get(strategy: str, mode: str = "on") -> Run:
        """(this mode's output folder, the run without the callback)."""
        for cb in (mode, "off"):
            if (strategy, cb) not in finished:
                output = _wait(procs[strategy, cb], timeout=240)
                (base / strategy / cb / "output.txt").write_text(output)
                finished[strategy, cb] = base / strategy / cb
        return finished[strategy, mode], finished[strategy, "off"]

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _scalars(out: Path) -> Dict[str, float]:
    acc = EventAccumulator(str(out / "logs" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    events = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
    assert all([e.step for e in ev] == [0] for ev in events.values()), "only step 0 is tracked"
    return {tag: ev[0].value for tag, ev in events.items()}


# ---- the independent reference ----------------------------------------------------------


def _reference(out: Path) -> Dict[str, Tuple[List[Tensor], List[Optional[Tensor]]]]:
    """label -> (each rank's value, each rank's gradient), in float64 from the saved initial
    parameters and each rank's batch, written out without the library or the model class."""
    init = torch.load(out / "init.pt")
    ref: Dict[str, Tuple[List[Tensor], List[Optional[Tensor]]]] = {}
    for rank in (0, 1):
        x, y = (t.double() for t in torch.load(out / f"batch_rank{rank}.pt"))
        w = {k: v.double().requires_grad_() for k, v in init.items()}
        h = F.linear(x, w["layers.0.fc.weight"], w["layers.0.fc.bias"])
        a = h.relu()
        o = F.linear(a, w["layers.1.fc.weight"], w["layers.1.fc.bias"])
        for t in (h, a, o):
            t.retain_grad()
        F.mse_loss(o, y).backward()  # this rank's own loss: what its backward sees
        nodes = {"x": (x, None), ACTIVATIONS[0]: (h, h.grad), ACTIVATIONS[1]: (a, a.grad), ACTIVATIONS[2]: (o, o.grad)}
        nodes.update({f"model.{k}": (p, p.grad) for k, p in w.items()})
        for label, (value, grad) in nodes.items():
            ref.setdefault(label, ([], []))
            ref[label][0].append(value.detach())
            ref[label][1].append(grad)
    return ref


def _std(*tensors: Tensor) -> float:
    return float(torch.cat([t.flatten() for t in tensors]).std())


def _expected(ref: Dict[str, Tuple[List[Tensor], List[Optional[Tensor]]]]) -> Dict[str, float]:
    """Pooled std per tag: every rank's tensors concatenated; a parameter's value is one
    tensor (each rank holds it whole), its gradients are each rank's local one."""
    out: Dict[str, float] = {}
    for label, (values, grads) in ref.items():
        out[f"scale/fwd/{label}"] = _std(values[0]) if label in PARAMETERS else _std(*values)
        if grads[0] is not None:
            out[f"scale/bwd/{label}"] = _std(*grads)  # type: ignore[misc]
    return out


# ---- training runs ---------------------------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pooled_scales_equal_the_two_rank_reference(strategy: str, trained: Callable[..., Run]) -> None:
    on, _ = trained(strategy)
    logged = _scalars(on)
    ref = _reference(on)
    expected = _expected(ref)
    assert not torch.equal(ref["x"][0][0], ref["x"][0][1]), "each rank gets its own batch"
    for tag, value in expected.items():
        assert logged[tag] == pytest.approx(value, rel=REL), tag
    for label in ACTIVATIONS:  # pooling matters: rank zero alone is measurably different
        for d, tensors in (("fwd", ref[label][0]), ("bwd", ref[label][1])):
            assert logged[f"scale/{d}/{label}"] != pytest.approx(_std(tensors[0]), rel=1e-3), label


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parameter_hooks_see_each_ranks_local_gradient(strategy: str, trained: Callable[..., Run]) -> None:
    """DDP averages parameter gradients after the hook: the hook sees the local gradient."""
    on, _ = trained(strategy)
    logged, ref = _scalars(on), _reference(on)
    for label in PARAMETERS:
        local = ref[label][1]
        averaged = (local[0] + local[1]) / 2  # type: ignore[operator]
        assert logged[f"scale/bwd/{label}"] == pytest.approx(_std(*local), rel=REL)  # type: ignore[arg-type]
        assert logged[f"scale/bwd/{label}"] != pytest.approx(_std(averaged), rel=1e-2)


def test_rank_spread_is_min_and_max_of_each_ranks_std(trained: Callable[..., Run]) -> None:
    on, _ = trained("ddp")
    logged, ref = _scalars(on), _reference(on)
    for label in ACTIVATIONS + PARAMETERS:
        for d, tensors in (("fwd", ref[label][0]), ("bwd", ref[label][1])):
            per_rank = [_std(t) for t in tensors]  # type: ignore[arg-type]
            assert logged[f"scale_rank_min/{d}/{label}"] == pytest.approx(min(per_rank), rel=REL)
            assert logged[f"scale_rank_max/{d}/{label}"] == pytest.approx(max(per_rank), rel=REL)
    assert logged["scale_rank_min/fwd/x"] < logged["scale_rank_max/fwd/x"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_is_identical_with_and_without_the_callback(strategy: str, trained: Callable[..., Run]) -> None:
    on, off = trained(strategy)
    with_cb, without, init = (torch.load(p) for p in (on / "params.pt", off / "params.pt", on / "init.pt"))
    assert with_cb.keys() == without.keys() == init.keys()
    for name in init:
        assert with_cb[name].shape == init[name].shape, "full, not sharded, parameters"
        assert torch.equal(with_cb[name], without[name]), name
        assert not torch.equal(with_cb[name], init[name]), f"{name} did not train"


def test_a_failure_on_one_rank_skips_the_step_on_every_rank(trained: Callable[..., Run]) -> None:
    """Rank 1's statistics raise: every rank skips the step instead of rank 0 waiting."""
    failed, off = trained("ddp", "fail")
    assert not [tag for tag in _scalars(failed) if tag.startswith("scale")]
    output = (failed / "output.txt").read_text()
    assert re.search(r"ScaleMonitor: statistics failed on rank\(s\) \[1\] at step 0; nothing logged for it", output), output[-3000:]
    with_failure, without = torch.load(failed / "params.pt"), torch.load(off / "params.pt")
    assert all(torch.equal(with_failure[k], without[k]) for k in without)


def test_fsdp2_records_ops_inside_each_unit(trained: Callable[..., Run]) -> None:
    on, _ = trained("fsdp2")
    logged, ref = _scalars(on), _reference(on)
    for label in ACTIVATIONS + PARAMETERS:  # inside the units, not only their outputs
        assert f"scale/fwd/{label}" in logged and f"scale/bwd/{label}" in logged, label
    units = {"model.layers.0/block": ACTIVATIONS[1], "model.layers.1/block": ACTIVATIONS[2], "model/mlp": ACTIVATIONS[2]}
    for unit_output, inner in units.items():  # outputs of units named by the user's class
        for d in ("fwd", "bwd"):
            assert logged[f"scale/{d}/{unit_output}"] == pytest.approx(logged[f"scale/{d}/{inner}"], rel=REL)
    for label in PARAMETERS:  # the full parameter, not a shard: std of the whole tensor
        full = ref[label][0][0]
        assert logged[f"scale/fwd/{label}"] == pytest.approx(float(full.std()), rel=REL)
        shard = full.flatten()[: full.numel() // 2]
        assert logged[f"scale/fwd/{label}"] != pytest.approx(float(shard.std()), rel=1e-3)


# ---- pool in 2 gloo processes -----------------------------------------------------------

GROUPS = ("moments", "range", "formats")


def _records(fwd: List[Tensor], bwd: List[Tensor]) -> Tensor:
    rows = [stats.record_of(t, GROUPS) for pair in zip(fwd, bwd) for t in pair]
    return stats.assemble(rows).view(len(fwd), 2, len(stats.FIELDS))


def _histograms(fwd: List[Tensor], bwd: List[Tensor]) -> Tensor:
    return torch.stack([torch.stack([stats.log2_histogram(f), stats.log2_histogram(b)]) for f, b in zip(fwd, bwd)])


def _outcome(fn: Callable[[], Tuple[Tensor, Tensor]]) -> object:
    try:
        return fn()
    except (distributed.RankMismatchError, distributed.RankFailedError) as err:
        return err


def _pool_worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    gen = torch.Generator().manual_seed(rank)
    fwd = [torch.randn(5 + 3 * rank, generator=gen) * (1 + rank), torch.randn(4, 3, generator=gen) + rank]
    bwd = [torch.randn(5 + 3 * rank, generator=gen), torch.randn(4, 3, generator=gen) * 3]
    weight = torch.randn(6, generator=torch.Generator().manual_seed(7))  # the same on both ranks
    fwd.append(weight)
    bwd.append(torch.randn(6, generator=gen))
    labels = ["a", "b", "w"]
    records = _records(fwd, bwd)
    result = {
        "fwd": fwd,
        "bwd": bwd,
        "records": records,
        "agree": _outcome(lambda: distributed.pool(records, labels, replicated={"w"})),
        "names": _outcome(lambda: distributed.pool(records, ["a", "b", f"w{rank}"])),
        "count": _outcome(lambda: distributed.pool(records[: 3 - rank], labels[: 3 - rank], rows=3)),
        "failed": _outcome(lambda: distributed.pool(records, labels, failed=rank == 1)),
        "after": _outcome(lambda: distributed.pool(records, labels)),
        "hist": distributed.pool_step(records, labels, replicated={"w"}, histograms=_histograms(fwd, bwd), histogram_labels=labels),
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _free_ports(n: int) -> List[int]:
    """``n`` distinct ports free right now (all held open until each has been chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def pooled(tmp_path_factory: pytest.TempPathFactory) -> List[dict]:
    out = tmp_path_factory.mktemp("pool")
    ctx = mp.start_processes(_pool_worker, args=(_free_ports(1)[0], str(out)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("pool workers hung")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def test_pool_is_the_exact_merge_of_every_ranks_records(pooled: List[dict]) -> None:
    for rank in (0, 1):
        result, per_rank = pooled[rank]["agree"]
        torch.testing.assert_close(per_rank, torch.stack([pooled[0]["records"], pooled[1]["records"]]), rtol=0, atol=0, equal_nan=True)
        merged = stats.merge(pooled[0]["records"], pooled[1]["records"])
        torch.testing.assert_close(result[:2], merged[:2], rtol=0, atol=0, equal_nan=True)
        for i, label in enumerate("ab"):  # and it is the record of both ranks' tensors together
            for d, key in ((FORWARD, "fwd"), (BACKWARD, "bwd")):
                both = torch.cat([pooled[r][key][i].flatten().double() for r in (0, 1)])
                assert float(stats.statistic(result[i, d], "std")) == pytest.approx(float(both.std()), rel=1e-6), label


def test_pool_takes_a_replicated_tensors_forward_record_once(pooled: List[dict]) -> None:
    result, _ = pooled[0]["agree"]
    weight = pooled[0]["fwd"][2]
    torch.testing.assert_close(result[2, FORWARD], pooled[0]["records"][2, FORWARD], rtol=0, atol=0, equal_nan=True)
    assert float(stats.statistic(result[2, FORWARD], "std")) == pytest.approx(float(weight.double().std()), rel=1e-6)
    both_grads = torch.cat([pooled[r]["bwd"][2].double() for r in (0, 1)])  # gradients differ: merged
    assert float(stats.statistic(result[2, BACKWARD], "std")) == pytest.approx(float(both_grads.std()), rel=1e-6)


@pytest.mark.parametrize("case", ["names", "count"])
def test_pool_raises_rank_mismatch_on_every_rank(pooled: List[dict], case: str) -> None:
    for rank in (0, 1):
        err = pooled[rank][case]
        assert isinstance(err, distributed.RankMismatchError), err
        with pytest.raises(distributed.RankMismatchError, match=r"Ranks captured different graphs \(node count, label fingerprint per rank"):
            raise err


def test_pool_raises_a_ranks_failure_on_every_rank_and_recovers(pooled: List[dict]) -> None:
    for rank in (0, 1):
        with pytest.raises(distributed.RankFailedError, match=r"statistics failed on rank\(s\) \[1\]"):
            raise pooled[rank]["failed"]  # type: ignore[misc]
        after, _ = pooled[rank]["after"]
        assert after.shape == pooled[rank]["records"].shape


def test_pool_sums_value_histograms_over_ranks_in_the_same_collective(pooled: List[dict]) -> None:
    for rank in (0, 1):
        out = pooled[rank]["hist"]
        torch.testing.assert_close(out.records, pooled[rank]["agree"][0], rtol=0, atol=0, equal_nan=True)
        for i in range(2):  # the histogram of both ranks' values together
            for d, key in ((FORWARD, "fwd"), (BACKWARD, "bwd")):
                both = torch.cat([pooled[r][key][i].flatten() for r in (0, 1)])
                assert torch.equal(out.histograms[i, d], stats.log2_histogram(both)), (i, key)
        weight = pooled[0]["fwd"][2]  # replicated: counted once; its gradients differ: summed
        assert torch.equal(out.histograms[2, FORWARD], stats.log2_histogram(weight))
        both_grads = torch.cat([pooled[r]["bwd"][2] for r in (0, 1)])
        assert torch.equal(out.histograms[2, BACKWARD], stats.log2_histogram(both_grads))
        assert out.histograms[0, FORWARD].sum() == 5 + 8  # every value of both ranks counted


def test_pool_in_one_process() -> None:
    records = _records([torch.randn(4), torch.randn(3)], [torch.randn(4), torch.randn(3)])
    result, per_rank = distributed.pool(records, ["a", "b"], replicated={"a"})
    torch.testing.assert_close(result, records, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(per_rank, records.unsqueeze(0), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(ValueError, match=r"`rows` \(1\) must be at least the number of records \(2\)"):
        distributed.pool(records, ["a", "b"], rows=1)
    with pytest.raises(distributed.RankFailedError, match=r"statistics failed on rank\(s\) \[0\]"):
        distributed.pool(records, ["a", "b"], failed=True)
