"""Frames: labels of TorchDynamo graphs, resolved per calling module instance at run time.

Dynamo compiles one graph per frame (and per graph break); node paths in a graph are
relative to the frame's locals (``L['self'].fc``). A frame compiled for one block is
reused, unguarded, for the next block of the same class (a resume function after a graph
break guards on nothing of ``self``). So labels cannot be fixed at compile time: each call
of a graph finds the module objects behind its locals in the calling Python frame, maps
them to full paths in the captured module (by identity), and observes under those labels.

Also here: the exact replay of activation checkpointing (dynamo's eager replay does not
restore the RNG state) and the module-output map (``model.fc1`` -> its last node).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import torch
from torch import fx, nn

from lightning_scale.capture import breaks
from lightning_scale.capture.labels import indexed_item, indexing_name, is_indexing, subscript_source
from lightning_scale.record import recorder

__all__ = [
    "FrameGraph",
    "Labeller",
    "exact_checkpoint",
    "label_of",
    "module_paths",
    "observe_node",
    "skip_node",
    "strip_compiled",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_ROOT = re.compile(r"^L\['([^']+)'\]((?:\[\d+\])*)")
_TABLES: List[Dict[str, str]] = []  # node name -> label, for the graph now running
_INTERNAL_INPUT = re.compile(r"^(stack\d*|___.*|nested_frame_values.*|args_\d+|.*_stack\d+.*)$")


def strip_compiled(path: str) -> str:
    """``block._orig_mod.0`` -> ``block.0``: a compiled submodule keeps its user's path."""
    return re.sub(r"(^|\.)_orig_mod(\.|$)", lambda m: m.group(1) if m.group(2) else "", path).strip(".")


def module_paths(root: nn.Module) -> Dict[int, str]:
    """id(module) -> its first path in ``root`` (``_orig_mod`` removed); root is ``""``."""
    out: Dict[int, str] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        out.setdefault(id(m), strip_compiled(name))
    return out


@torch.compiler.disable
def observe_node(x: Any, name: str, forward: bool = True) -> None:
    """Observe ``x`` under the label the running graph's table gives node ``name``
    (``forward=False``: its gradient only)."""
    if _TABLES and recorder.active() is not None:
        label = _TABLES[-1].get(name)
        if label is not None:
            recorder.observe(x, label, forward)


@torch.compiler.disable
def skip_node(x: Any, name: str, why: str) -> None:
    """Record nothing of node ``name``'s value ``x`` nor of its gradient, and say why
    (``Recorder.skipped``: the coverage line and one warning name it)."""
    rec = recorder.active()
    label = _TABLES[-1].get(name) if _TABLES else None
    if rec is None or label is None or not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return
    rec.skipped[(label, recorder.FORWARD)] = why
    if x.requires_grad and torch.is_grad_enabled():
        rec.skipped[(label, recorder.BACKWARD)] = why


def exact_checkpoint(body: Callable[..., Any], *args: Any, use_reentrant: bool = False, **_: Any) -> Any:
    """Activation checkpointing as the user's eager call runs it: the RNG state is saved
    and restored for the recompute, so dropout masks match (dynamo's eager replay of
    ``tag_activation_checkpoint`` passes ``preserve_rng_state=False``)."""
    return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=use_reentrant, preserve_rng_state=True)


class _Body(nn.Module):
    """A checkpointed body as a submodule of the graph, running its instrumented code."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass
class NodeSite:
    """Where a node sits: frame local its module path starts from, path under it, op."""

    name: str
    root: Optional[str]
    path: str
    op: str
    source: str
    is_attr: bool = False
    origin: str = ""  # an item of a tuple output (``chunk[0]``): the tuple's node; ``index`` its ``[0]``
    index: str = ""


@dataclass
class FrameGraph:
    """One dynamo graph, its nodes' sites and the module calls it ends."""

    gm: fx.GraphModule
    sites: List[NodeSite]
    outputs: List[Tuple[Optional[str], str, str]] = field(default_factory=list)  # (root, path, node)
    views: Dict[str, str] = field(default_factory=dict)  # node -> node with equal statistics
    # node -> a graph input whose tensor it returns itself: the compiled route records the input
    stand_ins: Dict[str, str] = field(default_factory=dict)
    # node -> recorded node that returned the same tensor: the compiled route logs its row twice
    copies: Dict[str, str] = field(default_factory=dict)
    code: Optional[breaks.CodeKey] = None  # the code dynamo compiled into the graph (``breaks.running_frame``)
    _roots: Optional[List[str]] = field(default=None, init=False, repr=False, compare=False)
    _anchors: Optional[Dict[str, Tuple[int, str]]] = field(default=None, init=False, repr=False, compare=False)

    def roots(self) -> List[str]:
        """The frame locals the graph's sites and module outputs start from (sorted; worked
        out on the first call: a graph's sites do not change once it is handed over)."""
        if self._roots is None:
            self._roots = sorted({s.root for s in self.sites if s.root} | {r for r, _, _ in self.outputs if r})
        return self._roots

    def anchors(self) -> Dict[str, Tuple[int, str]]:
        """root local -> (input index, path under it) of a parameter or buffer read from it:
        the tensor's full name at run time says which module the local is (worked out on
        the first call: each run of the graph asks)."""
        if self._anchors is None:
            index = {n.name: i for i, n in enumerate(n for n in self.gm.graph.nodes if n.op == "placeholder")}
            out: Dict[str, Tuple[int, str]] = {}
            for site in self.sites:
                if site.is_attr and site.root and site.name in index:
                    out.setdefault(site.root, (index[site.name], site.path))
            self._anchors = out
        return self._anchors


def _site_path(stack_path: str) -> Tuple[Optional[str], str]:
    m = _ROOT.match(stack_path)
    if m is None:
        return None, ""
    rest = stack_path[m.end() :]
    root = _root_key(m.group(1) + "_" + "_".join(re.findall(r"\d+", m.group(2))))
    rest = re.sub(r"getattr\((.*), '([^']+)'\)", r"\1.\2", rest)
    rest = re.sub(r"\[(\d+)\]", r".\1", rest)
    rest = re.sub(r"\['([^']+)'\]", r".\1", rest)
    parts = [p for p in rest.split(".") if p and p not in _INTERNAL_ATTRS]
    return root, strip_compiled(".".join(parts))


def _root_key(name: str) -> str:
    """One spelling of a frame local for stack paths and placeholder names:
    ``L['___stack'][0][1]`` and ``L___stack_0_1_modules_...`` both give ``stack_0_1``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


def _source(node: fx.Node) -> str:
    trace = str(node.meta.get("stack_trace") or "")
    lines = re.findall(r'File "([^"]+)", line (\d+)', trace)
    return f"{lines[-1][0]}:{lines[-1][1]}" if lines else ""


_INTERNAL_ATTRS = {"__dict__", "__self__", "_modules", "_parameters", "_buffers"}
_ATTR = re.compile(r"^[Ll]_(.+?)_((?:modules|parameters|buffers)_.*?)_?$")


def _placeholder_site(node: fx.Node) -> Optional[NodeSite]:
    target = str(node.target)
    m = _ATTR.match(target)
    if m:
        parts = re.split(r"_(?:modules|parameters|buffers)_", "_" + m.group(2))
        parts = [re.sub(r"_+dict_*$", "", p) for p in parts]  # `__dict__` hops of the source
        return NodeSite(node.name, _root_key(m.group(1)), strip_compiled(".".join(p for p in parts if p)), "", "", True)
    name = target[2:-1] if target[:2] in ("L_", "l_") and target.endswith("_") else target
    if _INTERNAL_INPUT.match(name):
        return None  # a graph-break resume input: recorded where it was produced
    return NodeSite(node.name, None, "", name, "")


def _innermost_local(node: fx.Node) -> Tuple[Optional[str], str]:
    """(root, path) of the innermost module call of ``node`` held by the frame's locals. A
    module held in a global is no submodule of the captured module (transformers' kernel hub
    wraps functions such as ``apply_rotary_pos_emb`` in one): its ops sit in the module that
    called it (``self_attn/mul``)."""
    for stack_path, _ in reversed(list(breaks.module_stack(node).values())):
        root, path = _site_path(str(stack_path))
        if root is not None:
            return root, path
    return None, ""


def _op_site(node: fx.Node, op_name: Callable[[fx.Node], str]) -> NodeSite:
    """An op's site; an item of a tuple output sits where its source does, as ``source[i]``;
    a slice or index is named as written (``pos[:T]``: ``labels.subscript_source``), else
    after its source and index (``x[0]``)."""
    item = indexed_item(node, lambda n: isinstance(n.meta.get("example_value"), (tuple, list)))
    source = node if item is None else item[0]
    root, path = _innermost_local(source)
    op = op_name(source)
    if item is None and is_indexing(node):
        op = subscript_source(str(node.meta.get("stack_trace") or "")) or indexing_name(node, _dynamo_name_of)
    site = NodeSite(node.name, root, path, op, _source(source))
    if item is not None:
        site.origin, site.index = source.name, item[1]
    return site


def _dynamo_name_of(node: fx.Node) -> str:
    """A dynamo node's short name: an attribute's path under its frame local, an input's name,
    else the variable dynamo named it after (``h_1`` -> ``h``)."""
    site = _placeholder_site(node) if node.op == "placeholder" else None
    if site is not None:
        return site.path if site.is_attr else site.op
    return re.sub(r"_\d+$", "", node.name)


def _under_transform(gm: fx.GraphModule) -> Set[fx.Node]:
    """Nodes computed inside a functorch transform that dynamo inlined (``vmap``, as in
    ``associative_scan`` of transformers' Mamba under dynamo): between its
    ``_vmap_increment_nesting`` and ``_vmap_decrement_nesting`` calls, values are batched
    views of one vmap level. Recording them there is an escape from the transform (eagerly),
    or an autograd Function under vmap (compiled): they are left out."""
    inside: Set[fx.Node] = set()
    depth = 0
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
        if name.endswith("_increment_nesting"):
            depth += 1
        elif name.endswith("_decrement_nesting"):
            depth = max(depth - 1, 0)
        elif depth:
            inside.add(node)
    return inside


def node_sites(
    gm: fx.GraphModule, op_name: Callable[[fx.Node], str], prefix: str = "", resume: bool = False
) -> List[NodeSite]:
    """Sites of the tensor nodes of ``gm`` (node names prefixed for checkpoint bodies);
    a resume frame's inputs were recorded where they were produced, before the break."""
    if not prefix:
        breaks.resumed_module_frames(gm)  # (ops of a module's frame resumed after a break: under it)
    sites = []
    transformed = _under_transform(gm)
    for node in gm.graph.nodes:
        if node.op in ("output", "get_attr") or node in transformed:
            continue
        if node.op == "placeholder":
            value = node.meta.get("example_value", node.meta.get("grapharg"))
            tensor = (
                value is None
                or isinstance(value, torch.Tensor)
                or isinstance(getattr(value, "example", None), torch.Tensor)
            )
            site = None if prefix or not tensor else _placeholder_site(node)
            site = None if site is None or (resume and not site.is_attr) else site
        elif isinstance(node.meta.get("example_value"), torch.Tensor) or prefix:
            site = _op_site(node, op_name)
        else:
            site = None
        if site is not None:
            site.name = prefix + site.name
            sites.append(site)
    return sites


def module_outputs(
    gm: fx.GraphModule,
    prefix: str = "",
    parse: Callable[[str], Tuple[Optional[str], str]] = _site_path,
    complete: bool = True,
) -> List[Tuple[Optional[str], str, str]]:
    """(root, path, node) for each module call that ends inside ``gm``: its last node whose
    value leaves the module (nodes dynamo adds to rebuild Python objects, with no metadata,
    such as torchao's ``Float8LinearConfig``, are no part of it). Modules called more than
    once in the graph are left out;
    ``complete=False`` (the graph ends at a graph break) leaves out a region that ends the
    graph and only reaches its output when the module may continue in the next graph: unless
    the break fell after the call returned (``breaks.returned_before_break``)."""
    at_break = None if complete else breaks.break_frames(gm)
    dynamo = parse is _site_path  # (fx nodes have no example values)
    computing = [
        n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr") and (not dynamo or n.meta)
    ]
    order = {n: i for i, n in enumerate(computing)}
    spans: Dict[str, List[fx.Node]] = {}
    for node in computing:
        for path, _ in breaks.module_stack(node).values():
            spans.setdefault(str(path), []).append(node)
    out = []
    for key, nodes in spans.items():
        idx = [order[n] for n in nodes]
        if idx != list(range(idx[0], idx[0] + len(idx))):
            continue  # two calls, or interleaved: no single output
        last = nodes[-1]
        inside = set(nodes)
        value = last.meta.get("example_value", None if parse is _site_path else last)  # fx: no example values
        outside = [u for u in last.users if u not in inside]
        if not isinstance(value, (torch.Tensor, fx.Node)) or not outside:
            continue
        ends_graph = all(u.op == "output" for u in outside) and order[last] == len(computing) - 1
        if not complete and ends_graph and not breaks.returned_before_break(last, key, at_break):
            continue  # the graph breaks right after it: the module may go on in the next graph
        root, path = parse(key)
        if path or root:  # a module held in a frame local (``L['___stack0']``) has no path under it
            out.append((root, path, prefix + last.name))
    return out


def exact_checkpoints(
    gm: fx.GraphModule, instrument_body: Callable[[fx.GraphModule, str], Callable[..., Any]]
) -> List[Tuple[str, fx.GraphModule]]:
    """Route dynamo's checkpoint nodes through ``exact_checkpoint`` with instrumented bodies."""
    bodies = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint:
            attr = str(node.args[0].target)
            body = getattr(gm, attr)
            bodies.append((attr + ".", body))
            setattr(gm, attr, _Body(instrument_body(body, attr + ".")))
            node.target = exact_checkpoint
    if bodies:
        gm.recompile()
    return bodies


# ---------------------------------------------------------------------------------------
# Run time: which module instances a graph runs for


def calling_frame(start: FrameType) -> Optional[FrameType]:
    """The first frame above ``start`` outside torch itself: the user frame running a graph."""
    frame: Optional[FrameType] = start
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return frame


def scope_of(
    frame: Optional[FrameType],
    roots: List[str],
    paths: Dict[int, str],
    anchored: Optional[Dict[str, str]] = None,
) -> Tuple[str, ...]:
    """(owner path, path per root local): the modules a graph's frame runs for.
    ``anchored`` gives root locals already known from the tensors they hold."""
    anchored = anchored or {}
    owner = ""
    probe = frame
    for _ in range(64):
        if probe is None:
            break
        code = probe.f_code
        if code.co_argcount and id(probe.f_locals.get(code.co_varnames[0])) in paths:
            owner = paths[id(probe.f_locals[code.co_varnames[0]])]
            break
        probe = probe.f_back
    local = {_root_key(k): v for k, v in frame.f_locals.items()} if frame is not None else {}
    return (owner, *(anchored.get(r, paths.get(id(local.get(r)), owner)) for r in roots))


def anchored_roots(
    anchors: Dict[str, Tuple[int, str]], args: Tuple[Any, ...], tensors: Dict[int, List[str]]
) -> Dict[str, str]:
    """root local -> module path, from the full names of the parameters passed in
    (a tied weight has several: the one that ends with the graph's relative path)."""
    out = {}
    for root, (i, rel) in anchors.items():
        for full in tensors.get(id(args[i]), []) if i < len(args) else []:
            if full == rel or full.endswith("." + rel):
                out[root] = full[: len(full) - len(rel)].rstrip(".")
                break
    return out


class Labeller:
    """Stable, unique labels: one per (base label, source line, occurrence), so recompiles
    keep tags and distinct sites never share one."""

    def __init__(self) -> None:
        self._by_site: Dict[Tuple[str, str, int], str] = {}
        self._used: Dict[str, int] = {}

    def label(self, base: str, source: str, occurrence: int) -> str:
        key = (base, source, occurrence)
        if key not in self._by_site:
            n = self._used.get(base, 0)
            self._used[base] = n + 1
            self._by_site[key] = base if n == 0 else f"{base}_{n}"
        return self._by_site[key]

    def __contains__(self, label: object) -> bool:
        return label in self._by_site.values()


def table_for(graph: FrameGraph, scope: Tuple[str, ...], labeller: Labeller) -> Dict[str, str]:
    """Node name -> label for ``graph`` run by the modules in ``scope``."""
    where = dict(zip(graph.roots(), scope[1:]))
    seen: Dict[Tuple[str, str], int] = {}
    table: Dict[str, str] = {}
    for site in graph.sites:
        base_path = where.get(site.root, scope[0]) if site.root else scope[0]
        path = ".".join(p for p in (base_path, site.path) if p)
        if site.is_attr:
            table[site.name] = labeller.label(path, "", 0)
            continue
        key = site.origin or site.name  # (the items of one tuple share their source's label)
        if key not in table:
            base = f"{path}/{site.op}" if path else site.op
            n = seen.get((base, site.source), 0)
            seen[(base, site.source)] = n + 1
            table[key] = labeller.label(base, site.source, n)
        if site.origin:
            table[site.name] = labeller.label(table[key] + site.index, "", 0)
    return {s.name: table[s.name] for s in graph.sites}


def label_of(name: str) -> Optional[str]:
    """The label the running graph's table gives node ``name`` (None: no graph runs, or no label)."""
    return _TABLES[-1].get(name) if _TABLES else None


@contextmanager
def running(table: Dict[str, str]) -> Iterator[None]:
    """Context of one graph call: ``observe_node`` resolves through ``table``."""
    _TABLES.append(table)
    try:
        yield
    finally:
        _TABLES.pop()
