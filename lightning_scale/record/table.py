"""The statistic table: every statistic declared once, by what it keeps per tensor and how it is read.

A ``Statistic`` names the *fields* it keeps per tensor and derives its value from them.
A user statistic declares elementwise functions: ``sums`` (the sum of each is kept) and
``maxes`` (the maximum of each is kept). A built-in statistic reads the fields of a
built-in *group* (``GROUPS``): the fields one computation fills, each with how records merge
it (``Field.merge``: ``sum``, ``max``, ``min``, or ``moment`` for the central moments,
merged by Chan's and Pébay's formulas about the merged mean). The rest of the package reads
everything it needs to know about a statistic from here: its fields and their merges (the
record layout, ``layout``; pooling across ranks follows from the merges), its axis in the
dashboard (``log2`` magnitude or ``linear``), whether a high or a low value is worse when
nodes are ranked (``worse``), how it scales under ``unscale_gradients`` (``unscale``: the
power of the factor its value is multiplied by, None for counts, fractions and ratios) and
its docs line.

A record is a float64 vector: the built-in groups' fields in ``TABLE`` order (fixed), then
the fields of the user statistics a run logs, in the order of their groups
(``run_table.Layout``, where user statistics are registered and requests resolved).
"""

from __future__ import annotations

import importlib
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Iterable, Mapping, Optional, Tuple

if TYPE_CHECKING:  # (torch is imported where a value is computed: the table's readers, such as
    # the command-line tools, start without it)
    from torch import Tensor

__all__ = ["ALL", "BUILTIN", "CHANNEL", "FORMATS", "GROUPS", "TABLE", "Field", "FloatFormat", "Group", "Statistic"]

MERGES = ("sum", "max", "min", "moment")
AXES = ("linear", "log2")
WORSE = ("high", "low")
#: Group keys of user statistics start with this (``register``).
USER_PREFIX = "user:"


@dataclass(frozen=True)
class Field:
    """One record field: its name, the group that computes it, how records merge it
    (``MERGES``) and the power of ``c`` it takes when the tensor is multiplied by ``c``
    (None: no power law, such as a count under a fixed threshold)."""

    name: str
    group: str
    merge: str
    power: Optional[int] = None


@dataclass(frozen=True)
class Group:
    """A computation that fills record fields of a tensor in one go (one reference computation
    in ``reference``; the kernels that accelerate one say which groups they cover)."""

    name: str
    doc: str
    #: opt-in: computed only where a statistic of the group is logged ("moments" always is)
    optional: bool = True


FieldFn = Callable[["Tensor"], "Tensor"]
Value = Callable[[Mapping[str, "Tensor"]], "Tensor"]


class Statistic:
    """A statistic declared once: what it keeps per tensor and how its value is read.

    Args:
        name: the statistic's name, as logged (``<name>/fwd/<node>``, ``<name>/bwd/<node>``).
        sums: name -> an elementwise function of the tensor (the same shape out; a boolean
            result counts) whose sum over the elements is kept. Functions are applied to the
            values in float32 (float64 for float64 tensors) and accumulated as the built-in
            sums are: float32 partial sums of bounded rows, added in float64; NaN and Inf
            values of the function propagate as in a float sum.
        maxes: name -> an elementwise function whose maximum over the elements is kept
            (NaN where the function gives NaN for an element).
        value: derives the statistic from ``s``, a mapping of each ``sums`` and ``maxes`` name
            (and ``"count"``, the number of elements) to float64 tensors of any shape (records
            of many nodes at once); use tensor operations.
        axis: how the dashboard draws it: ``"linear"`` or ``"log2"`` (a magnitude).
        worse: whether a ``"high"`` or a ``"low"`` value is worse when nodes are ranked
            (None: not ranked).
        unscale: under ``unscale_gradients``, a backward value is multiplied by the factor to
            this power (1 for a magnitude such as a mean |x|, 2 for an energy); None: not
            scaled (counts, fractions, ratios).
        doc: one line for the docs and the dashboard.
        group: for the package's built-in statistics only: the built-in group (``GROUPS``)
            whose fields ``value`` reads (``s`` then maps every record field by name).

    Raises:
        ValueError: an argument outside what is allowed (the message names it).

    Example:
        >>> import torch
        >>> mean_abs = Statistic("mean_abs", sums={"abs": torch.abs}, value=lambda s: s["abs"] / s["count"])
        >>> mean_abs.fields
        ('mean_abs.abs',)
    """

    def __init__(
        self,
        name: str,
        sums: Optional[Mapping[str, FieldFn]] = None,
        maxes: Optional[Mapping[str, FieldFn]] = None,
        value: Optional[Value] = None,
        *,
        axis: str = "linear",
        worse: Optional[str] = "high",
        unscale: Optional[int] = None,
        doc: str = "",
        group: Optional[str] = None,
    ) -> None:
        self.name = _identifier("name", name)
        self.sums: Dict[str, FieldFn] = _functions(name, "sums", sums)
        self.maxes: Dict[str, FieldFn] = _functions(name, "maxes", maxes)
        clash = sorted(set(self.sums) & set(self.maxes) | ({"count"} & (set(self.sums) | set(self.maxes))))
        if clash:
            raise ValueError(
                f"Statistic {name!r}: `sums` and `maxes` must use distinct names other than 'count'; {clash}"
            )
        if value is None or not callable(value):
            raise ValueError(f"Statistic {name!r}: `value` must be a function of the kept fields, got {value!r}")
        if group is None and not (self.sums or self.maxes):
            raise ValueError(f"Statistic {name!r}: give at least one function in `sums` or `maxes`")
        if axis not in AXES:
            raise ValueError(f"Statistic {name!r}: `axis` must be one of {AXES}, got {axis!r}")
        if worse is not None and worse not in WORSE:
            raise ValueError(f"Statistic {name!r}: `worse` must be 'high', 'low' or None, got {worse!r}")
        if unscale is not None and (isinstance(unscale, bool) or not isinstance(unscale, int)):
            raise ValueError(f"Statistic {name!r}: `unscale` must be an int power or None, got {unscale!r}")
        self.value, self.axis, self.worse, self.unscale, self.doc = value, axis, worse, unscale, str(doc)
        self.builtin = group is not None
        #: the group whose fields this statistic reads (a user statistic's key, once ``register``ed)
        self.group = group if group is not None else f"{USER_PREFIX}{self.name}"

    @property
    def fields(self) -> Tuple[str, ...]:
        """A user statistic's own record fields, ``<name>.<sum or max name>``, sums first."""
        return tuple(f"{self.name}.{k}" for k in (*self.sums, *self.maxes))

    def own_fields(self) -> Tuple[Field, ...]:
        """The record fields a user statistic keeps (none for a built-in one: its group's)."""
        if self.builtin:
            return ()
        sums = tuple(Field(f"{self.name}.{k}", self.group, "sum") for k in self.sums)
        return sums + tuple(Field(f"{self.name}.{k}", self.group, "max") for k in self.maxes)

    def meta(self) -> Dict[str, object]:
        """What the dashboard needs to show and rank it (stored with a run's node list)."""
        return {"axis": self.axis, "worse": self.worse, "unscale": self.unscale, "doc": self.doc}

    def __reduce__(self) -> object:
        """Pickled by reference where it is a module's global (found in the module its ``value``
        was defined in): its functions may then be lambdas, and a spawned rank imports the very
        object; by value otherwise (its functions must then be picklable)."""
        module = sys.modules.get(getattr(self.value, "__module__", None) or "")
        for attr, held in vars(module).items() if module is not None else ():
            if held is self:
                return (_by_reference, (module.__name__, attr))
        return super().__reduce__()

    def __repr__(self) -> str:
        kind = f"group={self.group!r}" if self.builtin else f"sums={list(self.sums)}, maxes={list(self.maxes)}"
        return f"Statistic({self.name!r}, {kind})"


def _by_reference(module: str, attr: str) -> "Statistic":
    return getattr(importlib.import_module(module), attr)


def _identifier(arg: str, name: object) -> str:
    if not isinstance(name, str) or not name or not all(c.isalnum() or c == "_" for c in name):
        raise ValueError(f"`{arg}` must be a non-empty name of letters, digits and underscores, got {name!r}")
    return name


def _functions(stat: str, arg: str, given: Optional[Mapping[str, FieldFn]]) -> Dict[str, FieldFn]:
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ValueError(f"Statistic {stat!r}: `{arg}` must map names to elementwise functions, got {given!r}")
    out = {}
    for key, fn in given.items():
        _identifier(f"{arg}` key of `{stat}", key)
        if not callable(fn):
            raise ValueError(f"Statistic {stat!r}: `{arg}[{key!r}]` must be a function of the tensor, got {fn!r}")
        out[key] = fn
    return out


@dataclass(frozen=True)
class FloatFormat:
    """Range of a floating-point format: smallest subnormal, smallest normal, largest."""

    min_subnormal: float
    min_normal: float
    max: float


#: The float formats of the ``formats`` counts and of the dashboard's format edges.
FORMATS: Dict[str, FloatFormat] = {
    "fp16": FloatFormat(2.0**-24, 2.0**-14, 65504.0),
    "bf16": FloatFormat(2.0**-133, 2.0**-126, (2 - 2.0**-7) * 2.0**127),
    "e4m3": FloatFormat(2.0**-9, 2.0**-6, 448.0),
    "e5m2": FloatFormat(2.0**-16, 2.0**-14, 57344.0),
}


# ---------------------------------------------------------------------------------------
# The built-in fields, in record order, and the groups that compute them.

FORMAT_NAMES = tuple(FORMATS)
FP8_NAMES = ("e4m3", "e5m2")
BLOCK_NAMES = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
#: The format counts: per format (``FORMAT_NAMES`` order) underflow, below_normal, overflow.
FORMAT_COUNTS = tuple(f"{kind}_{fmt}" for fmt in FORMAT_NAMES for kind in ("underflow", "below_normal", "overflow"))


def _what_ifs(group: str, prefixes: Iterable[str]) -> Tuple[Field, ...]:
    """A cast's sums per format: squared error and squares (energies: power 2) and the
    flushed count (the casts scale per tensor or block: unchanged by a power-of-two factor)."""
    kinds = (("sq_err", 2), ("sq", 2), ("flushed", 0))
    return tuple(Field(f"{p}_{kind}", group, "sum", power) for p in prefixes for kind, power in kinds)


#: Every built-in record field once, in record order (the kernels write them in this order).
TABLE: Tuple[Field, ...] = (
    Field("count", "moments", "sum", 0),
    Field("mean", "moments", "moment", 1),
    Field("m2", "moments", "moment", 2),
    Field("absmax", "range", "max", 1),
    Field("nan", "moments", "sum", 0),
    Field("inf", "moments", "sum", 0),
    Field("zeros", "formats", "sum", 0),
    Field("min_nonzero", "formats", "min", 1),
    *(Field(name, "formats", "sum") for name in FORMAT_COUNTS),
    *_what_ifs("fp8", (f"fp8_{f}" for f in FP8_NAMES)),
    *_what_ifs("blocks", BLOCK_NAMES),
    Field("m3", "kurtosis", "moment", 3),
    Field("m4", "kurtosis", "moment", 4),
)
assert all(f.merge in MERGES for f in TABLE) and len({f.name for f in TABLE}) == len(TABLE)

#: The built-in groups: what each computes (``channels`` keeps a row beside the record, no field).
GROUPS: Dict[str, Group] = {
    "moments": Group("moments", "count, mean, m2 (sum of squared deviations), NaN and ±Inf counts", False),
    "range": Group("range", "max |x|"),
    "formats": Group(
        "formats",
        "zeros, least nonzero |x|; per float format, counts below its subnormals, below its normals, above its max",
    ),
    "fp8": Group("fp8", "the per-tensor-scaled FP8 casts' squared error, squares and flushed count"),
    "blocks": Group("blocks", "the MXFP8, MXFP4 and NVFP4 casts' squared error, squares and flushed count"),
    "kurtosis": Group("kurtosis", "the third and fourth central moments"),
    "channels": Group("channels", "a row of each last-dimension channel's max |x|, merged by a max"),
}


# ---------------------------------------------------------------------------------------
# The built-in statistics.


def _fraction(field: str) -> Value:
    return lambda s: s[field] / s["count"].clamp(min=1)


def _snr_db(prefix: str) -> Value:
    """``10 log10(sum x^2 / sum err^2)`` of a cast; +inf without any error (exact or all zero)."""

    def snr(s: Mapping[str, Tensor]) -> Tensor:
        import torch

        err, sq = s[f"{prefix}_sq_err"], s[f"{prefix}_sq"]
        return torch.where(err == 0, torch.full_like(err, math.inf), 10 * torch.log10(sq / err))

    return snr


def _std(s: Mapping[str, Tensor]) -> Tensor:
    # Bessel's correction as torch.std; a single element has spread 0, not NaN
    return (s["m2"] / (s["count"] - 1).clamp(min=1)).clamp(min=0).sqrt()


def _rms(s: Mapping[str, Tensor]) -> Tensor:
    n = s["count"]
    return ((s["m2"] + n * s["mean"] ** 2) / n.clamp(min=1)).sqrt()


def _kurtosis(s: Mapping[str, Tensor]) -> Tensor:  # population moments: n m4 / m2^2; NaN without spread
    import torch

    return torch.where(s["m2"] > 0, s["count"] * s["m4"] / s["m2"] ** 2, math.nan)


def _field(name: str) -> Value:
    return lambda s: s[name]


def _builtin(name: str, group: str, value: Value, doc: str, **kw: object) -> Statistic:
    return Statistic(name, value=value, group=group, doc=doc, **kw)  # type: ignore[arg-type]


_MAGNITUDE = {"axis": "log2", "worse": None, "unscale": 1}
_BLOCK_CASTS = {"mxfp8_e4m3": "MXFP8 E4M3", "mxfp8_e5m2": "MXFP8 E5M2", "mxfp4": "MXFP4", "nvfp4": "NVFP4"}
_FMT_DOCS = {
    "underflow": "fraction of elements with 0 < |x| < the format's smallest subnormal",
    "below_normal": "fraction of elements with 0 < |x| < the format's smallest normal (underflows included)",
    "overflow": "fraction of elements with |x| > the format's largest finite value, ±Inf included",
}


def _builtins() -> Tuple[Statistic, ...]:
    moments: Tuple[Statistic, ...] = (
        _builtin("std", "moments", _std, "sqrt(m2 / (n - 1)), as torch.std (0 for one element)", **_MAGNITUDE),
        _builtin("mean", "moments", _field("mean"), "Σx / n", axis="linear", worse=None, unscale=1),
        _builtin("rms", "moments", _rms, "sqrt(Σx² / n)", **_MAGNITUDE),
        _builtin("count", "moments", _field("count"), "n, the number of elements", worse=None),
        _builtin("nan", "moments", _field("nan"), "the number of NaN elements"),
        _builtin("inf", "moments", _field("inf"), "the number of ±Inf elements"),
        _builtin("absmax", "range", _field("absmax"), "max |x|", **_MAGNITUDE),
        _builtin("zeros", "formats", _fraction("zeros"), "fraction of elements equal to 0"),
        _builtin("min_nonzero", "formats", _field("min_nonzero"), "min |x| over x ≠ 0 (+inf: none)", **_MAGNITUDE),
    )
    formats = tuple(
        _builtin(f"{kind}_{fmt}", "formats", _fraction(f"{kind}_{fmt}"), f"{_FMT_DOCS[kind]} ({fmt})")
        for fmt in FORMAT_NAMES
        for kind in ("underflow", "below_normal", "overflow")
    )
    casts = {f"fp8_{f}": ("fp8", f"a cast to {f.upper()} scaled by the tensor's amax") for f in FP8_NAMES}
    casts.update({b: ("blocks", f"the {_BLOCK_CASTS[b]} cast (blocks along the last dimension)") for b in BLOCK_NAMES})
    what_ifs = tuple(
        s
        for p, (group, how) in casts.items()
        for s in (
            _builtin(f"{p}_snr_db", group, _snr_db(p), f"10 log10(Σx² / Σerr²) of {how}", worse="low"),
            _builtin(
                f"{p}_flushed",
                group,
                _fraction(f"{p}_flushed"),
                f"fraction of elements nonzero before and 0 after {how}",
            ),
        )
    )
    kurtosis = _builtin("kurtosis", "kurtosis", _kurtosis, "n Σ(x - mean)⁴ / m2² (3 for a Gaussian)")
    return moments + formats + what_ifs + (kurtosis,)


#: Every built-in statistic derived from a record, by name (the channel statistics: ``channels``).
BUILTIN: Dict[str, Statistic] = {s.name: s for s in _builtins()}


def _channels(name: str) -> Value:
    """``stats.channels``' function ``name`` of the channel rows, imported when first called."""

    def value(s: Mapping[str, Tensor]) -> Tensor:
        from lightning_scale.record.stats import channels

        return getattr(channels, name)(s["rows"])

    return value


def _channel_statistics() -> Tuple[Statistic, ...]:
    return (
        _builtin(
            "channel_max_ratio",
            "channels",
            _channels("channel_max_ratio"),
            "the largest channel's max |x| over the median channel's",
        ),
        _builtin(
            "outlier_channels",
            "channels",
            _channels("outlier_channels"),
            "fraction of channels whose max |x| exceeds 6 (LLM.int8's threshold)",
        ),
    )


#: The statistics of the channel rows (group ``channels``: rows beside the records, ``s["rows"]``).
CHANNEL: Dict[str, Statistic] = {s.name: s for s in _channel_statistics()}

#: Every built-in statistic a run may log, by name.
ALL: Dict[str, Statistic] = {**BUILTIN, **CHANNEL}


def markdown() -> str:
    """The built-in statistics as a markdown table (docs/statistics.md holds it; a test keeps the two alike)."""
    lines = [
        "| statistic | group | axis | worse | unscaled as | definition |",
        "|---|---|---|---|---|---|",
    ]
    for s in ALL.values():
        power = "-" if s.unscale is None else ("x" if s.unscale == 1 else f"x^{s.unscale}")
        doc = s.doc.replace("|", "\\|")  # (markdown table cells)
        lines.append(f"| `{s.name}` | {s.group} | {s.axis} | {s.worse or '-'} | {power} | {doc} |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - prints the table for the docs
    print(markdown())
