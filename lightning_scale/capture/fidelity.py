"""Fidelity: proof, on a capture's first tracked step, that the captured forward computes
exactly what the user's forward computes.

A capture route can change a model's computation where no test of ours would notice:
dynamo makes ``torch.compiler.is_compiling()`` true (transformers' Mamba then takes
another scan), traces numpy calls into torch ops, replays checkpointed dropout; fx bakes
Python branches in. So before the first tracked step of a capture runs, ``verify`` runs
the user's eager forward and the captured forward on the step's own inputs, each from the
same saved state (``module_state.Snapshot``: the random number generators, buffers,
module attributes), and compares bit for bit every output tensor, every buffer after the
forward, and the parameters' gradients of the outputs' sum (a loss alone can hide a
changed forward: a relative change of 1e-6 inside a model often leaves a float32 loss
as it was). If they differ it says which entry and by how much, and tries the other route
(fx <-> dynamo). If no route reproduces the eager forward, it says so, and the model
trains untracked. Afterwards the state is put back, so the real step runs as if no probe had
run.

Where a route differs, the eager forward is run once more from the same state: an entry
that differs between two eager runs too (nondeterministic kernels, such as atomics on a
GPU) may differ in the route by up to ``NOISE_FACTOR`` times that spread; every other
entry must match bit for bit.

Both forwards run in the step's own grad mode (not under ``torch.no_grad``): dynamo
guards on grad mode, so a probe without gradients would compile, and verify, a graph the
step never runs; and gradients are compared. They are taken with ``torch.autograd.grad``,
so no ``.grad`` is touched; their graphs are freed before the step. Under ``no_grad``
(validation) only outputs and buffers are compared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from lightning_scale.capture.graphs import Capture
from lightning_scale.capture.module_state import Snapshot
from lightning_scale.capture.tensor_parallel import local_tensor
from lightning_scale.capture.tracer import failure_reason

__all__ = ["NOISE_FACTOR", "Outcome", "ProbeInterrupted", "Verdict", "compare", "output_leaves", "verify"]

_DEPTH = 6  # how deep outputs are searched for tensors (nested tuples, dicts, objects)


@dataclass
class Verdict:
    """One route's result: the differences from the eager forward, or why it could not run."""

    route: str
    differences: List[str] = field(default_factory=list)
    error: Optional[str] = None
    within_noise: List[str] = field(default_factory=list)  # differ, but no more than eager from itself

    @property
    def matches(self) -> bool:
        return not self.differences and self.error is None

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.route}: {self.error}"
        if self.matches and self.within_noise:
            where = ", ".join(self.within_noise[:3]) + (", ..." if len(self.within_noise) > 3 else "")
            return (
                f"{self.route}: bit-identical but where the eager forward does not reproduce itself "
                f"({where}: within {NOISE_FACTOR:g}x its spread)"
            )
        if self.matches:
            return f"{self.route}: bit-identical"
        more = f" (and {len(self.differences) - 3} more)" if len(self.differences) > 3 else ""
        return f"{self.route}: " + "; ".join(self.differences[:3]) + more


class ProbeInterrupted(RuntimeError):
    """The probe could not conclude: the model's own forward raised (its error is the
    cause: the step's real forward will raise it too), or the ranks could not compare their
    verdicts (a collective failed: another rank has failed). Nothing is known of the capture."""


@dataclass
class Outcome:
    """The capture to track with (None: none reproduces the eager forward), each route's
    verdict, and, where none reproduces it, the first capture that ran on every rank
    (``differing``: it only rounds differently; a shadow pass can track with it)."""

    capture: Optional[Capture]
    verdicts: List[Verdict]
    differing: Optional[Capture] = None

    @property
    def switched(self) -> bool:
        return self.capture is not None and len(self.verdicts) > 1

    def describe(self) -> str:
        return "; ".join(v.describe() for v in self.verdicts)


def output_leaves(x: Any, name: str = "", depth: int = 0) -> Iterator[Tuple[str, Any]]:
    """(name, value) of every tensor and number in an output: ``loss``, ``logits``, ``[0]``."""
    if isinstance(x, Tensor) or isinstance(x, (bool, int, float, str)) or x is None:
        yield name, x
    elif isinstance(x, nn.Module) or depth > _DEPTH:
        return
    elif isinstance(x, dict) or (hasattr(x, "keys") and hasattr(x, "__getitem__")):
        for key in list(x.keys()):
            yield from output_leaves(x[key], f"{name}.{key}" if name else str(key), depth + 1)
    elif isinstance(x, (list, tuple)):
        for i, item in enumerate(x):
            yield from output_leaves(item, f"{name}[{i}]", depth + 1)
    elif hasattr(x, "__dict__"):  # plain result objects (also classes used as records)
        for key, value in vars(x).items():
            if not key.startswith("__"):
                yield from output_leaves(value, f"{name}.{key}" if name else key, depth + 1)


def _comparable(t: Tensor) -> Tensor:
    """A detached copy, dense: comparisons (``==``, ``isnan``) exist for strided tensors only
    (a sparse embedding's gradient, a sparse buffer)."""
    t = local_tensor(t.detach())  # (a DTensor: its local shard; DTensor ops would be collectives)
    return t.to_dense() if t.layout != torch.strided else t.clone()


def _snapshot(x: Any) -> Dict[str, Any]:
    return {k: _comparable(v) if isinstance(v, Tensor) else v for k, v in output_leaves(x, "")}


#: A route may differ from the reference where the eager forward differs from itself
#: (nondeterministic kernels: atomics on a GPU), by up to this many times its own spread.
NOISE_FACTOR = 4.0

_Difference = Tuple[str, str, float]  # (entry, how it differs, max |difference|; inf if not comparable)


def _difference(a: Tensor, b: Tensor) -> Optional[Tuple[str, float]]:
    """None where ``a`` and ``b`` are equal bit for bit (NaN where NaN), else how they
    differ and by how much at most."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return f"{a.dtype} {tuple(a.shape)} on {a.device} != {b.dtype} {tuple(b.shape)} on {b.device}", math.inf
    if torch.equal(a, b):
        return None
    if a.is_floating_point() or a.is_complex():
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return None
        gap = (a.double() - b.double()).abs()[~same]
        top = float(gap.max())
        finite = f", max |difference| {top:.3g}" if math.isfinite(top) else ""
        return f"{int((~same).sum()):,} of {a.numel():,} elements differ{finite}", top
    return f"{int((a != b).sum()):,} of {a.numel():,} elements differ", math.inf


def _differences(expected: Dict[str, Any], actual: Dict[str, Any], kind: str) -> List[_Difference]:
    out: List[_Difference] = []
    for key in sorted(set(expected) | set(actual)):
        what = f"{kind} `{key}`" if key else kind
        if key not in actual or key not in expected:
            out.append((what, f"{what} only in the {'eager' if key in expected else 'captured'} forward", math.inf))
            continue
        a, b = expected[key], actual[key]
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            found = _difference(a, b)
        elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            found = None
        else:
            found = None if type(a) is type(b) and (a == b) is True else (f"{a!r} != {b!r}", math.inf)
        if found is not None:
            out.append((what, f"{what} differs: {found[0]}", found[1]))
    return out


def compare(expected: Dict[str, Any], actual: Dict[str, Any], kind: str = "output") -> List[str]:
    """How ``actual`` differs from ``expected`` (both from ``_snapshot``), one line per entry."""
    return [message for _, message, _ in _differences(expected, actual, kind)]


def _gradients(root: nn.Module, out: Any) -> Dict[str, Any]:
    """Gradients of the outputs' sum with respect to the parameters, without touching
    ``.grad`` (``autograd.grad``): a loss hides what a changed forward does to them."""
    outputs = [
        v for _, v in output_leaves(out, "") if isinstance(v, Tensor) and v.requires_grad and v.is_floating_point()
    ]
    named = [(n, p) for n, p in root.named_parameters() if p.requires_grad]
    if not outputs or not named or not torch.is_grad_enabled():
        return {}
    try:
        grads = torch.autograd.grad(
            outputs, [p for _, p in named], [torch.ones_like(o) for o in outputs], allow_unused=True
        )
    except RuntimeError as err:  # reentrant checkpointing refuses `autograd.grad`
        raise _NoGradients(str(err)) from err
    return {n: _comparable(g) for (n, _), g in zip(named, grads) if g is not None}


class _NoGradients(RuntimeError):
    """The forward's graph cannot be differentiated with ``autograd.grad``."""


def _buffers(root: nn.Module) -> Dict[str, Any]:
    return {name: _comparable(b) for name, b in root.named_buffers()}


_Run = Tuple[Dict[str, Any], Dict[str, Any], Dict[str, Any]]  # outputs, buffers, gradients


def _all_differences(expected: _Run, actual: _Run) -> List[_Difference]:
    """Every difference; when there is none, one host read in all (on an accelerator,
    each ``torch.equal`` would be a read of its own)."""
    if _all_equal(expected, actual):
        return []
    return [
        d for kind, a, b in zip(("output", "buffer", "gradient of"), expected, actual) for d in _differences(a, b, kind)
    ]


def _all_equal(expected: _Run, actual: _Run) -> bool:
    flags: Dict[torch.device, List[Tensor]] = {}
    for a, b in zip(expected, actual):
        if a.keys() != b.keys():
            return False
        for key, x in a.items():
            y = b[key]
            if not (isinstance(x, Tensor) and isinstance(y, Tensor)):
                if _differences({key: x}, {key: y}, ""):
                    return False
            elif x.dtype != y.dtype or x.shape != y.shape or x.device != y.device:
                return False
            else:
                same = (
                    (x == y) | (torch.isnan(x) & torch.isnan(y)) if x.is_floating_point() or x.is_complex() else x == y
                )
                flags.setdefault(x.device, []).append(same.all().reshape(1))
    return all(bool(torch.cat(f).all()) for f in flags.values())  # (one read per device)


class _Reference:
    """The eager forward's outputs, buffers and gradients on the step's inputs; state put back."""

    def __init__(
        self, root: nn.Module, eager: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]
    ) -> None:
        self.root, self.eager, self.args, self.kwargs = root, eager, args, kwargs
        self.state = Snapshot(root)
        self._noise: Optional[Dict[str, float]] = None
        self.gradients = True
        try:
            self.expected = self._restored(eager, own=True)
        except _NoGradients:  # (reentrant checkpointing) outputs and buffers only, for every route
            self.gradients = False
            self.expected = self._restored(eager, own=True)

    def _restored(self, forward: Callable[..., Any], own: bool = False) -> _Run:
        """``forward``'s run from the saved state, then the state put back. ``own``: the
        model's own forward, whose error interrupts the probe (it is the step's error)."""
        try:
            try:
                out = forward(*self.args, **self.kwargs)
            except Exception as err:
                if own:
                    raise ProbeInterrupted(f"the model's own forward raised {failure_reason(err)}") from err
                raise
            return _snapshot(out), _buffers(self.root), _gradients(self.root, out) if self.gradients else {}
        finally:
            self.state.restore()

    def noise(self) -> Dict[str, float]:
        """Entry -> max |difference| between two eager runs from the same state (paid only
        when a route differs): where the eager forward does not reproduce itself."""
        if self._noise is None:
            self._noise = {what: gap for what, _, gap in _all_differences(self.expected, self._restored(self.eager))}
        return self._noise

    def check(self, route: str, captured: Callable[..., Any]) -> Verdict:
        try:
            found = _all_differences(self.expected, self._restored(captured))
        except Exception as err:  # noqa: BLE001 - a route that fails is a route that does not match
            return Verdict(route, error=f"raised {failure_reason(err)}")
        noise = self.noise() if found else {}
        within = [what for what, _, gap in found if what in noise and gap <= NOISE_FACTOR * noise[what]]
        return Verdict(route, [message for what, message, _ in found if what not in within], within_noise=within)


def verify(
    root: nn.Module,
    eager: Callable[..., Any],
    routes: Sequence[Tuple[str, Callable[[], Capture]]],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    agree: Callable[[bool], bool] = lambda ok: ok,
) -> Outcome:
    """The first route whose captured forward reproduces ``eager`` bit for bit.

    Args:
        root: the captured module (its state is saved and put back around every run).
        eager: the user's forward.
        routes: (route name, capture builder) in order of preference; a builder that
            raises is a route that does not match.
        args, kwargs: the step's inputs to the forward.
        agree: turns this process's verdict into every rank's (all must match), so all
            ranks track with the same route or none does.

    Returns:
        An ``Outcome``: the matching capture (None if none matches), every verdict and,
        where none matches, the first capture that ran on every rank (``differing``).
        Random number generators and module state are as they were before the call.

    Raises:
        ProbeInterrupted: ``eager`` raised, or ``agree`` did (the ranks cannot agree).
    """
    reference = _Reference(root, eager, args, kwargs)
    verdicts: List[Verdict] = []
    tried: List[Optional[Capture]] = []
    for route, build in routes:
        try:
            cap = build()
        except Exception as err:  # noqa: BLE001 - e.g. fx cannot trace the model
            verdict, cap = Verdict(route, error=f"could not capture ({failure_reason(err)})"), None
        else:
            verdict = reference.check(route, cap.tracked())
        verdicts.append(verdict)
        tried.append(cap if verdict.error is None else None)
        if _agreed(agree, verdict.matches) and cap is not None:
            return Outcome(cap, verdicts)
    for cap in tried:  # (one agreement per route on every rank: the same collectives everywhere)
        if _agreed(agree, cap is not None) and cap is not None:
            return Outcome(None, verdicts, differing=cap)
    return Outcome(None, verdicts)


def _agreed(agree: Callable[[bool], bool], ok: bool) -> bool:
    try:
        return agree(ok)
    except Exception as err:  # noqa: BLE001 - a collective that fails: a rank left (its error ends the fit)
        why = f"{type(err).__name__}: {str(err).strip()[:200]}"
        raise ProbeInterrupted(f"the ranks could not compare verdicts ({why}); another rank has likely failed") from err
