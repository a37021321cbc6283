"""The real-model table: capture mode, coverage, tags, bit-identity and tracked-step cost.

Runs every case of ``tests/capture/test_models.py`` (Hugging Face GPT-2 with and without gradient
checkpointing, BERT, T5, Llama, Mixtral, OLMoE with router logits, Wav2Vec2 with
SpecAugment, Mamba; Lightning's demo
Transformer; unit-scaling's modules; LSTM and GRU language models, a model drawing from
numpy's generator, one branching on ``torch.compiler.is_dynamo_compiling()``, ConvNeXt-style
blocks; all from tiny configs) outside a Trainer:

- capture with ``capture(..., "auto")``, then run the fidelity probe on the first step's
  inputs as ``ScaleMonitor`` does (the route it keeps, and its one-off cost), and time the
  capture with the probe and the first tracked step (dynamo compiles on the first call);
- train two SGD steps tracked and two eagerly on a copy, and compare gradients,
  parameters and buffers bit for bit;
- measure coverage from the records of the tracked step;
- time a plain step (forward, backward, SGD) against a tracked one (the same, recording
  every node, plus reading the records back) in interleaved rounds, on both clocks.

Usage: ``python benchmarks/models.py [--rounds N] [--out docs/models.md]``.

With ``--zoo`` (``make zoo``) it runs the zoo of ``tests/test_zoo.py`` instead: real models
compiled whole with Inductor, each trained uncompiled and tracked, compiled without the
callback and compiled with it, in a ``Trainer`` (bit-identity, how it was tracked, the std of
every node against the uncompiled run's, compile times), with an empty Inductor cache (cold
compiles, as a new user's first run). Each run rewrites only its own section of the page: the
zoo's between ``<!-- zoo -->`` and ``<!-- /zoo -->``, the rest the models'.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests", "capture"), os.path.join(HERE, "..")]

import timing  # noqa: E402
import test_models as cases  # noqa: E402

from lightning_scale.capture import capture, fidelity  # noqa: E402
from lightning_scale.capture.coverage import percent  # noqa: E402
from lightning_scale.record.recorder import Recorder, recording  # noqa: E402


def _sgd(model: nn.Module) -> None:
    cases.sgd_step(model)


def _same(a: nn.Module, b: nn.Module) -> bool:
    grads = all(
        (p.grad is None and q.grad is None)
        or (p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad))
        for p, q in zip(a.parameters(), b.parameters())
    )
    return grads and all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def measure(name: str, rounds: int) -> Dict[str, Any]:
    """One row of the table for the case ``name``."""
    make, loss, _ = {**cases.CASES, **cases.PROBED}[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = make().train()
    reference = copy.deepcopy(model)
    task = cases.Task(model, loss)
    start = time.perf_counter()
    first = capture(task, "auto")
    other = "fx" if first.mode == "dynamo" else "dynamo"
    cases.seed(1)
    probe_start = time.perf_counter()
    outcome = fidelity.verify(
        task, task.forward, [(first.mode, lambda: first), (other, lambda: capture(task, other))], (cases.tokens(0),), {}
    )
    probe_s = time.perf_counter() - probe_start
    cap = outcome.capture or first
    identical, records = True, None
    for step in range(2):
        ids = cases.tokens(step)
        rec = Recorder()
        cases.seed(step + 1)
        with recording(rec):
            out = cap.tracked()(ids)
        out.backward()
        if step == 0:  # dynamo compiles on the first call
            capture_s = time.perf_counter() - start
        records = rec.records(cap.tags, cap.aliases)
        cases.seed(step + 1)
        loss(reference, ids).backward()
        identical &= _same(model, reference)
        _sgd(model)
        _sgd(reference)
    identical &= _same(model, reference)
    assert records is not None
    recorded = [label for label, row in zip(cap.tags, records) if bool((row[:, 0] > 0).any())]
    report = cap.coverage(recorded)
    ids = cases.tokens(7)

    def plain() -> None:
        torch.manual_seed(3)
        loss(reference, ids).backward()
        _sgd(reference)

    def tracked() -> None:
        rec = Recorder()
        torch.manual_seed(3)
        with recording(rec):
            cap.tracked()(ids).backward()
        rec.records(cap.tags, cap.aliases).cpu()
        _sgd(model)

    times = timing.interleaved({"plain": plain, "tracked": tracked}, rounds, warmup=2)
    med = {k: {c: timing.Summary.of(v.clock(c)).median for c in timing.CLOCKS} for k, v in times.items()}
    return {
        "name": name,
        "mode": cap.mode if not outcome.switched else f"{first.mode} -> {cap.mode}",
        "probe": "matches" if outcome.capture is not None and not outcome.switched else outcome.describe(),
        "probe_s": probe_s,
        "graphs": len(cap.graphs),
        "tags": len(cap.tags),
        "module_outputs": len(cap.module_outputs),
        "params": percent(report.covered_elements, report.elements),
        "modules": percent(report.covered_modules, report.modules),
        "warning": report.warning(),
        "identical": identical,
        "capture_s": capture_s,
        "plain_ms": med["plain"]["cpu"] * 1e3,
        "ratio_cpu": med["tracked"]["cpu"] / med["plain"]["cpu"],
        "ratio_wall": med["tracked"]["wall"] / med["plain"]["wall"],
    }


def importable(module: str) -> str:
    """'imports' or the first line of the error importing ``module``."""
    try:
        __import__(module)
    except Exception as err:  # noqa: BLE001 - any failure is the answer
        return f"does not import: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
    return "imports"


def render(rows: List[Dict[str, Any]], rounds: int, seconds: float) -> str:
    lines = [
        "# Real models",
        "",
        f"Generated by `python benchmarks/models.py --out docs/models.md` on "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M} in {seconds:.0f} s "
        f"({rounds} interleaved rounds; load average {timing.load_average()}). Do not edit by hand; rerun it.",
        "",
        "Every case of `tests/capture/test_models.py`, built from a tiny config (hidden size 16-64, 1-2 layers, "
        "batch 2 x 8 tokens, CPU). "
        '`capture(..., "auto")` chooses the mode and the fidelity probe checks it on the first step\'s inputs, as '
        "`ScaleMonitor` "
        "does (`a -> b`: the probe found route a changes the model and switched to b; *probe* is its one-off cost: "
        "an eager and a "
        "captured forward and backward, with dynamo's compile); two SGD steps run tracked and, on a copy, eagerly, "
        "and gradients, parameters "
        "and buffers are compared bit for bit. Coverage comes from the tracked step's records (fraction of parameter "
        "elements "
        "and of module calls with a record). A step is forward, backward and SGD; the tracked step also records "
        "every node and "
        "reads the records back (no Trainer, no writing: `docs/benchmarks.md` has the Trainer figures). These models "
        "are so small "
        "that the tracked step's per-node Python cost dominates the ratio; it falls with model size.",
        "",
        "| model | capture | graphs | tags (module outputs) | coverage: parameters / module calls | bit-identical | "
        "probe | capture + probe + first tracked step | plain step (CPU) | tracked / plain (CPU, wall) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['mode']} | {r['graphs']} | {r['tags']} ({r['module_outputs']}) | {r['params']} / "
            f"{r['modules']} "
            f"| {'yes' if r['identical'] else '**NO**'} | {r['probe_s']:.2f} s | {r['capture_s']:.2f} s | "
            f"{r['plain_ms']:.1f} ms | {r['ratio_cpu']:.2f}x, {r['ratio_wall']:.2f}x |"
        )
    switched = [r for r in rows if r["probe"] != "matches"]
    lines += [
        "",
        "Probe findings: "
        + ("; ".join(f"{r['name']}: {r['probe']}" for r in switched) if switched else "every route matched."),
    ]
    warned = [r for r in rows if r["warning"]]
    lines += [
        "",
        "Coverage warnings: " + ("; ".join(f"{r['name']}: {r['warning']}" for r in warned) if warned else "none."),
    ]
    lines += ["", f"torchvision: {importable('torchvision')}. timm: {importable('timm')}.", ""]
    return "\n".join(lines)


ZOO_START, ZOO_END = "<!-- zoo -->", "<!-- /zoo -->"


def zoo_rows(names: List[str]) -> List[Any]:
    """``tests/test_zoo.run`` of each model (a failing one: its error as the row)."""
    from tests import test_zoo

    rows: List[Any] = []
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            print(f"[zoo] {name}", file=sys.stderr, flush=True)
            try:
                rows.append(test_zoo.run(name, Path(root) / name))
            except Exception as err:  # noqa: BLE001 - a model that fails is a row that says so
                rows.append(f"{name}: {type(err).__name__}: {str(err).splitlines()[0][:300]}")
    return rows


def render_zoo(rows: List[Any], seconds: float, cold: bool) -> str:
    """The zoo's section of the page."""
    from tests.test_zoo import NOISE, REL

    done = [r for r in rows if not isinstance(r, str)]
    lines = [
        ZOO_START,
        "## Compiled models (the zoo)",
        "",
        f"Generated by `make zoo` (`python benchmarks/models.py --zoo --out docs/models.md`) on "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M} in {seconds:.0f} s (load average {timing.load_average()}; "
        f"{'an empty Inductor cache: cold compiles' if cold else 'the Inductor cache as it was'}). Do not edit by "
        "hand; rerun it.",
        "",
        "Every model of `tests/test_zoo.py`, built from a tiny config (fp32, CPU, every dropout off: compiled dropout "
        "draws other random numbers), compiled whole with Inductor as a new user compiles it "
        "(`self.model = torch.compile(model)` in a LightningModule), trained 3 SGD steps in a `Trainer` with "
        "`ScaleMonitor(every_n_steps=2)` (steps 0 and 2 tracked) and without it. *tracked*: how the compiled model "
        "was tracked (in place where the fidelity probe proves the instrumented step bit-identical, else by a shadow "
        "pass); *bit-identical*: parameters and buffers after the fits with and without the callback; *std against "
        "uncompiled*: the forward and backward std of every node both runs logged (matched by label), against the "
        f"same fit uncompiled and tracked in place, at both tracked steps: the largest relative difference (target "
        f"<= {REL:g}); *at noise*: (tag, step) pairs whose std is below {NOISE:g} of the largest of its direction "
        "and step in both runs, a tensor that is zero in exact arithmetic (a zero-initialised bias, the gradient of a "
        "bias right before a BatchNorm), whose relative difference means nothing; *compile*: the first step of the "
        "compiled fit without the callback (the user's compile); "
        "*first tracked step*: the same with the callback (the probe, the tracked version's compile, the shadow "
        "pass).",
        "",
        "| model | tracked | bit-identical | nodes matched (tags: matched / uncompiled's) | std against uncompiled: "
        "forward / backward | at noise | compile | first tracked step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in done:
        ok = lambda x: f"{x:.1e}" + ("" if x <= REL else " **MISSED**")  # noqa: E731
        lines.append(
            f"| {r.name} | {r.how} ({r.route}) | {'yes' if r.identical else '**NO**'} | {r.nodes} ({r.matched} / "
            f"{r.reference}) | {ok(r.worst_forward)} / {ok(r.worst_backward)} | {r.noise} | {r.compile_s:.1f} s | "
            f"{r.tracked_s:.1f} s |"
        )
    from tests.test_zoo import FASTEST

    fastest = min(done, key=lambda r: r.compile_s) if done else None
    ours = next((r for r in done if r.name == FASTEST), None)
    fastest_line = (
        f"Fastest compile in this run: {fastest.name} ({fastest.compile_s:.1f} s). `make test` runs "
        f"`tests/test_zoo.py::FASTEST`, {FASTEST}" + (f" ({ours.compile_s:.1f} s here)." if ours else ".")
        if fastest
        else "No model ran."
    )
    unmatched = "; ".join(f"{r.name}: {', '.join(r.unmatched)}" for r in done if r.unmatched) or "none"
    warned = "; ".join(f"{r.name}: {w}" for r in done for w in r.warnings) or "none"
    failed = "; ".join(r for r in rows if isinstance(r, str)) or "none"
    lines += [
        "",
        fastest_line,
        "",
        "Tags the uncompiled run logged and the compiled run did not (the model's own output `model`: around a "
        "compiled model the loss's `model/view` is logged instead; the batch's tensors `batch_*`, inputs of the "
        "uncompiled capture; a node changed in place later, such as Falcon's MLP output before "
        f"`mlp_output += attention_output`, has no gradient record on the compiled route): {unmatched}.",
        "",
        f"Warnings of the callback: {warned}. Models that failed: {failed}.",
        ZOO_END,
        "",
    ]
    return "\n".join(lines)


def section(text: str) -> str:
    """The zoo's section of a page (empty if it has none)."""
    start, end = text.find(ZOO_START), text.find(ZOO_END)
    return text[start : end + len(ZOO_END)] + "\n" if 0 <= start < end else ""


def write(path: Optional[str], page: str, zoo: Optional[str]) -> None:
    """``page`` (the models' part) with the zoo's section, ``zoo`` or the one ``path`` holds."""
    old = Path(path).read_text() if path and Path(path).exists() else ""
    if zoo is not None:
        start = old.find(ZOO_START)
        page = (old[:start] if start >= 0 else old).rstrip("\n") + "\n\n" + zoo
    else:
        kept = section(old)
        page = page.rstrip("\n") + "\n\n" + kept if kept else page
    if path:
        Path(path).write_text(page)
    print(page)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--zoo", action="store_true", help="the compiled models of tests/test_zoo.py instead")
    parser.add_argument("--warm", action="store_true", help="(zoo) keep the Inductor cache as it is")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    if args.zoo:
        from tests.test_zoo import ZOO

        with tempfile.TemporaryDirectory() as cache:
            if not args.warm:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            rows = zoo_rows(args.only or list(ZOO))
        write(args.out, "", render_zoo(rows, time.perf_counter() - start, not args.warm))
        return 0
    rows = []
    for name in args.only or [*cases.CASES, *cases.PROBED]:
        print(f"[models] {name}", file=sys.stderr, flush=True)
        rows.append(measure(name, args.rounds))
    write(args.out, render(rows, args.rounds, time.perf_counter() - start), None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
