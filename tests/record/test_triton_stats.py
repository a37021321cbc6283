"""The fused Triton statistics kernel against float64, under Triton's interpreter.

``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` (no CUDA here), so the kernels' very
source runs on CPU tensors with numpy. Every field of every group is compared with a
float64 computation written here (counts, extremes and the fp8 error exactly or to
float64 rounding; mean and m2 within 1e-6), for float32, bfloat16 and float16, on
contiguous, transposed, sliced and strided layouts, with NaN, ±Inf, zeros, subnormals,
values near float32's largest, odd lengths and single elements. A subprocess compiles
the kernels for real GPUs (sm_80, sm_90) with Triton's own compiler (no GPU needed).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from lightning_scale import Recorder, stats
from lightning_scale.record import kernels
from lightning_scale.tools.op_count import OpCounter

triton = pytest.importorskip("triton", reason='the fused kernel needs triton (`pip install "lightning-scale[test]"`)')
import triton.language as tl  # noqa: E402 - after the skip

from lightning_scale.record import triton_stats  # noqa: E402 - after the skip

pytestmark = [
    pytest.mark.skipif(
        not triton_stats.interpreted(), reason="TRITON_INTERPRET=1 was not set before triton was imported"
    ),
    pytest.mark.filterwarnings(
        "ignore:.*encountered in:RuntimeWarning"
    ),  # numpy in the interpreter: inf/NaN lanes, as on a GPU
]

ALL = ("moments", "range", "formats", "fp8")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F32_MAX = torch.finfo(torch.float32).max


def fused(x: Tensor, groups=ALL, block: int = 1024) -> Dict[str, float]:
    row = torch.full((len(stats.FIELDS),), -7.0, dtype=torch.float64)
    triton_stats.record_into(x, groups, row, block=block)
    return dict(zip(stats.FIELDS, row.tolist()))


def reference(x: Tensor) -> Dict[str, float]:
    """Every field in float64 from the definitions (docs/statistics.md), for float32 and half ``x``."""
    a = x.detach().reshape(-1).float()
    d = a.double()
    nan, inf = torch.isnan(a), torch.isinf(a)
    out: Dict[str, float] = {"count": float(a.numel()), "nan": float(nan.sum()), "inf": float(inf.sum())}
    if nan.any() or inf.any():
        out["mean"] = float(d.sum()) / a.numel() if not nan.any() else math.nan
        out["m2"] = math.nan
        out["absmax"] = math.nan if nan.any() else math.inf
    else:
        out["mean"] = float(d.mean())
        out["m2"] = float(((d - d.mean()) ** 2).sum())
        out["absmax"] = float(d.abs().max())
    mag = a.abs()[~nan]
    out["zeros"] = float((mag == 0).sum())
    nonzero = mag[mag > 0]
    out["min_nonzero"] = float(nonzero.min()) if nonzero.numel() else math.inf
    for name, fmt in stats.FORMATS.items():
        out[f"underflow_{name}"] = float((nonzero < fmt.min_subnormal).sum())
        out[f"below_normal_{name}"] = float((nonzero < fmt.min_normal).sum())
        out[f"overflow_{name}"] = float((nonzero > fmt.max).sum())
    xf = torch.where(torch.isfinite(a), a, torch.zeros_like(a))
    amax = xf.abs().max()
    for name, dtype in stats.FP8_DTYPES.items():
        scale = (
            float(torch.tensor(stats.FORMATS[name].max / float(amax), dtype=torch.float64).float())
            if amax > 0
            else F32_MAX
        )
        scale = F32_MAX if math.isinf(scale) else scale
        q = (xf * scale).to(dtype).double()  # torch's cast
        err = (q - xf.double() * scale) / scale
        out[f"fp8_{name}_sq_err"] = float((err * err).sum())
        out[f"fp8_{name}_sq"] = float((xf.double() ** 2).sum())
        out[f"fp8_{name}_flushed"] = float(((xf != 0) & (q == 0)).sum())
    # ``ALL`` asks for neither the block what-ifs nor kurtosis: the kernel leaves them NaN
    out.update({f: math.nan for g in ("blocks", "kurtosis") for f in stats.GROUPS[g]})
    return out


def assert_record(got: Dict[str, float], want: Dict[str, float]) -> None:
    spread = math.sqrt(want["m2"] / max(want["count"], 1.0)) if math.isfinite(want["m2"]) else 0.0
    for name in stats.FIELDS:
        g, w = got[name], want[name]
        if math.isnan(w):
            assert math.isnan(g), (name, g)
        elif name == "mean" and math.isfinite(w):
            assert abs(g - w) <= 1e-6 * (abs(w) + spread) + 1e-300, (name, g, w)
        elif name == "m2":
            assert abs(g - w) <= 1e-6 * w + 1e-300, (name, g, w)
        elif name.endswith(("_sq_err", "_sq")):
            assert abs(g - w) <= 1e-9 * w + 1e-300, (name, g, w)
        else:  # counts and extremes: exact
            assert g == w, (name, g, w)


@st.composite
def hard_tensors(draw: Callable) -> Tensor:
    """Values from a few scales (tiny to near float32's largest), an offset that may
    dominate the spread, and special values dropped in at random places."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 5000))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    big = 3e38 if dtype == torch.float32 else float(torch.finfo(dtype).max) / 2
    scale = draw(st.sampled_from([1.0, 1e-3, 2.0**-140, 1e-42, 1e30, big / 4]))
    offset = draw(st.sampled_from([0.0, 1.0, 1e3])) * scale
    x = (torch.randn(n, generator=g, dtype=torch.float64) * scale + offset).clamp(-big, big).to(dtype)
    specials = draw(
        st.lists(
            st.tuples(
                st.integers(0, n - 1),
                st.sampled_from([0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, big, -big, 1e-6]),
            ),
            max_size=6,
        )
    )
    for i, v in specials:
        x[i] = v
    return x


@given(
    hard_tensors(),
    st.sampled_from(["flat", "transposed", "slice", "strided", "3d"]),
    st.sampled_from([256, 1024, 65536]),
)
@settings(max_examples=40, deadline=None)
def test_every_field_matches_float64(x: Tensor, layout: str, block: int) -> None:
    n = x.numel()
    if layout == "transposed" and n % 3 == 0:
        x = x.view(3, -1).t()  # dense in another order: read flat
    elif layout == "slice":  # a column block of a wider matrix: two strided dimensions
        x = torch.cat([x.view(1, -1), x.view(1, -1) * 2]).t()[:, :1].view(-1, 1)
        x = torch.cat([x, x], 1).view(n, 2)[:, 1:]
    elif layout == "strided":
        x = torch.stack([x, x + 1]).t()[:, 0]  # one dimension, stride 2
    elif layout == "3d" and n >= 8:
        m = n // 4 * 4
        x = x[:m].view(2, 2, -1).permute(2, 0, 1)[::2]  # three dimensions, not dense: copied once
    assert_record(fused(x, block=block), reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_program_merge_of_mean_dominated_tensor(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = (1e4 + torch.randn(30_001, generator=g, dtype=torch.float64)).to(dtype)  # |mean| = 1e4 std
    for block in (1024, 65536):  # 30 tiles, more than the 16 programs: the grid-stride merge too
        assert_record(fused(x, block=block), reference(x))


def test_values_near_float32_max_have_finite_accurate_moments() -> None:
    x = torch.tensor([3.4e38, -3.4e38, 3.3e38, 1.0] * 257, dtype=torch.float32)
    got = fused(x)
    assert math.isfinite(got["m2"])
    assert_record(got, reference(x))


def test_all_subnormal_tensor_has_a_nonzero_spread() -> None:
    x = torch.tensor([1e-45, 3e-45, 1e-40, 7e-39] * 100, dtype=torch.float32)
    got = fused(x)
    assert got["m2"] > 0
    assert_record(got, reference(x))


@pytest.mark.parametrize("value", [0.0, 2.5, math.nan, -math.inf])
def test_single_element(value: float) -> None:
    x = torch.tensor([value])
    assert_record(fused(x), reference(x))


def test_fp8_ties_round_to_even_as_torch_casts() -> None:
    # amax = 448 gives scale 1: each value is its own scaled value. Midpoints between
    # neighbouring E4M3 numbers (normal and subnormal) are ties.
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([torch.tensor([448.0]), ties, -ties, grid / 3])
    assert_record(
        fused(x, ("moments", "fp8")) | {k: math.nan for k in stats.GROUPS["formats"] + ("absmax",)},
        reference(x) | {k: math.nan for k in stats.GROUPS["formats"] + ("absmax",)},
    )


@triton.jit
def _index_probe(i_ptr, j_ptr, t, tiles_n, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.arange(0, BR)[:, None]
    c = tl.arange(0, BC)[None, :]
    i, j = triton_stats.tile_index(t, tiles_n, r, c, BR, BC)
    tl.store(i_ptr + r, i)
    tl.store(j_ptr + c, j)


@pytest.mark.parametrize("row", [0, 1, 3])
def test_tile_index_is_exact_in_a_row_of_more_than_2_to_the_31_elements(row: int) -> None:
    """The last tile of a row of 2**31 + 7 elements (a non-contiguous slice of a large
    logits tensor) starts at column 2**31: int32 tile arithmetic would wrap there. Scalar
    arguments only: nothing of that size is allocated."""
    n_cols, br, bc = 2**31 + 7, 2, 256
    tiles_n = -(-n_cols // bc)
    i, j = torch.full((br,), -1, dtype=torch.int64), torch.full((bc,), -1, dtype=torch.int64)
    _index_probe[(1,)](i, j, row * tiles_n + tiles_n - 1, tiles_n, BR=br, BC=bc)
    assert i.tolist() == [row * br + k for k in range(br)]
    assert j.tolist() == [2**31 + k for k in range(bc)]
    assert int((j < n_cols).sum()) == 7  # the row's last 7 elements, the rest masked


@pytest.mark.parametrize(
    "groups",
    [
        ("moments",),
        ("moments", "range"),
        ("moments", "formats"),
        ("moments", "fp8"),
        ("moments", "blocks"),
        ("moments", "kurtosis"),
    ],
)
def test_groups_not_asked_for_are_nan(groups: tuple) -> None:
    got = fused(torch.randn(1000), groups)
    for name in stats.FIELDS:
        asked = name == "count" or any(name in stats.GROUPS[g] for g in groups)
        assert math.isnan(got[name]) != asked, name


def test_record_of_and_recorder_take_the_kernel_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 96, generator=g, requires_grad=True)
    xs = [
        torch.randn(40, 64, generator=g),
        torch.randn(3, generator=g),
        torch.randn(7, generator=g, dtype=torch.float64),
    ]  # (float64: torch's kernels, rows of both kinds)
    records = {}
    for kernel in ("torch", "triton"):
        monkeypatch.setenv(kernels.ENV, kernel)
        rec = Recorder(ALL, host_reads=False)
        for i, x in enumerate(xs):
            y = (x @ w[: x.shape[-1]]) if x.dim() == 2 else x
            rec.observe(f"n{i}", y)
            if y.requires_grad:
                (y.float() ** 2).sum().backward()
        records[kernel] = rec.records()
        rows = [stats.assemble([stats.record_of(x, ALL, host_reads=False, kernel=kernel)]) for x in xs]
        records[kernel + "_record_of"] = torch.cat(rows)
    for fused_rows, torch_rows in (
        (records["triton"], records["torch"]),
        (records["triton_record_of"], records["torch_record_of"]),
    ):
        for got, want in zip(fused_rows.reshape(-1, len(stats.FIELDS)), torch_rows.reshape(-1, len(stats.FIELDS))):
            assert_record(dict(zip(stats.FIELDS, got.tolist())), dict(zip(stats.FIELDS, want.tolist())))


def test_kernel_choice_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "cuda")
    with pytest.raises(ValueError, match=r"`LIGHTNING_SCALE_KERNEL` must be one of auto, triton, torch; got 'cuda'"):
        Recorder()
    for value, want in (("", "auto"), (" Triton ", "triton"), ("torch", "torch")):
        monkeypatch.setenv(kernels.ENV, value)
        assert kernels.choice() == want
    x = torch.randn(10)
    assert not kernels.uses_triton(x, "auto")  # a CPU tensor: torch's kernels
    assert kernels.uses_triton(x, "triton")  # the interpreter runs it
    assert not kernels.uses_triton(x.double(), "triton")  # float64: torch's kernels
    monkeypatch.setenv(kernels.ENV, "triton")
    assert "fused Triton kernel under Triton's interpreter" in kernels.status(torch.device("cpu"), host_reads=False)
    monkeypatch.setenv(kernels.ENV, "auto")
    assert "torch's kernels" in kernels.status(torch.device("cpu"), host_reads=False)


#: Aten ops that launch no kernel: an allocation, views.
NO_KERNEL = {"empty", "slice", "select", "view", "permute", "detach"}


@pytest.mark.parametrize("groups", [("moments",), ("moments", "range", "formats"), ALL])
def test_a_record_costs_a_few_aten_ops_and_no_full_size_one(monkeypatch: pytest.MonkeyPatch, groups: tuple) -> None:
    """Outside the Triton launches a record takes its row of the step's buffer and one
    scratch allocation (partial rows), and views of them: no torch kernel, nothing full-size."""
    monkeypatch.setenv(kernels.ENV, "triton")
    rec = Recorder(groups, host_reads=False)
    rec.observe("warm", torch.randn(300))  # the format bounds' one upload
    for x in (torch.randn(512, 300)[:, :256], torch.randn(20_000).to(torch.bfloat16), torch.randn(64, 70).t()):
        counter = OpCounter(x.numel())
        with counter:
            rec.observe(x.shape, x)
        assert len(counter.ops) <= 8, counter.ops
        assert set(counter.names()) <= NO_KERNEL, counter.ops
        assert not counter.full, counter.full


COMPILE = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lightning_scale.record import kernels, triton_stats as ts
    assert not ts.interpreted()
    try:
        kernels.uses_triton(torch.ones(3), "triton")
        raise SystemExit("no error")
    except RuntimeError as err:
        assert "needs Triton's interpreter: set TRITON_INTERPRET=1" in str(err), err
    grid = {"n": "i64", "M": "i64", "N": "i32", "s0": "i64", "s1": "i32", "tiles_n": "i32", "ntiles": "i32"}
    parts = {"part_ptr": "*fp64", "out_ptr": "*fp64", "scale_ptr": "*fp64", "P": "i32"}
    tiles = dict(BR=16, BC=256, PW=64)
    jobs = [
        (ts._tiles_kernel, {"x_ptr": "*i16", "part_ptr": "*fp64", "bounds_ptr": "*i32", **grid},
         dict(**tiles, FORMATS=True, BF16=True, BLOCKS=True, KURT=True)),
        (ts._tiles_kernel, {"x_ptr": "*fp32", "part_ptr": "*fp64", "bounds_ptr": "*i32", **grid},
         dict(**tiles, FORMATS=False, BF16=False, BLOCKS=False, KURT=False)),
        (ts._tiles_kernel, {"x_ptr": "*fp16", "part_ptr": "*fp64", "bounds_ptr": "*i32", **grid},
         dict(BR=128, BC=32, PW=64, FORMATS=False, BF16=False, BLOCKS=True, KURT=False)),
        (ts._finish_kernel, {**parts, "n": "i64"},
         dict(CH=64, PW=64, F=len(ts.FIELDS), RANGE=True, FORMATS=True, FP8=True, BLOCKS=True, KURT=True)),
        (ts._fp8_kernel, {"x_ptr": "*fp16", "part_ptr": "*fp64", "scale_ptr": "*fp64", **grid},
         dict(BR=16, BC=256, PW=8, BF16=False)),
        (ts._fp8_finish_kernel, parts, dict(CH=64, PW=8)),
    ]
    options = {"num_warps": 8, "enable_fp_fusion": False}
    for arch in (80, 90):
        for fn, sig, const in jobs:
            src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in const}}, constexprs=const)
            done = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            assert done.asm["cubin"], (arch, fn)
    print("compiled")
""")


def test_kernels_compile_for_nvidia_gpus_and_cpu_needs_the_interpreter() -> None:
    """Triton's compiler (bundled ptxas) builds every kernel for sm_80 and sm_90 without
    a GPU; without the interpreter, ``triton`` on a CPU tensor is refused by name."""
    env = {
        **os.environ,
        "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "TRITON_DEFAULT_FP_FUSION": "0",
    }
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.nn.functional.gelu(self.fc(x))


def _fit(root: str) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_scale import ScaleMonitor

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Tiny()

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=2,
        callbacks=[ScaleMonitor(every_n_steps=1)],
        default_root_dir=root,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), data)


def test_a_fit_logs_the_kernel_and_refuses_a_bad_value(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("LIGHTNING_SCALE_HOST_READS", "0")
    monkeypatch.setenv(kernels.ENV, "triton")
    with caplog.at_level("INFO"):
        _fit(str(tmp_path / "a"))
    assert "ScaleMonitor: device statistics: fused Triton kernel under Triton's interpreter" in caplog.text
    monkeypatch.setenv(kernels.ENV, "fast")
    with pytest.raises(ValueError, match=r"`LIGHTNING_SCALE_KERNEL` must be one of auto, triton, torch; got 'fast'"):
        _fit(str(tmp_path / "b"))


def test_the_kernel_computes_the_block_what_ifs_and_kurtosis_in_record_of_and_the_recorder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The block what-ifs and kurtosis come from the fused read (tests/record/test_triton_blocks.py
    for the kernel alone), through ``record_of`` and the recorder's buffer rows: the torch path's
    statistics (flushed fractions exactly, the rest to float32 rounding)."""
    groups = ("moments", "range", "blocks", "kurtosis")
    x = torch.distributions.StudentT(torch.tensor(3.0)).sample((96, 70))
    names = ["kurtosis", *(n for n in stats.STATISTICS if stats.STATISTICS[n] == "blocks")]
    want = stats.assemble([stats.record_of(x, groups, host_reads=False, kernel="torch")])[0]
    via_record_of = stats.assemble([stats.record_of(x, groups, host_reads=False, kernel="triton")])[0]
    monkeypatch.setenv(kernels.ENV, "triton")
    rec = Recorder(groups, host_reads=False)
    rec.observe("x", x)
    for got in (via_record_of, rec.records(["x"])[0, 0]):
        for name in names:
            g, w = stats.statistic(got, name), stats.statistic(want, name)
            assert not g.isnan(), name
            torch.testing.assert_close(g, w, rtol=0 if name.endswith("_flushed") else 1e-6, atol=0)
