"""Several processes: DDP, ddp_spawn and FSDP2 (ModelParallelStrategy) on 2 and 4 CPU
processes over gloo, fx and dynamo capture, against an independent float64 reference of
every rank's tensors; the bytes each rank sends into the callback's collectives at 2, 4
and 8 ranks; and ranks whose captured graphs differ (rank 1's forward has an extra op):
the fit goes on, the shared nodes are logged, or with ``strict_ranks`` it raises.
``pool.pool_step`` itself without Lightning: ``test_pool_gloo.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor


ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "dist_scripts"
SCRIPT = SCRIPTS / "run_dist.py"
REL = 1e-5  # TensorBoard stores scalars as float32
STRATEGIES = ["ddp", "ddp_spawn", "fsdp2"]
ACTIVATIONS = ["model.layers.0.fc/linear", "model.layers.0.act/relu", "model.layers.1.fc/linear"]
PARAMETERS = [f"model.layers.{i}.fc.{p}" for i in (0, 1) for p in ("weight", "bias")]
#: (strategy, callback, world, capture) of every training run, by launch: the fits of a launch
#: run in turn in the same processes (``run_dist.py``), each run without the callback before those
#: with it (the references run in processes where no callback has been), the injected failure
#: last. ``ddp_spawn`` spawns its own processes for each fit; ``strict_ranks`` ends its processes,
#: so it has its own launch.
Key = Tuple[str, str, int, str]
LAUNCHES: List[List[Key]] = [
    [("ddp", "off", 2, "fx"), ("fsdp2", "off", 2, "fx"), ("ddp", "branch_off", 2, "fx")]
    + [("ddp", "on", 2, "fx"), ("fsdp2", "on", 2, "fx"), ("ddp", "branch", 2, "fx")]
    + [("ddp", "on", 2, "dynamo"), ("ddp", "advise", 2, "fx"), ("fsdp2", "advise", 2, "fx"), ("ddp", "fail", 2, "fx")],
    [("ddp_spawn", "off", 2, "fx"), ("ddp_spawn", "on", 2, "fx")],
    [("ddp", "branch_strict", 2, "fx")],
    [("ddp", "on", 4, "fx"), ("fsdp2", "on", 4, "dynamo")],
    [("ddp", "on", 8, "fx")],  # bytes per rank only; started once the others are done (memory)
]
POOLED = [(s, 2, "fx") for s in STRATEGIES] + [("ddp", 2, "dynamo"), ("ddp", 4, "fx"), ("fsdp2", 4, "dynamo")]

Run = Tuple[Path, Path]  # output folders of a run and of the run without the callback


# ---- running the training script --------------------------------------------------------


def _start(out: Path, keys: List[Key], port: int) -> "subprocess.Popen[str]":
    """One launch of ``run_dist.py`` fitting ``keys`` (one world size) in turn."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # distinct ports for runs started together
    env["PYTHONUNBUFFERED"] = "1"  # each rank's lines in the pipe as they are written: a fit's before the next marker
    runs = [f"{strategy}:{callback}:{capture}" for strategy, callback, _, capture in keys]
    cmd = [sys.executable, str(SCRIPT), str(out), str(keys[0][2]), *runs]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _wait(proc: "subprocess.Popen[str]", timeout: float) -> str:
    """The console output of a run that must succeed."""
    out, code = _wait_status(proc, timeout)
    assert code == 0, out[-3000:]
    return out


def _wait_status(proc: "subprocess.Popen[str]", timeout: float) -> Tuple[str, int]:
    """(the launch's console output, its exit status)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own group: the other ranks go too
        out, _ = proc.communicate()
        pytest.fail(f"training script timed out:\n{out[-3000:]}")
    return out, proc.returncode


def _sections(output: str) -> Dict[str, str]:
    """A launch's console output split at rank 0's ``=== run FOLDER ===`` markers."""
    parts = re.split(r"^=== run (\S+) ===$", output, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[Key], Tuple[Path, str, int]]]:
    """key -> (the run's output folder, its console output, its launch's exit status). The
    launches but the last start together (much of a run is process start-up and Lightning's
    launch delay); the 8-rank one when first asked for, after the others. Waits for the one asked."""
    base = tmp_path_factory.mktemp("runs")
    procs: Dict[int, "subprocess.Popen[str]"] = {}
    done: Dict[int, Tuple[str, int]] = {}

    def start(indices: List[int]) -> None:
        for i, port in zip(indices, _free_ports(len(indices))):
            procs[i] = _start(base, LAUNCHES[i], port)

    def get(key: Key) -> Tuple[Path, str, int]:
        i = next(i for i, keys in enumerate(LAUNCHES) if key in keys)
        if i not in procs:  # the last launch
            for earlier in list(procs):
                done.setdefault(earlier, _wait_status(procs[earlier], timeout=300))
            start([i])
        if i not in done:
            done[i] = _wait_status(procs[i], timeout=300)
        output, code = done[i]
        folder = "_".join(map(str, key))
        return base / folder, _sections(output).get(folder, output) if len(LAUNCHES[i]) > 1 else output, code

    start(list(range(len(LAUNCHES) - 1)))
    yield get
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.fixture(scope="module")
def trained(launched: Callable[[Key], Tuple[Path, str, int]]) -> Callable[..., Run]:
    def finish(key: Key) -> Path:
        out, output, code = launched(key)
        assert code == 0, output[-3000:]
        (out / "output.txt").write_text(output)
        return out

    def get(strategy: str, mode: str = "on", world: int = 2, capture: str = "fx") -> Run:
        """(this run's output folder, the 2-rank run without the callback)."""
        return finish((strategy, mode, world, capture)), finish((strategy if world == 2 else "ddp", "off", 2, "fx"))

    return get


def _scalars(out: Path) -> Dict[str, float]:
    acc = EventAccumulator(str(out / "logs" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    events = {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}
    assert all([e.step for e in ev] == [0] for ev in events.values()), "only step 0 is tracked"
    return {tag: ev[0].value for tag, ev in events.items()}


# ---- the independent reference ----------------------------------------------------------


def _reference(
    out: Path, world: int = 2, branch: bool = False
) -> Dict[str, Tuple[List[Tensor], List[Optional[Tensor]]]]:
    """label -> (each rank's value, each rank's gradient), in float64 from the saved initial
    parameters and each rank's batch, written out without the library or the model class
    (``branch``: rank 1 applies a tanh between the layers)."""
    init = torch.load(out / "init.pt")
    ref: Dict[str, Tuple[List[Tensor], List[Optional[Tensor]]]] = {}
    for rank in range(world):
        x, y = (t.double() for t in torch.load(out / f"batch_rank{rank}.pt"))
        w = {k: v.double().requires_grad_() for k, v in init.items()}
        h = F.linear(x, w["layers.0.fc.weight"], w["layers.0.fc.bias"])
        a = h.relu()
        o = F.linear(a.tanh() if branch and rank == 1 else a, w["layers.1.fc.weight"], w["layers.1.fc.bias"])
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


def _user(*tensors: Tensor) -> Dict[str, float]:
    """The user statistics (``user_statistics.py``) of the concatenated tensors."""
    a = torch.cat([t.flatten() for t in tensors]).abs()
    return {"mean_abs": float(a.mean()), "peak_sq": float(a.max()) ** 2}


def _expected(ref: Dict[str, Tuple[List[Tensor], List[Optional[Tensor]]]]) -> Dict[str, float]:
    """Pooled std and user statistics per tag: every rank's tensors concatenated; a parameter's
    value is one tensor (each rank holds it whole), its gradients are each rank's local one."""
    out: Dict[str, float] = {}
    for label, (values, grads) in ref.items():
        own = values[:1] if label in PARAMETERS else values
        out[f"scale/fwd/{label}"] = _std(*own)
        out.update({f"{k}/fwd/{label}": v for k, v in _user(*own).items()})
        if grads[0] is not None:
            out[f"scale/bwd/{label}"] = _std(*grads)  # type: ignore[misc]
            out.update({f"{k}/bwd/{label}": v for k, v in _user(*grads).items()})  # type: ignore[misc]
    return out


# ---- training runs ---------------------------------------------------------------------


@pytest.mark.parametrize("strategy, world, capture", POOLED)
def test_pooled_scales_equal_the_reference_of_every_ranks_tensors(
    strategy: str, world: int, capture: str, trained: Callable[..., Run]
) -> None:
    on, _ = trained(strategy, "on", world, capture)
    logged = _scalars(on)
    ref = _reference(on, world)
    expected = _expected(ref)
    assert not torch.equal(ref["x"][0][0], ref["x"][0][1]), "each rank gets its own batch"
    for label in ACTIVATIONS + PARAMETERS:  # (dynamo names the input differently: `x` may be absent)
        assert f"scale/fwd/{label}" in logged and f"scale/bwd/{label}" in logged, label
    for tag, value in expected.items():
        if tag in logged or not tag.endswith("/x"):
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


@pytest.mark.parametrize("world", [2, 4])
def test_rank_spread_is_min_and_max_of_each_ranks_std(world: int, trained: Callable[..., Run]) -> None:
    on, _ = trained("ddp", "on", world)
    logged, ref = _scalars(on), _reference(on, world)
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


def _gemm_sums(out: Path, world: int = 2) -> Tensor:
    """The advisor's what-if sums at step 0, each layer's row summed over the ranks: every rank's
    GEMMs recorded again from the saved initial parameters and its batch, one process, no pool."""
    from lightning_scale.record.gemm_recorder import GemmRecorder

    init, total = torch.load(out / "init.pt"), None
    for rank in range(world):
        x, y = torch.load(out / f"batch_rank{rank}.pt")
        w = [init[f"layers.{i}.fc.weight"].clone().requires_grad_() for i in (0, 1)]
        gemms = GemmRecorder({id(t): i for i, t in enumerate(w)}, 2)
        h = F.linear(x, w[0], init["layers.0.fc.bias"])
        gemms.observe(h, x, w[0], "linear")
        o = F.linear(h.relu(), w[1], init["layers.1.fc.bias"])
        gemms.observe(o, h.relu(), w[1], "linear")
        F.mse_loss(o, y).backward()  # this rank's own loss, as its backward sees it
        assert gemms.sums is not None and gemms.error is None
        total = gemms.sums if total is None else total + gemms.sums
    assert total is not None
    return total


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_the_advisors_gemms_pool_every_ranks_and_training_is_unchanged(
    strategy: str, trained: Callable[..., Run]
) -> None:
    """``advise=True`` in a 2-rank fit: both linear layers' three GEMMs under every recipe, the
    sum of what each rank's own GEMMs give (FSDP2's unsharded weights found too), the same
    parameters as the fit without the callback."""
    from tensorboard.context import RequestContext

    from lightning_scale.dashboard import advice_log
    from lightning_scale.dashboard.logdir import LogDir

    on, off = trained(strategy, "advise")
    logs = LogDir(on / "logs")
    run = advice_log.read(logs.provider, RequestContext(), "", logs.run_name(None))
    assert run is not None and run.steps == [0]
    assert run.names == ["model.layers.0.fc", "model.layers.1.fc"]
    assert [layer["how"] for layer in run.layers] == ["linear", "linear"]
    expected = _gemm_sums(on).numpy()
    assert (expected[..., 0] > 0).all(), "every GEMM of every layer seen"
    assert run.sums[0] == pytest.approx(expected, rel=1e-12, abs=1e-300)
    with_cb, without = torch.load(on / "params.pt"), torch.load(off / "params.pt")
    assert all(torch.equal(with_cb[k], without[k]) for k in without)


def test_a_failure_on_one_rank_skips_the_step_on_every_rank(trained: Callable[..., Run]) -> None:
    """Rank 1's statistics raise: every rank skips the step instead of rank 0 waiting."""
    failed, off = trained("ddp", "fail")
    assert not [tag for tag in _scalars(failed) if tag.startswith("scale")]
    output = (failed / "output.txt").read_text()
    assert re.search(r"ScaleMonitor: statistics failed on rank\(s\) \[1\] at step 0; nothing logged for it", output), (
        output[-3000:]
    )
    with_failure, without = torch.load(failed / "params.pt"), torch.load(off / "params.pt")
    assert all(torch.equal(with_failure[k], without[k]) for k in without)


def test_fsdp2_records_ops_inside_each_unit(trained: Callable[..., Run]) -> None:
    on, _ = trained("fsdp2")
    logged, ref = _scalars(on), _reference(on)
    for label in ACTIVATIONS + PARAMETERS:  # inside the units, not only their outputs
        assert f"scale/fwd/{label}" in logged and f"scale/bwd/{label}" in logged, label
    units = {
        "model.layers.0/block": ACTIVATIONS[1],
        "model.layers.1/block": ACTIVATIONS[2],
        "model/mlp": ACTIVATIONS[2],
    }
    for unit_output, inner in units.items():  # outputs of units named by the user's class
        for d in ("fwd", "bwd"):
            assert logged[f"scale/{d}/{unit_output}"] == pytest.approx(logged[f"scale/{d}/{inner}"], rel=REL)
    # the outputs of the modules inside a unit are tagged under their paths, as without FSDP
    inside = {
        "model.layers.0.fc": ACTIVATIONS[0],
        "model.layers.0.act": ACTIVATIONS[1],
        "model.layers.1.fc": ACTIVATIONS[2],
    }
    for module_output, op in inside.items():
        for d in ("fwd", "bwd"):
            assert logged[f"scale/{d}/{module_output}"] == logged[f"scale/{d}/{op}"], (module_output, d)
    for label in PARAMETERS:  # the full parameter, not a shard: std of the whole tensor
        full = ref[label][0][0]
        assert logged[f"scale/fwd/{label}"] == pytest.approx(float(full.std()), rel=REL)
        shard = full.flatten()[: full.numel() // 2]
        assert logged[f"scale/fwd/{label}"] != pytest.approx(float(shard.std()), rel=1e-3)


# ---- bytes per rank ---------------------------------------------------------------------


def _collectives(out: Path, world: int) -> List[List[Any]]:
    """Each rank's calls to ``torch.distributed`` collectives from the package's code."""
    return [json.loads((out / f"collectives_rank{r}.json").read_text()) for r in range(world)]


def test_bytes_per_rank_per_tracked_step_do_not_grow_with_the_world(trained: Callable[..., Run]) -> None:
    """The same model at 2, 4 and 8 ranks: every rank sends the same tensors into the same
    four collectives (no all_gather), whatever the world size."""
    calls = {world: _collectives(trained("ddp", "on", world)[0], world) for world in (2, 4, 8)}
    for world, ranks in calls.items():
        assert all(r == ranks[0] for r in ranks), f"ranks differ at world {world}"
        steps = {c[3] for c in ranks[0]}
        assert len(steps) == 1, "collectives only on the tracked step"
        assert [(name, op) for name, op, _, _ in ranks[0]] == [
            ("all_reduce", "MAX"),
            ("all_reduce", "MAX"),
            ("all_reduce", "SUM"),
            ("reduce", "SUM"),
        ]
    assert calls[2][0] == calls[4][0] == calls[8][0]
    assert calls[2][0][0][2] == 64  # the header


# ---- ranks whose captured graphs differ --------------------------------------------------

BRANCH = ["branch", "branch_off", "branch_strict"]


@pytest.fixture(scope="module")
def branched(launched: Callable[[Key], Tuple[Path, str, int]]) -> Dict[str, Tuple[Path, str, int]]:
    """mode -> (output folder, output, exit code) of the 2-rank DDP runs where rank 1's
    forward has an extra tanh (``run_dist.py``): with the callback, without it, and with
    ``strict_ranks=True``."""
    return {mode: launched(("ddp", mode, 2, "fx")) for mode in BRANCH}


def _scalars_by_step(out: Path) -> Dict[str, Dict[int, float]]:
    acc = EventAccumulator(str(out / "logs" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_ranks_whose_graphs_differ_pool_the_nodes_they_share_and_train_on(
    branched: Dict[str, Tuple[Path, str, int]],
) -> None:
    """Rank 1's forward has an extra tanh: the fit finishes, trains as without the callback,
    logs every shared node (the pooled std of both ranks' tensors, float64 reference) and
    not the tanh, and warns once, naming it."""
    (on, output, code), (off, off_output, off_code) = branched["branch"], branched["branch_off"]
    assert code == 0, output[-3000:]
    assert off_code == 0, off_output[-3000:]
    with_cb, without = torch.load(on / "params.pt"), torch.load(off / "params.pt")
    assert with_cb.keys() == without.keys()
    assert all(torch.equal(with_cb[name], without[name]) for name in without)
    logged = _scalars_by_step(on)
    expected = _expected(_reference(on, branch=True))
    for label in ACTIVATIONS + PARAMETERS:
        for tag in (f"scale/fwd/{label}", f"scale/bwd/{label}"):
            assert sorted(logged[tag]) == [0, 1], tag  # both tracked steps
            assert logged[tag][0] == pytest.approx(expected[tag], rel=REL), tag
    assert [tag for tag in logged if "tanh" in tag] == []  # rank 1's own node: not logged
    warnings = re.findall(r"ScaleMonitor: step \d+: ranks captured different graphs[^\n]*", output)
    assert len(warnings) == 1, warnings
    assert re.search(r"a rank has 1 node\(s\) rank 0 has not \(`[^`]*tanh[^`]*`\)", warnings[0]), warnings[0]
    assert "RankMismatchError" not in output


def test_with_strict_ranks_different_graphs_raise_on_every_rank(branched: Dict[str, Tuple[Path, str, int]]) -> None:
    _, output, code = branched["branch_strict"]
    assert code != 0
    assert re.search(
        r"RankMismatchError: Ranks captured different graphs \(node counts \d+ to \d+, "
        r"the fingerprints of the labels differ\)",
        output,
    ), output[-3000:]


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
