"""Tensor parallelism (DTensor TP through ``ModelParallelStrategy``) on 2 CPU processes over
gloo: every logged node's statistics (std, absmax, count, format counts, forward and
backward) are those of the full logical tensor (``use_local_output`` True for the MLP,
False for the causal attention model; FSDP2 x TP on 4 processes; sequence parallelism with
``loss_parallel``; dynamo graph breaks after the column- and the row-parallel layer),
checked against a single-process float64 reference of the unsharded model with the same
weights and batch, written out without the library or the model class; training is
bit-identical with and without the callback (both fits in the same rank processes); the
run warns of nothing, and a node whose placement a graph break hides is left out and
named. The training script is ``tests/dist_scripts/run_tp.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor

from tests.report.test_distributed import _free_ports

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "run_tp.py"
REL = 1e-5  # TensorBoard stores scalars as float32
AMBIGUOUS = 1e-6  # |x| at most this fraction of the tensor's absmax: zero up to float32 rounding
HEADS, TP = 4, 2
#: statistic -> its tag prefix; the format counts are fractions of the count
STATISTICS = {"std": "scale", "absmax": "absmax", "count": "count", "zeros": "zeros"}
BOUNDS = {"underflow_e4m3": 2.0**-9, "below_normal_e4m3": 2.0**-6, "underflow_e5m2": 2.0**-16}
Key = Tuple[str, str, int]  # (model, callback, data-parallel size)
#: the fits of each launch (by data-parallel size), in turn in the same rank processes:
#: (model, callback, ``use_local_output``); the attention model gets DTensor outputs and
#: takes them to local tensors itself (``to_local``)
LAUNCHES = {
    1: [
        *[("mlp", "on", 1), ("mlp", "off", 1), ("attn", "on", 0), ("attn", "off", 0), ("sp", "on", 1)],
        *[("brk", "on", 1), ("tail", "on", 1)],  # (dynamo graph breaks after fc1, after fc2)
    ],
    2: [("mlp", "on", 1), ("mlp", "off", 1), ("blocks", "on", 1), ("blocks", "off", 1)],
}
Nodes = Dict[str, Tuple[Tensor, Tensor]]  # label -> (value, gradient), float64


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Tuple[Path, str]]]:
    """(output folder, rank 0's console output) of each fit of ``LAUNCHES``, by (model,
    callback, data-parallel size): one launch per mesh, both started together (a launch is
    mostly start-up and compiling; its fits share the processes)."""
    base = tmp_path_factory.mktemp("tp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    procs: Dict[int, "subprocess.Popen[str]"] = {}
    for dp, port in zip(LAUNCHES, _free_ports(len(LAUNCHES))):
        runs = [f"{model}:{mode}:{local}" for model, mode, local in LAUNCHES[dp]]
        procs[dp] = subprocess.Popen(
            [sys.executable, str(SCRIPT), str(base / f"dp{dp}"), str(dp), str(TP), *runs],
            cwd=ROOT,
            env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    outputs: Dict[int, str] = {}

    def get(model: str, mode: str = "on", dp: int = 1) -> Tuple[Path, str]:
        if dp not in outputs:
            proc = procs[dp]
            try:
                outputs[dp], _ = proc.communicate(timeout=400)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"the dp={dp} launch timed out: {proc.communicate()[0][-3000:]}")
            assert proc.returncode == 0, outputs[dp][-3000:]
        fits = re.split(r"^=== run (\S+) ===$", outputs[dp], flags=re.M)
        console = dict(zip(fits[1::2], fits[2::2]))[f"{model}_{mode}"]
        return base / f"dp{dp}" / f"{model}_{mode}", console

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _scalars(out: Path) -> Dict[str, float]:
    acc = EventAccumulator(str(out / "logs" / "version_0"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag)[0].value for tag in acc.Tags()["scalars"]}


# ---- the float64 reference of the unsharded model ---------------------------------------


def _mlp(w: Dict[str, Tensor], idx: Tensor) -> Dict[str, Tensor]:
    x = F.embedding(idx, w["emb.weight"])
    h1 = F.linear(x, w["fc1.weight"], w["fc1.bias"])
    a = F.gelu(h1)
    h2 = F.linear(a, w["fc2.weight"], w["fc2.bias"])
    o = F.linear(h2, w["head.weight"], w["head.bias"])
    return {"emb": x, "fc1": h1, "act": a, "fc2": h2, "head": o}


def _attention(w: Dict[str, Tensor], idx: Tensor) -> Dict[str, Tensor]:
    x = F.embedding(idx, w["emb.weight"])
    b, t, d = x.shape
    qkv = {n: F.linear(x, w[f"{n}.weight"], w.get(f"{n}.bias")) for n in "qkv"}
    q, k, v = (a.view(b, t, HEADS, d // HEADS).transpose(1, 2) for a in qkv.values())  # (B, nh, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = F.linear(y.transpose(1, 2).reshape(b, t, d), w["out.weight"], w["out.bias"])
    o = F.linear(out, w["head.weight"], w["head.bias"])
    return {"emb": x, **qkv, "sdpa": y, "out": out, "head": o}


def _sequence_parallel(w: Dict[str, Tensor], idx: Tensor) -> Dict[str, Tensor]:
    x = F.embedding(idx, w["emb.weight"])
    norm = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"])
    h1 = F.linear(norm, w["fc1.weight"], w["fc1.bias"])
    a = F.gelu(h1)
    h2 = F.linear(a, w["fc2.weight"], w["fc2.bias"])
    norm2 = F.layer_norm(h2, h2.shape[-1:], w["norm2.weight"], w["norm2.bias"])
    o = F.linear(norm2, w["head.weight"], w["head.bias"])
    return {"emb": x, "norm": norm, "fc1": h1, "act": a, "fc2": h2, "norm2": norm2, "head": o}


def _blocks(w: Dict[str, Tensor], idx: Tensor) -> Dict[str, Tensor]:
    """The residual blocks model; ``path/x`` and ``path/input``: the input of a frame dynamo
    compiles for the module (its caller ran eagerly: FSDP2 units break the graph in a loop)."""
    h = F.embedding(idx, w["emb.weight"])
    out: Dict[str, Tensor] = {"emb": h}
    for i in range(2):
        b = f"blocks.{i}"
        out[f"{b}/x"] = h
        h1 = F.linear(h, w[f"{b}.fc1.weight"], w[f"{b}.fc1.bias"])
        a = F.gelu(h1)
        h2 = F.linear(a, w[f"{b}.fc2.weight"], w[f"{b}.fc2.bias"])
        h = h + h2
        out.update({f"{b}.fc1": h1, f"{b}.act": a, f"{b}.fc2": h2, b: h})
    norm = F.layer_norm(h, h.shape[-1:], w["norm.weight"], w["norm.bias"])
    o = F.linear(norm, w["head.weight"], w["head.bias"])
    return {**out, "norm/input": h, "norm": norm, "head/input": norm, "head": o}


MODELS = {"mlp": _mlp, "brk": _mlp, "tail": _mlp, "attn": _attention, "sp": _sequence_parallel, "blocks": _blocks}
#: SequenceParallel norms' parameter gradients: Partial in the hook (summed by the optimizer step)
PARTIAL_GRADS = [f"model.{n}.{p}" for n in ("norm", "norm2") for p in ("weight", "bias")]


def _reference(out: Path, model: str, dp: int = 1) -> Nodes:
    """Label -> (value, gradient) of every module output, op and parameter, in float64:
    each data-parallel rank's tensors concatenated (its own batch, its own loss), a
    parameter's value once (every replica holds it), its gradients each replica's own."""
    init = torch.load(out / "init.pt")
    runs: List[Dict[str, Tuple[Tensor, Tensor]]] = []
    for rank in range(0, dp * TP, TP):  # (ranks are data-parallel major: rank = dp_index * TP + tp_index)
        idx, y = torch.load(out / f"batch_rank{rank}.pt")
        w = {k: v.double().requires_grad_() for k, v in init.items()}
        acts = MODELS[model](w, idx)
        for a in {id(a): a for a in acts.values()}.values():
            a.retain_grad()
        F.cross_entropy(acts["head"].flatten(0, 1), y.flatten()).backward()
        runs.append({**{n: (a.detach(), a.grad) for n, a in acts.items()}, **{k: (p, p.grad) for k, p in w.items()}})
    ops = {"emb": "embedding", "act": "gelu", "norm": "layer_norm", "norm2": "layer_norm"}
    nodes: Nodes = {}
    for name in runs[0]:
        value = runs[0][name][0].detach() if name in init else torch.cat([r[name][0] for r in runs])
        pair = (value, torch.cat([r[name][1] for r in runs]))
        op = "add" if re.fullmatch(r"blocks\.\d+", name) else ops.get(name.rsplit(".", 1)[-1], "linear")
        if name in init or "/" in name:
            nodes[f"model.{name}"] = pair
        elif name == "sdpa":
            nodes["model/scaled_dot_product_attention"] = pair
        else:
            nodes[f"model.{name}"] = nodes[f"model.{name}/{op}"] = pair
    nodes["model"] = nodes["model.head"]
    return nodes


def _expected(t: Tensor) -> Dict[str, Tuple[float, float]]:
    """Statistic -> the interval its logged value must lie in. Counts are exact except for
    elements within rounding of 0 in the reference (``AMBIGUOUS`` of its absmax: the
    causal first query's gradient, zero here, a few ulps in the float32 run), each of which
    may be a zero or a tiny nonzero there."""
    a = t.float().double().abs()  # (the run's values are float32)
    ambiguous = a <= AMBIGUOUS * float(a.max())
    nonzero, n, slack = a > 0, t.numel(), float(ambiguous.double().sum()) / t.numel()
    exact = {"std": float(t.std()), "absmax": float(a.max()), "count": n}
    exact.update(mean_abs=float(a.mean()), peak_sq=float(a.max()) ** 2)  # (the user statistics)
    counts = {"zeros": ~nonzero, **{name: nonzero & (a < bound) for name, bound in BOUNDS.items()}}
    out = {stat: (value, value) for stat, value in exact.items()}
    for name, found in counts.items():
        low = float((found & ~ambiguous).double().sum()) / n
        out[name] = (low, low + slack)
    return out


def _check(logged: Dict[str, float], nodes: Nodes) -> None:
    for label, tensors in nodes.items():
        for direction, t in zip(("fwd", "bwd"), tensors):
            for stat, (low, high) in _expected(t).items():
                tag = f"{STATISTICS.get(stat, stat)}/{direction}/{label}"
                assert tag in logged, tag
                value = logged[tag]
                inside = low - 1e-7 <= value <= high + 1e-7 or value == pytest.approx(low, rel=REL)
                assert inside, (tag, value, low, high)


def _assert_nothing_warns(out: Path, output: str, world: int) -> None:
    """No rank's fit saw a warning of the callback's or about DTensors (every warning of the
    fit is in ``warnings_rank<r>.json``), and the coverage line skipped nothing."""
    for rank in range(world):
        for category, message, filename in json.loads((out / f"warnings_rank{rank}.json").read_text()):
            assert "ScaleMonitor" not in message and "DTensor" not in message, (category, message)
            assert os.sep + "lightning_scale" + os.sep not in filename, (category, message, filename)
    assert "skipped" not in output and "implicitly creating a replicated DTensor" not in output


# ---- the runs ---------------------------------------------------------------------------


@pytest.mark.parametrize("model, dp", [("mlp", 1), ("attn", 1), ("mlp", 2), ("sp", 1), ("blocks", 2)])
def test_every_node_has_the_statistics_of_the_full_tensor(
    model: str, dp: int, trained: Callable[..., Tuple[Path, str]]
) -> None:
    """fc1/q/k/v outputs are column shards, fc2/out outputs and everything outside the
    parallel layers replicas, the matmul before the row-parallel all-reduce a partial sum,
    the parameters DTensor shards or replicas: each equals the unsharded model's tensor.
    With ``dp=2`` (FSDP2 x TP, 4 ranks) the two data-parallel batches are pooled too. With
    ``sp`` (sequence parallel) the embedding's partial sums are reduce-scattered to sequence
    shards, the norms run on them, their parameters' gradients are partial sums in the hook
    (``test_sequence_parallel_sums_the_partial_gradients_in_one_collective``), and the
    logits are a vocabulary-sharded DTensor whose loss is taken under ``loss_parallel``. With
    ``blocks`` (FSDP2 x TP, each block an FSDP2 unit) the embedding, the final norm and the
    head are outside the plan and run after the units' graph breaks: plain tensors that
    descend from no parallel layer's output, replicas recorded once per TP group."""
    out, _ = trained(model, "on", dp)
    logged = _scalars(out)
    nodes = _reference(out, model, dp)
    if model == "blocks":  # (its forward runs eagerly: dynamo skips a frame whose loop a graph break cuts)
        del nodes["model"]
    _check(logged, nodes)
    logged_nodes = {tag.split("/", 2)[2] for tag in logged if tag.startswith("count/fwd/")}
    assert logged_nodes == set(nodes), "every node of the unsharded model, and only those"
    shard, dim = {"mlp": ("model.fc1", -1), "attn": ("model.q", -1), "sp": ("model.norm", 1)}.get(
        model, ("model.blocks.0.fc1", -1)
    )
    assert logged[f"count/fwd/{shard}"] == nodes[shard][0].numel()  # not half the tensor: both shards
    assert logged[f"scale/fwd/{shard}"] != pytest.approx(float(nodes[shard][0].chunk(2, dim)[0].std()), rel=1e-3)


@pytest.mark.parametrize("model, dp", [("mlp", 1), ("attn", 1), ("mlp", 2), ("blocks", 2)])
def test_training_is_identical_with_and_without_the_callback(
    model: str, dp: int, trained: Callable[..., Tuple[Path, str]]
) -> None:
    """The fit with the callback (a tracked step, then an untracked one) and its twin without
    it, in the same processes, end with the same parameters, bit for bit."""
    (on, _), (off, _) = trained(model, "on", dp), trained(model, "off", dp)
    with_cb, without, init = (torch.load(p) for p in (on / "params.pt", off / "params.pt", on / "init.pt"))
    assert with_cb.keys() == without.keys() == init.keys()
    for name in init:
        assert torch.equal(with_cb[name], without[name]), name
        assert not torch.equal(with_cb[name], init[name]), f"{name} did not train"


@pytest.mark.parametrize("model, dp", [("mlp", 1), ("attn", 1), ("mlp", 2), ("blocks", 2)])
def test_the_capture_is_verified_names_the_mesh_and_nothing_warns(
    model: str, dp: int, trained: Callable[..., Tuple[Path, str]]
) -> None:
    out, output = trained(model, "on", dp)
    assert re.search(r"ScaleMonitor: capture of Module verified \(dynamo: bit-identical\)", output), output[-3000:]
    mesh = "data_parallel=2, tensor_parallel=2" if dp == 2 else "tensor_parallel=2"
    assert re.search(rf"ScaleMonitor: captured Module: .*auto: fx cannot see .*; DTensor mesh dims: {mesh}", output)
    _assert_nothing_warns(out, output, dp * TP)
    assert "untracked" not in output


@pytest.mark.parametrize("dp", [1, 2])
def test_pooling_adds_no_collective_for_tensor_parallelism(dp: int, trained: Callable[..., Tuple[Path, str]]) -> None:
    """Every rank makes the pool's four collectives over the default group, with the same
    bytes, on the tracked step only: placements decide locally what each rank records."""
    out, _ = trained("mlp", "on", dp)
    ranks = [json.loads((out / f"collectives_rank{r}.json").read_text()) for r in range(dp * TP)]
    assert all(r == ranks[0] for r in ranks)
    assert [(name, op) for name, op, _, _ in ranks[0]] == [
        ("all_reduce", "MAX"),
        ("all_reduce", "MAX"),
        ("all_reduce", "SUM"),
        ("reduce", "SUM"),
    ]
    assert len({step for *_, step in ranks[0]}) == 1


def test_sequence_parallel_sums_the_partial_gradients_in_one_collective(
    trained: Callable[..., Tuple[Path, str]],
) -> None:
    """The SP norms' parameter gradients (checked against the reference above) are summed
    in one all_reduce over the tensor-parallel group, of their bytes, before the pool's
    four; nothing is skipped and nothing warns."""
    out, output = trained("sp", "on")
    assert re.search(r"ScaleMonitor: capture of Module verified \(dynamo: bit-identical\)", output), output[-3000:]
    _assert_nothing_warns(out, output, TP)
    nodes = _reference(out, "sp")
    ranks = [json.loads((out / f"collectives_rank{r}.json").read_text()) for r in range(TP)]
    assert all(r == ranks[0] for r in ranks)
    partial_bytes = sum(nodes[label][1].numel() * 4 for label in PARTIAL_GRADS)  # float32 gradients
    assert (
        [c[:3] for c in ranks[0]]
        == [
            ["all_reduce", "None", partial_bytes],  # (the default op: SUM)
            *[[name, op, size] for name, op, size, _ in ranks[0][1:]],
        ]
    )
    assert [(name, op) for name, op, _, _ in ranks[0][1:]] == [
        ("all_reduce", "MAX"),
        ("all_reduce", "MAX"),
        ("all_reduce", "SUM"),
        ("reduce", "SUM"),
    ]


def test_a_graph_break_after_the_column_parallel_layer_keeps_every_node_exact(
    trained: Callable[..., Tuple[Path, str]],
) -> None:
    """The graph resumed after a break that follows fc1 computes the GELU from fc1's local
    shard, a plain tensor of unknown placement there; fc2's input hook declares it a shard
    (``from_local(..., Shard(-1))``), so the GELU is recorded on every rank, not counted as a
    replica (half its elements)."""
    out, output = trained("brk")
    logged = _scalars(out)
    nodes = _reference(out, "brk")
    del nodes["model"]  # (a module whose call a nested graph break cuts has no output label: limitations.md)
    _check(logged, nodes)
    assert {tag.split("/", 2)[2] for tag in logged if tag.startswith("count/fwd/")} == set(nodes)
    assert logged["count/fwd/model.act/gelu"] == logged["count/bwd/model.act/gelu"] == nodes["model.act"][0].numel()
    _assert_nothing_warns(out, output, TP)


def test_a_value_keeps_the_placement_it_left_its_graph_with(
    trained: Callable[..., Tuple[Path, str]],
) -> None:
    """After a break that follows fc2, the head's graph computes no DTensor and nothing in
    it declares its input; that input left fc2's graph a replica (fc2's all-reduced output),
    so the head is recorded once per tensor-parallel group: every node equals the reference,
    nothing is skipped and nothing warns. (A value made by eager code after a local shard
    left its graph stays unknown: ``tests/capture/test_tensor_parallel_capture.py``.)"""
    out, output = trained("tail")
    logged = _scalars(out)
    nodes = _reference(out, "tail")
    del nodes["model"]  # (a module whose call a nested graph break cuts has no output label: limitations.md)
    _check(logged, nodes)
    assert {tag.split("/", 2)[2] for tag in logged if tag.startswith("count/")} == set(nodes)
    assert logged["count/fwd/model.head/linear"] == nodes["model.head"][0].numel()
    _assert_nothing_warns(out, output, TP)
