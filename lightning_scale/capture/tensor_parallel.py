"""Tensor parallelism in a captured graph: which nodes' values each rank records.

A model parallelized with ``torch.distributed.tensor.parallel`` (``ColwiseParallel``,
``RowwiseParallel``, ...) runs its parallel modules on ``DTensor`` values, and their hooks
turn plain local tensors into DTensors (``DTensor.from_local``) and back (``to_local``,
``redistribute``). TorchDynamo traces those hooks into the graph, so the graph says, node
by node, what each value is:

* a DTensor node carries its placements: the recorder records this rank's part of it
  (``record.placements``);
* a DTensor conversion (``from_local``, ``redistribute``, ``to_local``) holds the same
  logical tensor as its input: it is an alias of its input (its only user). When the
  input is ``Partial`` (a row-parallel matmul before its all-reduce), the conversion's
  reduced value is recorded under the input's label instead of the partial sums;
* a plain tensor is a local shard when it is computed from the local output of a sharded
  DTensor (``to_local`` of ``Shard``: a column-parallel layer's output with
  ``use_local_output=True``), directly or through other plain ops; every other plain
  tensor (the embedding's output, a row-parallel layer's all-reduced output, the head's)
  is the same on every rank of the mesh: only the rank at coordinate 0 records it;
* a plain input of a graph that is not the model's own input (a value from before a graph
  break) has the placement that the parallel layers of the graph declare for it: a
  ``from_local`` of it, directly or through ops of one such input (``RowwiseParallel``'s
  input hook: ``Shard(-1)``). Where none does, it has the placement its value had where it
  left an earlier graph of the same forward (``left``: a replica, or a shard); a value no
  graph returned (the model's own input where an FSDP2 unit's hooks broke the graph before
  it, a tensor made by eager code at a break) descends from no parallel layer's output while
  no local shard has left a graph of the forward: a replica. Else its placement is unknown,
  and so is that of every plain tensor computed from it and no shard: those nodes are not
  recorded on any rank (``UNKNOWN``: the coverage line and one warning name them), never
  half counted.

A graph that computes no DTensor (all of it after a graph break) takes the mesh of the
model's parallel layers. Nothing here compares values across ranks: the placements decide.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, fx, nn

from lightning_scale.record.placements import first_beyond, first_of_replicas, is_distributed

__all__ = [
    "UNKNOWN",
    "TensorParallelGraph",
    "distributed_modules",
    "local_tensor",
    "mesh_line",
    "meshes_of",
    "new_forward",
    "parallel_mesh",
]

_CONVERSIONS = {"from_local", "to_local", "redistribute", "full_tensor"}
_SHARD, _REPLICA, _UNKNOWN = "shard", "replica", "unknown"  # a plain node's placement
#: why a node is recorded on no rank (``Recorder.skipped``)
UNKNOWN = "placement unknown (computed from a value of before a graph break that no parallel layer declares)"
#: plain tensors a graph of this forward returned, by id: (a weak reference to it, its placement there)
_LEFT: Dict[int, Tuple[Any, str]] = {}
_SHARD_LEFT: List[bool] = [False]  # whether a graph of this forward returned a local shard


def new_forward() -> None:
    """A tracked forward starts: no value has left a graph of it yet."""
    _LEFT.clear()
    _SHARD_LEFT[0] = False


def _arriving(x: Any) -> str:
    """The placement of a plain value that enters a graph from before a graph break: the one
    it had where a graph of this forward returned it; else (made by eager code, or the
    model's input) a replica while no shard has left a graph, unknown after one has."""
    entry = _LEFT.get(id(x)) if isinstance(x, Tensor) else None
    if entry is not None and entry[0]() is x:
        return entry[1]
    return _UNKNOWN if _SHARD_LEFT[0] else _REPLICA


def _leaving(x: Tensor, kind: str) -> None:
    _LEFT[id(x)] = (weakref.ref(x), kind)
    _SHARD_LEFT[0] = _SHARD_LEFT[0] or kind == _SHARD


@dataclass(frozen=True)
class _Placed:
    """The placements of a graph's plain nodes for one set of input placements."""

    status: Dict[str, str]
    replicas: frozenset
    unknown: frozenset


def local_tensor(t: Tensor) -> Tensor:
    """``t``'s local tensor if it is a DTensor (compared shard by shard), else ``t``."""
    return t.to_local() if is_distributed(t) else t  # type: ignore[attr-defined]


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _is_conversion(node: fx.Node) -> bool:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name in _CONVERSIONS


def _source(node: fx.Node) -> Optional[fx.Node]:
    return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None


def _partial(node: fx.Node) -> bool:
    value = _value(node)
    return is_distributed(value) and any(p.is_partial() for p in value.placements)


def _sharded_local(node: fx.Node) -> bool:
    """A ``to_local`` (or local output) of a DTensor with a ``Shard`` placement."""
    src = _source(node)
    value = _value(src) if src is not None else None
    return (
        node.op == "call_method"
        and node.target == "to_local"
        and is_distributed(value)
        and any(p.is_shard() for p in value.placements)
    )


class TensorParallelGraph:
    """What tensor parallelism means for one dynamo graph ``gm``.

    Args:
        gm: the graph.
        mesh: the mesh of the model's parallel layers, for a graph that computes no DTensor.
        inputs: placeholders whose placement the graph cannot know from where they come
            (activations from before a graph break; not the model's inputs or parameters).

    Attributes:
        mesh: the device mesh of the graph's DTensors (None: the graph has none and the
            model no parallel layer, and every node is recorded as before).
        aliases: node -> node holding the same logical tensor (DTensor conversions).
        reduced: conversion -> the ``Partial`` node whose reduced value it holds.
        hidden: conversions that are neither (``from_local`` of a tensor with other users:
            its gradient is this user's partial sum); not nodes of the model, not labelled.
        replicas: plain-tensor nodes every rank of ``mesh`` holds whole and equal (before a
            call places the inputs no parallel layer declares: ``begin``).
        unknown: plain-tensor nodes whose placement is unknown: recorded on no rank (idem).
    """

    def __init__(self, gm: fx.GraphModule, mesh: Any = None, inputs: Set[str] = frozenset()) -> None:
        found = _mesh_of(gm)
        self.mesh = found if found is not None else mesh
        self.aliases: Dict[str, str] = {}
        self.reduced: Dict[str, str] = {}
        self.replicas: Set[str] = set()
        self.unknown: Set[str] = set()
        self.hidden: Set[str] = set()
        self._open: List[Tuple[int, str]] = []  # (argument index, name) of inputs placed at run time
        if self.mesh is None:
            return
        self.aliases, self.reduced = _conversion_aliases(gm)
        self.hidden = {n.name for n in gm.graph.nodes if _is_conversion(n) and n.name not in self.aliases}
        self._gm = gm
        unknown = {name: _UNKNOWN for name in inputs}
        self._start = {**unknown, **_declared(gm, _statuses(gm, unknown))}
        index = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        self._open = [(index[n], n) for n in sorted(inputs) if self._start[n] == _UNKNOWN and n in index]
        returned = gm.graph.output_node().args[0]
        self._returned = (
            [a.name if isinstance(a, fx.Node) else None for a in returned]
            if isinstance(returned, (tuple, list))
            else []
        )
        self._cache: Dict[Tuple[str, ...], _Placed] = {}
        self._now = self._placed(tuple(_UNKNOWN for _ in self._open))
        self.replicas, self.unknown = set(self._now.replicas), set(self._now.unknown)

    def _placed(self, kinds: Tuple[str, ...]) -> _Placed:
        if kinds not in self._cache:
            status = _statuses(self._gm, {**self._start, **{n: k for (_, n), k in zip(self._open, kinds)}})
            replicas = frozenset(n for n, s in status.items() if s == _REPLICA)
            self._cache[kinds] = _Placed(status, replicas, frozenset(n for n, s in status.items() if s == _UNKNOWN))
        return self._cache[kinds]

    def begin(self, args: Tuple[Any, ...]) -> None:
        """A call with ``args``: the inputs no parallel layer of the graph declares take the
        placement they had where they left an earlier graph (``_arriving``)."""
        if self._open:
            self._now = self._placed(tuple(_arriving(args[i]) if i < len(args) else _UNKNOWN for i, _ in self._open))

    def left(self, out: Any) -> None:
        """The call returned ``out`` (the graph's outputs, in order): its plain tensors keep
        their placement for the graphs after a break."""
        if self.mesh is None or not isinstance(out, (tuple, list)):
            return
        for name, value in zip(self._returned, out):
            kind = self._now.status.get(name) if name is not None else None
            if kind is not None and isinstance(value, Tensor) and not is_distributed(value):
                _leaving(value, kind)

    def observer(
        self, observe: Callable[..., None], skip: Callable[[Any, str, str], None]
    ) -> Callable[[Any, str], None]:
        """``observe(x, name, forward=True)`` for this graph: replicas at coordinate 0 of the
        mesh only, partial sums not at all, and their reduced values under their own node's
        name; ``skip(x, name, why)`` for the nodes of unknown placement. A plain parameter
        (a leaf) is one value on every data-parallel replica too, but its gradient is each
        replica's own: its value is recorded at coordinate 0 of the root mesh's other dims,
        its gradient at every one."""
        if self.mesh is None:
            return observe
        mesh, reduced = self.mesh, dict(self.reduced)
        partial = frozenset(reduced.values())

        @torch.compiler.disable
        def run(x: Any, name: str) -> None:
            replicas = self._now.replicas
            if name in self._now.unknown:
                skip(x, name, UNKNOWN)
                return
            if name in partial or (name in replicas and not first_of_replicas(mesh)):
                return
            leaf = name in replicas and isinstance(x, Tensor) and x.is_leaf and x.requires_grad
            observe(x, reduced.get(name, name), not leaf or first_beyond(mesh))

        return run


def _mesh_of(gm: fx.GraphModule) -> Any:
    """The mesh of the first DTensor the graph computes (not of an input: FSDP2 alone hands
    a graph sharded parameters, and its activations are every rank's own)."""
    for node in gm.graph.nodes:
        value = _value(node)
        if node.op != "placeholder" and is_distributed(value):
            return value.device_mesh
    return None


def _conversion_aliases(gm: fx.GraphModule) -> Tuple[Dict[str, str], Dict[str, str]]:
    """(conversion -> its input, where the conversion is the input's only user: one logical
    tensor, forward and backward; conversion -> its ``Partial`` input, which it reduces)."""
    aliases: Dict[str, str] = {}
    reduced: Dict[str, str] = {}
    for node in gm.graph.nodes:
        src = _source(node)
        if not _is_conversion(node) or src is None or len(src.users) != 1 or src.op == "placeholder":
            continue
        if _partial(src) and not _partial(node):
            reduced[node.name] = src.name
        if not _partial(src) or not _partial(node):
            aliases[node.name] = src.name
    return aliases, reduced


def _statuses(gm: fx.GraphModule, start: Dict[str, str]) -> Dict[str, str]:
    """Plain node -> its placement: a shard where computed from one, else unknown where
    computed from an unknown input, else a replica."""
    status: Dict[str, str] = {}
    for node in gm.graph.nodes:
        value = _value(node)
        if node.op == "output" or is_distributed(value):
            continue
        if node.name in start and (value is None or isinstance(value, Tensor)):
            status[node.name] = start[node.name]
        elif isinstance(value, Tensor):
            found = {status.get(n.name) for n in node.all_input_nodes}
            sharded = _sharded_local(node) or _SHARD in found
            status[node.name] = _SHARD if sharded else _UNKNOWN if _UNKNOWN in found else _REPLICA
    return status


def _declared(gm: fx.GraphModule, status: Dict[str, str]) -> Dict[str, str]:
    """Unknown input -> the placement a ``from_local`` on a 1-D mesh declares for a value
    computed from it alone (through ops of one unknown input each); where declarations
    disagree, none."""
    found: Dict[str, Set[str]] = {}
    for node in gm.graph.nodes:
        src, value = _source(node), _value(node)
        if not _is_conversion(node) or src is None or status.get(src.name) != _UNKNOWN:
            continue
        if not is_distributed(value) or value.device_mesh.ndim != 1:
            continue
        placement = value.placements[0]
        kind = _SHARD if placement.is_shard() else _REPLICA if placement.is_replicate() else None
        root = _unknown_root(src, status)
        if kind is not None and root is not None:
            found.setdefault(root, set()).add(kind)
    return {name: kinds.pop() for name, kinds in found.items() if len(kinds) == 1}


def _unknown_root(node: fx.Node, status: Dict[str, str]) -> Optional[str]:
    """The input whose placement decides ``node``'s, followed through nodes with one unknown input."""
    while node.op != "placeholder":
        unknown = [n for n in node.all_input_nodes if status.get(n.name) == _UNKNOWN]
        if len(unknown) != 1:
            return None
        node = unknown[0]
    return node.name


def meshes_of(module: nn.Module) -> List[Any]:
    """The distinct device meshes of ``module``'s DTensor parameters, in order."""
    out: List[Any] = []
    for p in module.parameters():
        if is_distributed(p) and all(m is not p.device_mesh for m in out):  # type: ignore[attr-defined]
            out.append(p.device_mesh)  # type: ignore[attr-defined]
    return out


def mesh_line(meshes: List[Any]) -> str:
    """``DTensor mesh dims: tensor_parallel=2`` (each named dimension once, with its size)."""
    seen: Dict[str, int] = {}
    for mesh in meshes:
        names = getattr(mesh, "mesh_dim_names", None) or tuple(f"dim{i}" for i in range(mesh.ndim))
        for name, size in zip(names, mesh.shape):
            seen.setdefault(name, size)
    return "DTensor mesh dims: " + ", ".join(f"{n}={s}" for n, s in seen.items())


def distributed_modules(root: nn.Module) -> List[str]:
    """Paths of the submodules that ``torch.distributed.tensor.distribute_module`` (under
    every ``ParallelStyle`` of ``parallelize_module``) gave input or output hooks. fx runs
    them as leaves, whose local outputs carry no placement: only dynamo records them exactly."""
    out = []
    for path, m in root.named_modules():
        hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]  # (torch's own tables)
        if any(getattr(h, "__qualname__", "").startswith("distribute_module.") for h in hooks):
            out.append(path)
    return out


def parallel_mesh(root: nn.Module) -> Any:
    """The device mesh the first parallel layer of ``root`` (``distributed_modules``) runs
    its activations on, as its ``ParallelStyle`` was given it (None: no parallel layer)."""
    for m in root.modules():
        for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]:  # (torch's own tables)
            if getattr(hook, "__qualname__", "").startswith("distribute_module."):
                cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
                if "device_mesh" in cells:
                    return cells["device_mesh"].cell_contents
    return None
