"""The native one-read kernel (lightning_scale.record.native): its numbers against float64 for
every layout it accepts, the layouts it refuses, the statistics it feeds against torch's
kernels and numpy float64, and each way it falls back (switched off, no working compiler,
a kernel that fails its self-check, two processes building at once)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_scale.record import native, stats
from lightning_scale.record.settings import Settings
from lightning_scale.record.stats import formats

from test_stats_property import check_against_reference, fields, sample

needs_compiler = pytest.mark.skipif(
    native.compiler() is None, reason="no C compiler on this machine: the native kernel cannot be built"
)


@pytest.fixture
def kernels():
    k = native.load()
    if k is None:
        pytest.skip(native.status())
    return k


@pytest.fixture
def serial(monkeypatch):
    """Take the kernel for any size, whatever number of threads torch runs."""
    monkeypatch.setattr(native, "SERIAL_THREADS", 1 << 30)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A module state that has tried nothing yet, and an empty cache."""
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_reason", None)
    saved = dict(native._config)
    native.configure(True, str(tmp_path / "cache"))  # (as Settings.apply gives it)
    yield tmp_path
    native._config.update(saved)


@needs_compiler
def test_the_kernel_builds_and_loads_where_there_is_a_compiler(fresh):
    assert native.load() is not None, native.status()
    assert "in use" in native.status()
    built = os.listdir(fresh / "cache")
    assert len(built) == 1 and built[0].startswith("sums-") and built[0].endswith(".so")


def _reference(t: torch.Tensor):
    v = t.double()
    return float(v.sum()), float((v * v).sum()), float(v.abs().max()), float(v.abs().sum())


LAYOUTS = {
    "contiguous": lambda n, d: torch.randn(n, dtype=torch.float64).mul(3).add(0.5).to(d),
    # a transpose of a dense tensor: read as one row in storage order
    "transposed": lambda n, d: torch.randn(3, n, dtype=torch.float64).to(d).t(),
    # q of a fused qkv projection: rows of a wider tensor
    "strided rows": lambda n, d: torch.randn(4, 3 * n + 5, dtype=torch.float64).to(d)[:, 2 : n + 2],
    # broadcast rows (stride 0): each row read again, as the tensor's elements are
    "expanded": lambda n, d: torch.randn(1, n, dtype=torch.float64).to(d).expand(5, n),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("n", [1, 7, 31, 32, 33, 255, 256, 257, 4097, 100_003])
def test_sums_match_float64(kernels, serial, dtype, layout, n):
    x = LAYOUTS[layout](n, dtype)
    total, squares, top, magnitudes = _reference(x)
    for with_max in (False, True):
        got = native.sums(x, with_max)
        assert got is not None
        assert abs(got[0] - total) <= 1e-6 * magnitudes
        assert abs(got[1] - squares) <= 1e-6 * squares
        assert got[2] == (top if with_max else -1.0)


class _Subclass(torch.Tensor):
    """A tensor subclass (as DTensor is one): its data may not be what ``data_ptr`` holds."""


def test_it_declines_what_it_cannot_read(kernels, monkeypatch):
    assert native.sums(torch.randn(100, 10)[:, ::2]) is None  # no contiguous rows
    assert native.sums(torch.randn(1000, dtype=torch.float64)) is None
    assert native.sums(torch.randn(1000).half()) is None
    assert native.sums(torch.randn(1000)) is not None
    # a parameter is read as the plain tensor it holds (a compiled graph hands the op the parameters)
    assert native.sums(torch.nn.Parameter(torch.randn(1000))) is not None
    assert native.sums(torch.randn(1000).as_subclass(_Subclass)) is None  # a subclass: left to torch
    assert native.sums(torch._neg_view(torch.randn(1000))) is None  # its memory holds -x
    # torch splits a large tensor over its threads: above SERIAL_THREADS threads it is left to torch
    monkeypatch.setattr(native, "SERIAL_THREADS", 0)
    assert native.sums(torch.randn(native.SERIAL_MAX + 1)) is None
    assert native.sums(torch.randn(native.SERIAL_MAX)) is not None


@st.composite
def long_tensors(draw):
    """Tensors the kernel reads (above stats' 4096-element small path), with outliers and
    special values, as test_stats_property's ``sample`` makes them."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    n = draw(st.integers(4097, 40_000))
    offset = draw(st.sampled_from([0.0, 0.5, 3.0, 10.0, 1e2, 1e3, 1e4]))
    log2_std = draw(st.integers(-60, 60))
    specials = draw(st.lists(st.sampled_from(["zero", "subnormal", "huge", "inf", "nan"]), max_size=3))
    x = sample(dtype, n, offset, log2_std, specials, draw(st.integers(0, 2**16)))
    if draw(st.booleans()):  # an outlier among values near each other
        x[draw(st.integers(0, n - 1))] = float(x[0]) * draw(st.sampled_from([-1e4, 1e3, 0.0]))
    return x


@settings(max_examples=120, deadline=None)
@given(long_tensors(), st.sampled_from([("moments",), ("moments", "range"), ("moments", "range", "formats")]))
def test_statistics_with_the_kernel_match_float64_and_torch_kernels(x, groups):
    if native.load() is None:
        pytest.skip(native.status())
    saved = native.SERIAL_THREADS
    native.SERIAL_THREADS = 1 << 30
    try:
        with_kernel = fields(x, True, groups)
        check_against_reference(x, True)
    finally:
        native.SERIAL_THREADS = saved
    with native.switched_off():
        without = fields(x, True, groups)
    for name, value in without.items():
        if name in ("mean", "m2"):
            continue
        assert value == with_kernel[name] or (math.isnan(value) and math.isnan(with_kernel[name])), name
    if math.isfinite(without["m2"]):
        assert abs(with_kernel["m2"] - without["m2"]) <= 2e-6 * without["m2"]


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(native.ENV, "0")
    Settings.from_env().apply()  # (where the core is entered)
    assert native.load() is None
    assert f"{native.ENV}=0" in native.status()
    assert native.sums(torch.randn(10_000)) is None
    assert not os.path.exists(fresh / "cache")  # nothing built


def test_a_failing_compiler_falls_back_to_torch(fresh, monkeypatch):
    monkeypatch.setenv("CC", "false")  # found, exits 1
    assert native.load() is None
    assert "false failed" in native.status()
    x = torch.randn(50_000) * 3 + 1
    got = stats.assemble([stats.record_of(x, ("moments", "range"), True)])
    v = x.double()
    assert abs(float(stats.statistic(got, "std")[0]) - float(v.std())) <= 1e-6 * float(v.std())
    assert float(stats.statistic(got, "absmax")[0]) == float(v.abs().max())


@needs_compiler
@pytest.mark.parametrize("flag", ["-DLS_NO_V4", "-DLS_NO_CLONES"])
def test_without_per_cpu_variants_where_the_toolchain_refuses_them(fresh, monkeypatch, flag):
    # a compiler that fails as one without x86-64-v4 (GCC < 11) or without ifunc support would,
    # unless asked for the build without them
    wrapper = fresh / "cc-no-ifunc"
    real = native.compiler()
    wrapper.write_text(
        f'#!/bin/sh\ncase "$*" in *{flag}*) exec {" ".join(real)} "$@";; esac\n'
        'echo "target_clones: not here" >&2\nexit 1\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    assert native.load() is not None, native.status()
    x = torch.randn(10_000)
    assert abs(native.sums(x)[1] - float((x.double() ** 2).sum())) <= 1e-6 * float((x.double() ** 2).sum())


@needs_compiler
@pytest.mark.parametrize(
    "right, wrong",
    [
        ("out[1] = squares;", "out[1] = squares * 1.001;"),  # the sum of squares off by one part in a thousand
        ("{2, 1, 127, 6.0f}", "{2, 1, 127, 4.0f}"),  # MXFP4 saturating at 4
        ("out[3] = all.m3", "out[3] = 1.001 * all.m3"),  # the third central moment
        ("{{448.0f, 3, 121}", "{{448.0f, 3, 120}"),  # per-tensor E4M3 with one subnormal binade too many
        # a group of blocks: two blocks' halves' maxima in each other's lanes, NVFP4's second half
        # cast with the first's scale (one block alone, the other check, cannot see either)
        ("SHUFFLE2(w0, w1, 0, 8, 2, 10, 4, 12, 6, 14)", "SHUFFLE2(w0, w1, 8, 0, 2, 10, 4, 12, 6, 14)"),
        ("inv[3] = lane(s.inv[3], 2 * b + j / 2)", "inv[3] = lane(s.inv[3], 2 * b)"),
        ("if (hmax(top) >= 0x7f800000u)", "if (hmax(top) > 0x7f800000u)"),  # moments: an Inf taken as finite
    ],
)
def test_a_kernel_that_fails_its_self_check_is_not_used(fresh, monkeypatch, right, wrong):
    """Each mutation sits in code every per-CPU variant compiles: the kernel is built as the one
    variant this machine runs (``_one_variant``: a fifth of the build's time), which the self-check
    then sees (with ``wrong == right`` the same build loads and passes it)."""
    source = fresh / "wrong.c"
    with open(native.SOURCE) as f:
        text = f.read()
    assert right in text
    source.write_text(text.replace(right, wrong))
    monkeypatch.setattr(native, "SOURCE", str(source))
    monkeypatch.setenv("CC", str(_one_variant(fresh)))
    assert native.load() is None
    assert "self-check failed" in native.status()


def _cpu_level() -> str:
    """The ``target_clones`` variant this x86-64 CPU runs (as GCC's resolver picks it)."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    v3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
    v4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
    return "x86-64-v4" if v3 | v4 <= flags else "x86-64-v3" if v3 <= flags else "x86-64"


def _one_variant(folder) -> str:
    """A compiler wrapper that builds only ``sums.c``'s per-CPU variant this machine runs: it
    refuses the builds with variants, so ``native`` falls back to ``-DLS_NO_CLONES``, compiled
    for this CPU's level."""
    wrapper = folder / "cc-one-variant"
    real = " ".join(native.compiler())
    level = f"-march={_cpu_level()}" if sys.platform == "linux" and os.uname().machine == "x86_64" else ""
    wrapper.write_text(
        f'#!/bin/sh\ncase "$*" in *-DLS_NO_CLONES*) exec {real} {level} "$@";; esac\n'
        'echo "variants: not here" >&2\nexit 1\n'
    )
    wrapper.chmod(0o755)
    return wrapper


@needs_compiler
def test_two_processes_building_at_once_both_load(tmp_path):
    env = {**os.environ, "LIGHTNING_SCALE_CACHE": str(tmp_path / "cache")}
    env.pop(native.ENV, None)
    # (the package's modules without its ``__init__``, which imports Lightning: the processes
    # start in the time torch takes to import, and build at once)
    code = textwrap.dedent(
        f"""
        import sys, types
        package = types.ModuleType("lightning_scale")
        package.__path__ = [{os.path.dirname(os.path.dirname(native.__path__[0]))!r}]
        sys.modules["lightning_scale"] = package
        from lightning_scale.record import native
        from lightning_scale.record.settings import Settings
        Settings.from_env().apply()
        assert native.load() is not None, native.status()
        print(native.load().path)
        """
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert outs[0][0] == outs[1][0]  # the same file
    assert [n for n in os.listdir(tmp_path / "cache") if not n.startswith(".")] == [
        os.path.basename(outs[0][0].strip())
    ]


@pytest.mark.parametrize(
    "groups", [("moments",), ("moments", "range"), ("moments", "formats"), ("moments", "range", "formats")]
)
def test_the_recorders_short_path_gives_record_ofs_numbers(kernels, serial, groups):
    """``Recorder`` takes ``stats.fast_host_record`` for long host tensors: the very numbers
    of ``record_of``, its fallbacks included (mean-dominated, non-finite, huge values)."""
    from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder

    g = torch.Generator().manual_seed(0)
    cases = {
        "randn": torch.randn(8, 1024, generator=g),
        "strided q": torch.randn(4, 64, 384, generator=g)[..., :128],
        "transposed": torch.randn(96, 64, generator=g).t(),
        "bf16": torch.randn(10_000, generator=g).bfloat16(),
        "mean-dominated": torch.randn(9000, generator=g) + 1e4,
        "with inf": torch.cat([torch.randn(5000, generator=g), torch.tensor([math.inf])]),
        "huge": torch.cat([torch.randn(5000, generator=g), torch.tensor([3e38])]),
        "nan and zeros": torch.cat([torch.randn(5000, generator=g), torch.tensor([math.nan, 0.0, 0.0, -math.inf])]),
        "tiny": torch.randn(6000, generator=g) * 1e-41,
        "float64": torch.randn(5000, generator=g, dtype=torch.float64),
    }
    rec = Recorder(groups, host_reads=True)
    assert rec._fast is not None
    for key, x in cases.items():
        rec.observe(key, x)
    got = rec.records(list(cases))
    for i, (key, x) in enumerate(cases.items()):
        want = stats.assemble([stats.record_of(x, groups, True)])[0]
        torch.testing.assert_close(got[i, FORWARD], want, rtol=0, atol=0, equal_nan=True, msg=key)
        assert got[i, BACKWARD, 0] == 0  # (no gradient)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_group_of_a_big_tensor_matches_numpy(kernels, serial, dtype):
    """Format counts, zeros, least nonzero and absmax exact, moments within 1e-6, over 1M
    elements spanning every format's range (subnormal to overflow), zeros and infinities."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 20, generator=g, dtype=torch.float64) * torch.pow(
        2.0, torch.randint(-140, 127, (1 << 20,), generator=g).double()
    )
    x[::1000] = 0.0
    x = x.to(dtype)
    assert native.every_group(x, formats.NATIVE_BOUNDS) is not None
    check_against_reference(x, True)
    y = x.clone()
    y[7], y[70_000] = math.inf, -math.inf
    check_against_reference(y, True)
    y[123] = math.nan
    check_against_reference(y, True)
