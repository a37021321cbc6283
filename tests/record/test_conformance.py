"""Conformance: every backend that computes records, on every field, against float64.

Backends: the reference (``stats.reference``: torch, every device), ``record_of`` with host
reads (the native kernel's accelerations, the reference for the rest) and without (torch's
device path), the batch of short host tensors (``ShortRecords``), the fused Triton kernel
(under ``TRITON_INTERPRET=1``, through a ``Recorder``), the traceable ops eager and compiled
by Inductor, and the compiled route's host op. Fields: every built-in group's (moments,
range, formats, fp8, blocks, kurtosis) and a user statistic's (a sum, a boolean count, a
max). Tensors: the hard ones (|mean| >> std, NaN and ±Inf, subnormals, a range of 2^-140 to
2^100, empty, one element, 0-dim, strided, transposed and expanded views) in float32,
bfloat16, float16 and float64. The float64 reference is written here from the definitions
(docs/statistics.md), without the package's code (the block casts: ``blocks.dequantized``,
held to torchao's own casts in ``test_blocks.py``).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from torch import Tensor

from lightning_scale import Statistic
from lightning_scale.record import stats
from lightning_scale.record.recorder import FORWARD, Recorder, recording, observe
from lightning_scale.record.settings import Settings
from lightning_scale.record.short_records import ShortRecords
from lightning_scale.record.stats import reference, run_table
from lightning_scale.record.stats.blocks import BLOCK_FORMATS, dequantized
from lightning_scale.record.stats.host_op import host_record
from lightning_scale.record.stats.traceable import PackedLayout, packed_record, traceable_record

USER = Statistic(
    "conformance",
    sums={"abs": torch.abs, "big": lambda x: x.abs() > 1},
    maxes={"sq": torch.square},
    value=lambda s: s["abs"] / s["count"],
)
BUILTIN = ("moments", "range", "formats", "fp8", "blocks", "kurtosis")
GROUPS = (*BUILTIN, run_table.register(USER))
LAYOUT = run_table.layout(GROUPS)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _specials(dtype: torch.dtype) -> Tensor:
    x = torch.randn(40, 30, generator=_gen(1)).to(dtype)
    x[3, 4], x[7, 1], x[20, 29] = math.nan, math.inf, -math.inf
    return x


def _subnormal(dtype: torch.dtype) -> Tensor:
    tiny = torch.finfo(dtype).tiny
    x = torch.rand(700, generator=_gen(2), dtype=torch.float64) * tiny * (torch.arange(700) % 3 - 1)
    return x.to(dtype)  # (subnormals of the dtype, zeros of both signs)


def _wide(dtype: torch.dtype) -> Tensor:
    e = torch.randint(-140, 100, (2000,), generator=_gen(3)).double()
    x = torch.randn(2000, generator=_gen(4), dtype=torch.float64) * torch.exp2(e)
    top = torch.finfo(dtype).max / 4
    return x.clamp(-top, top).to(dtype)


#: name -> tensor of a dtype (``DTYPES``)
TENSORS: Dict[str, Callable[[torch.dtype], Tensor]] = {
    "normal": lambda dt: (torch.randn(37, 64, generator=_gen(5)) * 3).to(dt),
    "mean_dominated": lambda dt: (1000 + 0.05 * torch.randn(4096, generator=_gen(6))).to(dt),
    "specials": _specials,
    "subnormal": _subnormal,
    "wide": _wide,
    "empty": lambda dt: torch.empty(0, 5, dtype=dt),
    "one": lambda dt: torch.tensor([2.5], dtype=dt),
    "scalar": lambda dt: torch.tensor(-0.75, dtype=dt),
    "strided": lambda dt: torch.randn(64, 96, generator=_gen(7)).to(dt)[:, 1::2],
    "transposed": lambda dt: torch.randn(48, 64, generator=_gen(8)).to(dt).t(),
    "expanded": lambda dt: torch.randn(1, 64, generator=_gen(9)).to(dt).expand(16, 64),
    "long": lambda dt: (torch.randn(70_000, generator=_gen(10)) * 0.02).to(dt),
}


# ---- the float64 reference, from the definitions ------------------------------------------


def expected(x: Tensor) -> Dict[str, float]:
    """Every field of ``x`` in float64, as docs/statistics.md defines it."""
    d = x.double().reshape(-1)
    n = d.numel()
    out = {name: math.nan for name in LAYOUT.names}
    out["count"] = float(n)
    if n == 0:  # an empty record: count, mean and m2 0, nothing else computed
        out.update(mean=0.0, m2=0.0)
        return out
    out.update(nan=float(d.isnan().sum()), inf=float(d.isinf().sum()))
    mean = d.mean()  # (float64: inf for [inf, 1], NaN with a NaN or both infinities)
    finite = bool(d.isfinite().all())
    out.update(mean=float(mean), m2=float(((d - mean) ** 2).sum()) if finite else math.nan)
    a = d.abs()
    out["absmax"] = math.nan if out["nan"] else float(a.max())
    out["zeros"] = float((d == 0).sum())
    nonzero = (a > 0) & ~a.isnan()
    out["min_nonzero"] = float(a[nonzero].min()) if bool(nonzero.any()) else math.inf
    for name, fmt in stats.FORMATS.items():
        out[f"underflow_{name}"] = float((nonzero & (a < fmt.min_subnormal)).sum())
        out[f"below_normal_{name}"] = float((nonzero & (a < fmt.min_normal)).sum())
        out[f"overflow_{name}"] = float((a > fmt.max).sum())
    for part in (_fp8(x), _blocks(x), _kurtosis(d), _user(x)):
        out.update(part)
    return out


def _fp8(x: Tensor) -> Dict[str, float]:
    """Per-tensor amax scaling in float32 (float64 for float64 ``x``), torch's cast, errors in
    ``x``'s units; non-finite elements left out."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = torch.where(x.isfinite(), x, 0).to(acc).reshape(-1)
    amax = xf.abs().max()
    out = {}
    for name, dtype in stats.FP8_DTYPES.items():
        big = torch.finfo(acc).max
        scale = torch.tensor(stats.FORMATS[name].max, dtype=acc) / amax if amax > 0 else torch.tensor(big, dtype=acc)
        scale = torch.tensor(big, dtype=acc) if math.isinf(float(scale)) else scale
        q = (xf * scale).to(dtype).double()
        err = (q - xf.double() * scale.double()) / scale.double()
        out[f"fp8_{name}_sq_err"] = float((err**2).sum())
        out[f"fp8_{name}_sq"] = float((xf.double() ** 2).sum())
        out[f"fp8_{name}_flushed"] = float(((xf != 0) & (q == 0)).sum())
    return out


def _blocks(x: Tensor) -> Dict[str, float]:
    xf = torch.where(x.isfinite(), x, 0).reshape(x.shape if x.dim() else (1,))
    ref = xf.double()
    out = {}
    for fmt in BLOCK_FORMATS:
        q = dequantized(xf, fmt).double()
        out[f"{fmt}_sq_err"] = float(((q - ref) ** 2).sum())
        out[f"{fmt}_sq"] = float((ref**2).sum())
        out[f"{fmt}_flushed"] = float(((ref != 0) & (q == 0)).sum())
    return out


def _kurtosis(d: Tensor) -> Dict[str, float]:
    f = d[d.isfinite()]
    c = f - f.mean() if f.numel() else f
    return {"m3": float((c**3).sum()), "m4": float((c**4).sum())}


def _user(x: Tensor) -> Dict[str, float]:
    v = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)  # (the functions' input)
    return {
        "conformance.abs": float(v.abs().double().sum()),
        "conformance.big": float((v.abs() > 1).sum()),
        "conformance.sq": float(v.square().max()),
    }


# ---- the backends ---------------------------------------------------------------------------


def _row(entries: List[stats.Entry]) -> Tensor:
    return stats.assemble([entries], width=LAYOUT.width)[0]


def _recorded(rec: Recorder, x: Tensor) -> Tensor:
    with recording(rec):
        observe(x, "x")
    assert rec.error is None, rec.error
    return rec.records(["x"])[0, FORWARD]


#: The groups the short tensors' batch computes (the fp8 what-if scales each tensor by itself: not batched).
SHORT_GROUPS = tuple(g for g in GROUPS if g != "fp8")


def _short(x: Tensor) -> Tensor:
    batch = ShortRecords(SHORT_GROUPS)
    entry = batch.add(x)
    batch.flush()
    return _row(entry)


_COMPILED: Dict[Tuple[torch.dtype, bool], Callable[[Tensor], Tensor]] = {}


def _compiled(x: Tensor) -> Tensor:
    """The traceable ops compiled by Inductor (once per dtype and layout)."""
    key = (x.dtype, x.is_contiguous())
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(lambda t: packed_record(t, GROUPS), dynamic=True)
    return PackedLayout((x.numel(),), GROUPS, x.device).records(_COMPILED[key](x))[0]


BACKENDS: Dict[str, Callable[[Tensor], Tensor]] = {
    "reference": lambda x: reference.record(x, GROUPS, LAYOUT),
    "host": lambda x: _row(stats.record_of(x, GROUPS, host_reads=True)),
    "device": lambda x: _row(stats.record_of(x, GROUPS, host_reads=False, kernel="torch")),
    "short": _short,
    "triton": lambda x: _recorded(Recorder(GROUPS, host_reads=False, settings=Settings(kernel="triton")), x),
    "traceable": lambda x: traceable_record(x, GROUPS),
    "compiled": _compiled,
    "host_op": lambda x: host_record(x, GROUPS)[: LAYOUT.width],
}


def applies(backend: str, name: str, x: Tensor) -> bool:
    if backend in ("reference", "host", "device"):
        return True
    if x.numel() == 0:
        return False  # (a graph op or kernel of an empty tensor: not asked; record_of answers it)
    if backend == "short":
        return x.numel() <= 4096 and x.dtype != torch.float64
    if backend == "triton":  # (Triton's interpreter takes ~40 s for a tensor of two 64K tiles)
        pytest.importorskip("triton")
        return x.dtype != torch.float64 and name != "long"
    if backend == "compiled":  # (Inductor compiles ~15 s a variant here: one contiguous float32, one strided bfloat16)
        contiguous = name in ("normal", "specials", "mean_dominated", "wide", "one") and x.dtype == torch.float32
        return contiguous or name in ("transposed", "strided") and x.dtype == torch.bfloat16
    return True


# ---- the comparison -------------------------------------------------------------------------

EXACT = {"count", "nan", "inf", "zeros", "min_nonzero", "absmax", "conformance.big", "conformance.sq"}
EXACT |= {f"{k}_{f}" for f in stats.FORMATS for k in ("underflow", "below_normal", "overflow")}
EXACT |= {f"{p}_flushed" for p in [*(f"fp8_{f}" for f in stats.FP8_DTYPES), *BLOCK_FORMATS]}
REL = {"conformance.abs": 1e-6, "m4": 1e-5}  # (float32 row sums, added in float64)
REL.update({f"fp8_{f}_{k}": 1e-6 for f in stats.FP8_DTYPES for k in ("sq_err", "sq")})
REL.update({f"{f}_{k}": 1e-5 for f in BLOCK_FORMATS for k in ("sq_err", "sq")})


def assert_conforms(got: Tensor, want: Dict[str, float], where: str, skip: Tuple[str, ...] = ()) -> None:
    values = dict(zip(LAYOUT.names, got.tolist()))
    want = {k: v for k, v in want.items() if k not in skip}
    n, m2, m4 = want["count"], want["m2"], want["m4"]
    std = math.sqrt(m2 / n) if n and math.isfinite(m2) else 0.0
    for name, w in want.items():
        g = values[name]
        if math.isnan(w) or math.isnan(g):
            assert math.isnan(w) and math.isnan(g), (where, name, g, w)
        elif name in EXACT or math.isinf(w):
            assert g == w, (where, name, g, w)
        elif name == "mean":
            assert abs(g - w) <= 1e-6 * std + 1e-12 * abs(w), (where, name, g, w)
        elif name == "m2":
            assert abs(g - w) <= 1e-5 * w + 1e-300, (where, name, g, w)
        elif name == "m3":  # (cancels: within its scale n std^3 of the finite values)
            assert abs(g - w) <= 1e-5 * n**0.25 * abs(m4) ** 0.75 + 1e-300, (where, name, g, w)
        else:
            assert abs(g - w) <= REL[name] * abs(w) + 1e-300, (where, name, g, w)


CASES = [(t, d) for t in TENSORS for d in DTYPES]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_every_backend_gives_every_field_of_the_hard_tensors_as_float64(backend: str) -> None:
    checked = 0
    for name, dtype in CASES:
        x = TENSORS[name](DTYPES[dtype])
        if not applies(backend, name, x):
            continue
        skip = stats.GROUPS["fp8"] if backend == "short" else ()
        assert_conforms(BACKENDS[backend](x).double().cpu(), expected(x), f"{backend} {name} {dtype}", skip)
        checked += 1
    assert checked >= {"compiled": 7, "short": 20}.get(backend, 30), checked
