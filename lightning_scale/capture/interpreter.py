"""ScaleTrackingInterpreter, and the generated-code twin that the callback runs.

Two ways to run an ``fx.GraphModule`` while recording every floating-point intermediate
and its gradient:

* ``ScaleTrackingInterpreter``: an ``fx.Interpreter`` (node by node, overridable per
  node kind), with the API of ``unit_scaling.utils.ScaleTrackingInterpreter``.
* ``instrument``: a copy of the graph with a call to ``recorder.observe`` after each
  node, compiled to Python code by fx. Same records, near-eager speed; used on tracked
  training steps.

Override points of the interpreter::

    run / boxed_run
      run_node(n)            <- records n's value (forward) and hooks its gradient
        placeholder          <- resolves function placeholders of the deep tracer
        get_attr / call_function / call_method / call_module / output
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, fx

from lightning_scale.capture.gemm_sites import add_gemm_observer
from lightning_scale.record import stats
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, observe

__all__ = ["ScalePair", "ScaleTrackingInterpreter", "instrument", "scales_from_records"]


@dataclass
class ScalePair:
    """The std of a tensor in the forward pass and of its gradient in the backward pass."""

    forward: Optional[float] = None
    backward: Optional[float] = None

    def __str__(self) -> str:
        fwd = f"{self.forward:.3}" if self.forward is not None else "n/a"
        bwd = f"{self.backward:.3}" if self.backward is not None else "n/a"
        return f"(-> {fwd}, <- {bwd})"


class ScaleTrackingInterpreter(fx.Interpreter):
    """Runs an ``fx.GraphModule`` and records the statistics of every floating-point tensor.

    After ``run(*args)`` (and a backward pass through the output, if gradients are
    wanted), ``scales`` maps each node name to a ``ScalePair`` of stds (Bessel-corrected,
    as ``torch.std``), and ``statistics`` to every statistic of ``stats.STATISTICS``.
    Statistics stay on the tensors' device until one of those is read, in one transfer.

    Args:
        module: the module to run.
        groups: statistic groups to compute (``stats.GROUPS``); std needs only "moments".
        host_reads: see ``stats.record_of``; ``None`` decides by device.

    Example::

        >>> gm = fx.symbolic_trace(torch.nn.Linear(4, 4))
        >>> interp = ScaleTrackingInterpreter(gm)
        >>> interp.run(torch.randn(8, 4, requires_grad=True)).sum().backward()
        >>> list(interp.scales)  # the output node too, as the reference
        ['input_1', 'weight', 'bias', 'linear', 'output']
    """

    def __init__(
        self, module: fx.GraphModule, groups: Sequence[str] = ("moments", "range"), host_reads: Optional[bool] = None
    ) -> None:
        super().__init__(module)
        self.recorder = Recorder(groups, host_reads)

    def run(
        self, *args: Any, initial_env: Optional[Dict[fx.Node, Any]] = None, enable_io_processing: bool = True
    ) -> Any:
        """Run the graph; the records of an earlier run are dropped, as the reference's."""
        self.recorder.clear()
        return super().run(*args, initial_env=initial_env, enable_io_processing=enable_io_processing)

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, Tensor) and out.is_floating_point():
            self.recorder.observe(n.name, out)
        return out

    def boxed_run(self, args_list: List[Any]) -> Any:
        # Unlike fx's, record the placeholders too: they are inputs a user cares about.
        self.recorder.clear()
        env: Dict[fx.Node, Any] = {}
        args_iter = iter(args_list)
        for n in self.graph.nodes:
            if n.op != "placeholder":
                continue
            function = self._function_of(n.target)
            env[n] = next(args_iter) if function is None else function
            if isinstance(env[n], Tensor) and env[n].is_floating_point():
                self.recorder.observe(n.name, env[n])
        args_list.clear()
        return super().run(initial_env=env, enable_io_processing=False)

    def placeholder(self, target: fx.node.Target, args: Tuple[fx.node.Argument, ...], kwargs: Dict[str, Any]) -> Any:
        """Resolve function arguments that the deep tracer turned into placeholders."""
        function = self._function_of(target)
        return super().placeholder(target, args, kwargs) if function is None else function

    def _function_of(self, target: fx.node.Target) -> Optional[Callable[..., Any]]:
        extras = getattr(self.module.graph, "_tracer_extras", None) or {}
        return extras.get("target_to_function", {}).get(target) if isinstance(target, str) else None

    def records(self) -> Tensor:
        """``[nodes, 2, len(stats.FIELDS)]`` records on the device, in execution order."""
        return self.recorder.records()

    @property
    def scales(self) -> "OrderedDict[str, ScalePair]":
        """Node name -> ``ScalePair`` of forward and backward std (one device read)."""
        return scales_from_records(self.recorder.keys, self.records().cpu())  # type: ignore[arg-type]

    @property
    def statistics(self) -> "OrderedDict[str, Dict[str, Dict[str, float]]]":
        """Node name -> {"forward": {stat: value}, "backward": {...}} (one device read)."""
        recs = self.records().cpu()
        out: "OrderedDict[str, Dict[str, Dict[str, float]]]" = OrderedDict()
        for key, rec in zip(self.recorder.keys, recs):
            out[str(key)] = {
                d: stats.summarise(rec[i]) for d, i in (("forward", FORWARD), ("backward", BACKWARD)) if rec[i, 0] > 0
            }
        return out


def scales_from_records(keys: Sequence[str], records: Tensor) -> "OrderedDict[str, ScalePair]":
    """``ScalePair`` per key from host records ``[len(keys), 2, FIELDS]``."""
    std = stats.statistic(records, "std").tolist()
    present = (records[..., 0] > 0).tolist()
    return OrderedDict(
        (k, ScalePair(s[0] if p[0] else None, s[1] if p[1] else None)) for k, s, p in zip(keys, std, present)
    )


class _LiveRoot:
    """``self`` for generated graph code: attributes resolve on the live module first.

    Graph code reads ``self.fc1.weight`` and calls ``self.bn(x)``; resolving them on the
    live module at run time keeps parameters current (also when a wrapper swaps them)
    and keeps every module's ``__call__`` hooks.
    """

    def __init__(self, live: torch.nn.Module, graph_module: fx.GraphModule) -> None:
        self._live = live
        self._gm = graph_module

    def __getattr__(self, name: str) -> Any:
        try:
            return getattr(self._live, name)
        except AttributeError:
            return getattr(self._gm, name)  # constants created while tracing


def instrument(
    gm: fx.GraphModule,
    labels: Mapping[str, Hashable],
    live: Optional[torch.nn.Module] = None,
    observer: Callable[[Any, Any], None] = observe,
) -> Callable[..., Any]:
    """Compile ``gm`` with an ``observer(value, label)`` call after each labelled node (and an
    ``observe_gemm`` call after each GEMM node, for the precision advisor: ``gemm_sites``).

    Args:
        gm: the graph module.
        labels: node name -> key under which its value is recorded; nodes not in it are
            not observed.
        live: resolve ``self.<path>`` in the graph code on this module at run time
            (default: ``gm`` itself).
        observer: the function called after each labelled node (default
            ``recorder.observe``; dynamo graphs resolve labels per call instead).

    Returns:
        A function with ``gm.forward``'s signature. It records into the active
        recorder (``recorder.recording``) and is a plain run of the graph without one.
    """
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        new = graph.node_copy(node, lambda n: env[n])
        env[node] = new
        if node.name in labels and node.op != "output":
            graph.call_function(observer, (new, labels[node.name]))
        add_gemm_observer(graph, node, new, lambda n: env[n])
    graph.set_codegen(gm.graph._codegen)  # keep pytree in/out handling
    code_gm = fx.GraphModule(gm, graph)
    forward = type(code_gm).forward
    root: Any = _LiveRoot(live, code_gm) if live is not None else code_gm

    def run(*args: Any, **kwargs: Any) -> Any:
        return forward(root, *args, **kwargs)

    run.graph_module = code_gm  # type: ignore[attr-defined]
    return run
