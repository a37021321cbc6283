"""Captures: the callback's captures of its target module, and what was concluded of them.

One ``Capture`` per combination of the modules' training flags (fx bakes ``training`` into a
graph), built on first use with the user's route and leaf modules; the fidelity probe's
bookkeeping (``verification.Verification``) and what the callback does with its outcome
(track with the capture it chose, in place or by a shadow pass, or switch tracking off
saying why); the selected and replicated labels of each capture, computed once.
``ScaleMonitor`` owns one ``Captures``; nothing here imports Lightning: the callback passes
how to log and how ranks agree.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from torch import nn

from lightning_scale.record.settings import Settings
from lightning_scale.capture import Capture, capture
from lightning_scale.step.selection import Selection
from lightning_scale.step.tracked_step import fsdp_units, replicated_labels
from lightning_scale.step.verification import ONE_BACKWARD_STRATEGIES, CaptureCheck, Verification, Verify

__all__ = ["Captures"]

Log = Callable[[str], None]


class Captures:
    """The captures of one target module, the probe's verdicts on them, and their labels.

    Args:
        mode: the capture route (``capture.CAPTURE_MODES``).
        leaf_modules: qualified names of submodules kept as fx leaves.
        verify: run the fidelity probe on each capture's first tracked step.
        selection: which labels are written (``include``/``exclude``/``prune_views``).
        groups: the statistic groups recorded (compiled submodules compute them in their graphs).
        info, warn: how to log a line and how to warn (rank zero only, from the callback).
        shadow: ``"auto"``: a capture the probe refuses in place (no route reproduces the
            forward, one runs) is tracked by a shadow pass; ``"always"``: every capture is;
            ``"never"``: none (a refused capture trains untracked).
    """

    def __init__(
        self,
        *,
        mode: str,
        leaf_modules: List[str],
        verify: bool,
        selection: Selection,
        info: Log,
        warn: Log,
        groups: Sequence[str] = ("moments", "range"),
        shadow: str = "auto",
    ) -> None:
        self.mode, self.leaf_modules, self.selection, self.shadow = mode, leaf_modules, selection, shadow
        self.groups = tuple(groups)
        #: the environment switches, set where the fit starts (None: read when a capture is made)
        self.settings: Optional[Settings] = None
        self.verification = Verification(verify)
        self.info, self.warn = info, warn
        self.disabled: Optional[str] = None  # why tracking is off for this run, once it is
        self._table: Dict[Tuple[bool, ...], Capture] = {}
        # per capture: (the capture, its graphs' label count, selected labels, replicated labels)
        self._labels: Dict[int, Tuple[Capture, int, List[str], Set[str]]] = {}

    def values(self) -> Iterator[Capture]:
        """Every capture made so far."""
        return iter(list(self._table.values()))

    def forget_unless_of(self, target: nn.Module) -> None:
        """A new run on another module: forget the captures, verdicts and labels of the old."""
        if any(cap.module is not target for cap in self._table.values()):
            self._table.clear()
            self._labels.clear()
            self.verification.clear()
            self.disabled = None

    def of(self, target: nn.Module, train: bool, announce: bool = False) -> Optional[Capture]:
        """The capture of ``target`` in its current training flags (all in training mode
        when ``train``), made on first use; None, and tracking off, where none can be made."""
        flags = {m: m.training for m in target.modules()}
        if train and not target.training:
            target.train()
        key = tuple(m.training for m in target.modules())
        try:
            if key not in self._table:
                self._table[key] = self.new(target)
                if announce:
                    self.info(f"ScaleMonitor: captured {type(target).__name__}: {self._table[key].describe()}")
            return self._table[key]
        except Exception as err:  # noqa: BLE001 - a model we cannot capture trains untracked
            self.disable(f"could not capture {type(target).__name__} ({type(err).__name__}: {err})")
            return None
        finally:
            for m, flag in flags.items():
                m.training = flag

    def new(self, target: nn.Module, mode: Optional[str] = None) -> Capture:
        """A new capture of ``target`` by ``mode`` (default: the user's route)."""
        units = fsdp_units(target)
        cap = capture(
            target,
            mode or self.mode,
            leaf_modules=self.leaf_modules,
            units=units,
            groups=self.groups,
            settings=self.settings,
        )
        cap.shadowed = self.shadow == "always"
        return cap

    def disable(self, why: str) -> None:
        """Switch tracking off for this run, with one warning saying why."""
        self.disabled = why
        self.warn(f"ScaleMonitor: {why}; training continues untracked.")

    def verifier(
        self, target: nn.Module, cap: Capture, strategy: str, agree: Callable[[bool], bool]
    ) -> Optional[Verify]:
        """The fidelity probe for this step's first forward, if ``cap`` is still unchecked
        (``strategy``: the strategy's class name; ``agree``: True on every rank iff on all)."""
        if cap.shadowed or not self.verification.probes(cap, strategy):
            return None
        return self.verification.verifier(target, lambda mode: self.new(target, mode), agree, self.shadow == "auto")

    def trackable(self, cap: Capture, strategy: str) -> bool:
        """Whether a step can be tracked with ``cap`` under ``strategy`` (its class name): not
        by a shadow pass where backward hooks expect one backward per forward (tracking is
        switched off, saying why)."""
        if cap.shadowed and strategy in ONE_BACKWARD_STRATEGIES:
            self.disable(
                f"a shadow pass (`shadow={self.shadow!r}`) cannot run under {strategy}, whose backward hooks "
                "expect one backward per forward"
            )
            return False
        return True

    def act_on(self, check: Optional[CaptureCheck]) -> None:
        """Act on the probe's outcome: track with the capture it chose, or switch tracking
        off saying why. An interrupted check (the model's forward raised, or another rank
        failed) concludes nothing and claims nothing."""
        if check is None:
            return
        if check.kind == "interrupted":
            self.info(f"ScaleMonitor: {check.why}")
            return
        self.verification.settle(check)
        if check.kind == "failed":
            self.disable(check.why)
            return
        if check.kind == "shadowed" and check.capture is not None:
            check.capture.shadowed = True
        if check.kind in ("switched", "shadowed") and check.capture is not None:
            new = check.capture
            self._table = {k: (new if v is check.checked else v) for k, v in self._table.items()}
        self.info(check.why)

    def labels_of(self, cap: Capture, target: nn.Module) -> Tuple[List[str], Set[str]]:
        """The selected labels of ``cap`` and the replicated ones (parameters, buffers),
        computed once per capture (~0.5 ms of module walks a tracked step otherwise),
        again when a recompile adds graphs to it."""
        size = sum(len(labels) for labels in cap.labels)
        seen = self._labels.get(id(cap))
        if seen is None or seen[0] is not cap or seen[1] != size:
            seen = self._labels[id(cap)] = (cap, size, self.selection.labels(cap), replicated_labels(target))
        return seen[2], seen[3]
