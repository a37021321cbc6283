"""Node labels and view aliases of captured graphs.

A label is the module path of a node plus its op (``blocks.0.mlp.fc1/linear``), the
attribute path of a parameter or buffer, or an input's name; a repeated label gets
``_1``, ``_2``, ... in graph order. An item of a tuple output (``qkv(x).chunk(3)[0]``, the
``[1]`` of an LSTM's ``(output, state)``) is named after its source and index:
``blocks.0.attn/chunk[0]``, ``rnn/lstm[1][0]`` (``indexed_item``). ``view_aliases`` finds
reshape-like nodes whose statistics equal their input's, so they are copied rather than
computed.
"""

from __future__ import annotations

import ast
import functools
import operator
import re
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch
from torch import fx, nn

#: ``node.meta`` key of an indexing node's line of the user's source code (set by ``tracer.DeepTracer``)
SOURCE_LINE = "lightning_scale_source_line"

__all__ = [
    "SOURCE_LINE",
    "TUPLE_OPS",
    "function_name",
    "index_text",
    "indexed_item",
    "indexing_name",
    "is_indexing",
    "label_graph",
    "line_subscript",
    "subscript_source",
    "view_aliases",
]


def _op_name(node: fx.Node, root: Optional[nn.Module]) -> str:
    if node.op == "call_module" and root is not None:
        return _module_type(root.get_submodule(str(node.target))).__name__.lower()
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    return getattr(target, "__name__", str(target)).strip("_") or "op"


def function_name(target: object) -> Optional[str]:
    """The name of the ``torch.autograd.Function`` behind dynamo's trampoline call of it
    (``trampoline_autograd_apply``: ``fn_cls.apply`` in a closure), e.g. torchao's
    ``matmul_with_hp_or_float8_args``; None for any other target."""
    code = getattr(target, "__code__", None)
    cells = dict(zip(code.co_freevars, getattr(target, "__closure__", None) or ())) if code is not None else {}
    fn_cls = cells["fn_cls"].cell_contents if "fn_cls" in cells else None
    if isinstance(fn_cls, type) and issubclass(fn_cls, torch.autograd.Function):
        return fn_cls.__name__
    return None


def _module_type(m: nn.Module) -> type:
    """The user's class: FSDP2's ``fully_shard`` swaps in a subclass ``FSDP<name>``;
    ``torch.compile`` wraps the module in an ``OptimizedModule``."""
    m = getattr(m, "_orig_mod", m) if isinstance(m, torch._dynamo.eval_frame.OptimizedModule) else m
    cls = type(m)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2 and cls.__bases__[0].__name__ == "FSDPModule":
        return cls.__bases__[1]
    return cls


_DYNAMO_PATH = re.compile(r"^L\['[^']+'\]\.?(__self__\.?)?")  # L['self'].x, or L['fn'].__self__.x for a bound method


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    path = _DYNAMO_PATH.sub("", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\._(modules|parameters|buffers)\.", ".", path)
    return path.strip(".")


_DYNAMO_ATTR = re.compile(r"_(modules|parameters|buffers)_")


def _placeholder_name(target: str) -> str:
    """``L_self_modules_fc1_parameters_weight_`` -> ``fc1.weight``; ``L_x_`` -> ``x``."""
    m = _DYNAMO_ATTR.search(target)
    if target.startswith("L_") and m:
        rest = target[m.start() + 1 :]
        parts = [p for p in _DYNAMO_ATTR.split("_" + rest) if p and p not in ("modules", "parameters", "buffers")]
        return ".".join(p.strip("_") for p in parts)
    if target.startswith("L_") and target.endswith("_"):
        return target[2:-1]
    return target


def _base_label(node: fx.Node, root: Optional[nn.Module], scope: str) -> str:
    """``path/op`` for ops, the attribute path for parameters, the name for inputs;
    ``scope`` is the path of the module the graph belongs to inside the captured one."""

    def under(path: str) -> str:
        return ".".join(p for p in (scope, path) if p)

    if node.op == "get_attr":
        return under(str(node.target))
    if node.op == "placeholder":
        name = _placeholder_name(str(node.target))
        return f"{scope}/{name}" if scope else name
    if node.op == "call_module":
        return f"{under(str(node.target))}/{_op_name(node, root)}"
    path = under(_module_path(node))
    return f"{path}/{_op_name(node, root)}" if path else _op_name(node, root)


#: Ops whose output is a tuple of tensors: an int item of their output is named ``op[i]``.
TUPLE_OPS = frozenset(
    "split split_with_sizes tensor_split chunk unbind hsplit vsplit dsplit topk sort max min median nanmedian"
    " mode kthvalue cummax cummin aminmax var_mean std_mean frexp unique_consecutive broadcast_tensors meshgrid".split()
)


def indexed_item(node: fx.Node, is_tuple: Callable[[fx.Node], bool]) -> Optional[Tuple[fx.Node, str]]:
    """(source, index) when ``node`` takes an int item of a tuple output, items of items
    included: ``chunk[0]`` -> (the ``chunk`` node, ``"[0]"``), ``lstm[1][0]`` -> (the LSTM's
    node, ``"[1][0]"``). ``is_tuple`` says whether a node's output is a tuple."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    source, index = node.args
    if not isinstance(source, fx.Node) or type(index) is not int:
        return None
    outer = indexed_item(source, is_tuple)
    if outer is not None:
        return outer[0], f"{outer[1]}[{index}]"
    return (source, f"[{index}]") if is_tuple(source) else None


# ---------------------------------------------------------------------------------------
# Slices and indexing: ``pos[:T]``, ``x[0]``, ``qkv[..., :64]``


def is_indexing(node: fx.Node) -> bool:
    """A ``getitem`` that indexes or slices (not an item of a tuple output: ``indexed_item``)."""
    return node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2


def subscript_source(trace: str) -> Optional[str]:
    """The subscript an op was computed by, as written (``self.pos[:T]`` -> ``pos[:T]``), from
    its stack trace's last frame where the frame marks the expression (dynamo's ``^^^``):
    the first subscript of the marked text (the outermost, leftmost); None where not found."""
    lines = trace.rstrip("\n").split("\n")
    if len(lines) < 2 or not re.fullmatch(r"\s*[\^~]+\s*", lines[-1]):
        return None
    marks = lines[-1]
    start, end = len(marks) - len(marks.lstrip()), len(marks.rstrip())
    text = lines[-2][start:end]
    for candidate in (text, f"({text})"):
        try:
            tree = ast.parse(candidate.strip(), mode="eval")
        except SyntaxError:
            continue
        found = next((n for n in ast.walk(tree) if isinstance(n, ast.Subscript)), None)
        return re.sub(r"^self\.", "", ast.unparse(found)) if found is not None else None
    return None


def line_subscript(line: str, index: str) -> Optional[str]:
    """The subscript of a line of source code whose index is written ``index`` (as
    ``index_text`` renders it), or the line's only subscript: ``h = x + self.pos[:T]`` ->
    ``pos[:T]``; None where the line has none such, or several."""
    try:
        tree = ast.parse(line.strip().rstrip(":") or "None")
    except SyntaxError:
        return None
    subscripts = [n for n in ast.walk(tree) if isinstance(n, ast.Subscript)]
    written = [re.sub(r"^\((.*)\)$", r"\1", ast.unparse(n.slice)) for n in subscripts]  # ((:, -1): a tuple)
    same = [n for n, w in zip(subscripts, written) if w == index] or (subscripts if len(subscripts) == 1 else [])
    return re.sub(r"^self\.", "", ast.unparse(same[0])) if len(same) == 1 else None


def index_text(index: Any, name_of: Callable[[fx.Node], str]) -> str:
    """``index`` as written in a subscript: ``0``, ``:T``, ``..., :64``, ``:, -1``; a node by
    ``name_of`` (``x.shape[1]``)."""
    if isinstance(index, tuple):
        return ", ".join(index_text(i, name_of) for i in index)
    if isinstance(index, slice):
        parts = [index_text(v, name_of) if v is not None else "" for v in (index.start, index.stop, index.step)]
        return ":".join(parts[:2]) + (f":{parts[2]}" if parts[2] else "")
    if index is Ellipsis:
        return "..."
    if isinstance(index, fx.Node):
        return name_of(index)
    return repr(index)


def indexing_name(node: fx.Node, name_of: Callable[[fx.Node], str]) -> str:
    """``source[index]`` for an indexing ``getitem`` node, its source named by ``name_of``."""
    source, index = node.args
    return f"{name_of(source) if isinstance(source, fx.Node) else repr(source)}[{index_text(index, name_of)}]"


def _fx_name_of(node: fx.Node, path: str, labels: Dict[str, str], depth: int = 0) -> str:
    """A short expression for an fx node as the op at module ``path`` sees it: an input's
    name, an attribute's path under ``path`` (``pos``), ``x.shape``, ``x.size(1)``, a slice's
    own text, a child module's output by its name (``qkv``), an op of ``path`` by its op."""

    def name(n: fx.Node) -> str:
        return _fx_name_of(n, path, labels, depth + 1) if depth < 4 else n.name

    def under(target: str) -> str:
        return target[len(path) + 1 :] if path and target.startswith(path + ".") else target

    if node.op == "placeholder":
        return str(node.target)
    if node.op == "get_attr":
        return under(str(node.target))
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        return f"{name(node.args[0])}.{node.args[1]}" if isinstance(node.args[0], fx.Node) else node.name
    if node.op == "call_method" and node.target == "size" and node.args and isinstance(node.args[0], fx.Node):
        return f"{name(node.args[0])}.size({', '.join(map(repr, node.args[1:]))})"
    if is_indexing(node) and isinstance(node.args[0], fx.Node):
        return indexing_name(node, name)
    label = labels.get(node.name, node.name)
    where, _, op = label.rpartition("/")
    return under(where) if where and where != path else op


def _fx_tuple(root: Optional[nn.Module]) -> Callable[[fx.Node], bool]:
    """Whether an fx node (no example values) returns a tuple: a leaf module, or a ``TUPLE_OPS`` op."""

    def is_tuple(node: fx.Node) -> bool:
        if node.op == "call_module":
            return True
        return node.op in ("call_method", "call_function") and _op_name(node, root) in TUPLE_OPS

    return is_tuple


def label_graph(
    gm: fx.GraphModule,
    root: Optional[nn.Module] = None,
    taken: Optional[Dict[str, int]] = None,
    scope: str = "",
    only: Optional[Set[str]] = None,
) -> Dict[str, str]:
    """Readable, unique labels for a graph's nodes: ``blocks.0.mlp.fc1/linear``.

    Args:
        gm: the graph module.
        root: the module the graph was traced from (names leaf modules' types).
        taken: labels already used (by other graphs of the same capture); updated.
        scope: path of the graph's module inside the captured module (for submodules
            captured separately, such as FSDP units).
        only: label only these node names (default: all).

    Returns:
        node name -> label, for every node but the output and function placeholders. An
        int item of a tuple output is its source's label and index (``blocks.0/chunk[0]``).
    """
    taken = {} if taken is None else taken
    labels: Dict[str, str] = {}
    is_tuple = _fx_tuple(root)
    for node in gm.graph.nodes:
        if node.op == "output" or str(node.target).startswith("function_placeholder__"):
            continue
        if only is not None and node.name not in only:
            continue
        item = indexed_item(node, is_tuple)
        if item is not None and item[0].name in labels:
            base = labels[item[0].name] + item[1]  # (unique: its source's label is)
        elif is_indexing(node):
            path = ".".join(p for p in (scope, _module_path(node)) if p)
            name_of = functools.partial(_fx_name_of, path=path, labels=labels)
            written = line_subscript(str(node.meta.get(SOURCE_LINE, "")), index_text(node.args[1], name_of))
            text = written or indexing_name(node, name_of)
            base = f"{path}/{text}" if path else text
        else:
            base = _base_label(node, root, scope)
        count = taken.get(base, 0)
        taken[base] = count + 1
        labels[node.name] = base if count == 0 else f"{base}_{count}"
    return labels


_VIEW_METHODS = {
    "view",
    "reshape",
    "transpose",
    "permute",
    "contiguous",
    "flatten",
    "unflatten",
    "squeeze",
    "unsqueeze",
    "t",
    "view_as",
    "reshape_as",
    "swapaxes",
    "mT",
}
_VIEW_FUNCTIONS = {
    torch.reshape,
    torch.transpose,
    torch.permute,
    torch.flatten,
    torch.squeeze,
    torch.unsqueeze,
    torch.t,
    torch.swapaxes,
    torch.unflatten,
}


def view_aliases(gm: fx.GraphModule, labels: Dict[str, str]) -> Dict[str, str]:
    """Labels whose statistics equal another node's, forward and backward, exactly.

    A reshape-like op (view, transpose, permute, ...) holds the same values as its input;
    when it is the input's only user, its gradient holds the same values as the input's
    gradient too. Such nodes need no computation of their own: label -> source label.
    """
    aliases: Dict[str, str] = {}
    for node in gm.graph.nodes:
        src = _view_source(node)
        if src is None or len(src.users) != 1 or src.name not in labels or node.name not in labels:
            continue
        root = labels[src.name]
        aliases[labels[node.name]] = aliases.get(root, root)
    return aliases


def _view_source(node: fx.Node) -> Optional[fx.Node]:
    is_view = (node.op == "call_method" and node.target in _VIEW_METHODS) or (
        node.op == "call_function" and node.target in _VIEW_FUNCTIONS
    )
    if is_view and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None
