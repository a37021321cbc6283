"""Graph breaks and module calls: whether a module call had returned when its graph broke.

A dynamo graph that ends at a graph break may end inside a module call (the module goes on
in the next graph) or right after one returned (``lm_head`` before a loss whose first op
breaks). Dynamo tells where the break fell (``compile_subgraph_reason.user_stack``) and
where each node was computed (``node.meta["stack_trace"]``); both list the user's frames,
outermost first (torch's own frames are left out). A module call is still running at the
break when the break's frames agree, line for line, with the node's frames up to the frame
that made the call; otherwise it had returned, and its last node is its output.

Also here: the frame that runs a graph (``running_frame``) and whether it is a module's own
call (``module_called``). A module whose caller ran eagerly (a frame dynamo skipped, or code
at a graph break) is compiled as a frame of its own: what that frame's graph returns is the
module's output, and ``self`` in it is the module, also for torch's own modules
(``nn.Embedding.forward`` compiled on its own).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
from types import FrameType
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx

__all__ = [
    "break_frames",
    "code_key",
    "compiling_code",
    "compiling_resume_frame",
    "module_called",
    "module_stack",
    "resumed_module_frames",
    "returned_before_break",
    "running_frame",
]

Frame = Tuple[str, int]  # (file, line)
CodeKey = Tuple[str, str, int]  # (file, function, first line) of a code object: dynamo's compiled code keeps them
_TORCH_DIR = os.path.dirname(torch.__file__)
_TRACE_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
# A node's module stack as the capture reads it: dynamo's ``nn_module_stack``, or one with the
# module of a resumed frame added (``resumed_module_frames``). Kept apart: the graph goes on
# to the user's backend, whose passes read dynamo's own.
_STACK = "lightning_scale_module_stack"


def module_stack(node: fx.Node) -> Dict[str, Any]:
    """Module path key -> (path, module type) of the calls ``node`` is computed in, outermost first."""
    return node.meta.get(_STACK) or node.meta.get("nn_module_stack") or {}


def _user(frames: List[Frame]) -> List[Frame]:
    return [f for f in frames if not f[0].startswith(_TORCH_DIR)]


def break_frames(gm: fx.GraphModule) -> Optional[List[Frame]]:
    """The user's frames at the graph break that ended ``gm`` (None: not known)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    stack = getattr(reason, "user_stack", None)
    if not getattr(reason, "graph_break", False) or not stack:
        return None
    return _user([(str(f.filename), int(f.lineno or 0)) for f in stack])


def _node_frames(node: fx.Node) -> List[Frame]:
    trace = str(node.meta.get("stack_trace") or "")
    return _user([(file, int(line)) for file, line in _TRACE_FRAME.findall(trace)])


def _forward_lines(cls: Any) -> Optional[Tuple[str, int, int]]:
    """(file, first line, last line) of a module class's ``forward``, if it is Python code."""
    forward = inspect.unwrap(getattr(cls, "forward", None)) if isinstance(cls, type) else None
    code = getattr(forward, "__code__", None)
    if code is None:
        return None
    lines = [line for _, _, line in code.co_lines() if line is not None] or [code.co_firstlineno]
    return code.co_filename, code.co_firstlineno, max(lines)


def _first_frame_inside(node: fx.Node, key: str, frames: List[Frame]) -> int:
    """Index in ``frames`` of the first frame inside the module call ``key`` of ``node``'s
    module stack: the ``forward`` of it or of the first module inside it that is the user's
    code; ``len(frames)`` when none is (torch's own modules leave no frame)."""
    stack = list(module_stack(node).values())
    paths = [str(path) for path, _ in stack]
    if key not in paths:
        return len(frames)
    for _, cls in stack[paths.index(key) :]:
        where = _forward_lines(cls)
        if where is None:
            continue
        for i, (file, line) in enumerate(frames):
            if file == where[0] and where[1] <= line <= where[2]:
                return i
    return len(frames)


def returned_before_break(node: fx.Node, key: str, at_break: Optional[List[Frame]]) -> bool:
    """Whether the module call ``key`` (an ``nn_module_stack`` path of ``node``, its last
    node) had returned when the graph broke at ``at_break`` (``break_frames``). Unknown
    frames, or a break on the very line that made the call, count as not returned."""
    if at_break is None:
        return False
    frames = _node_frames(node)
    if not frames:
        return False
    inside = _first_frame_inside(node, key, frames)
    return at_break[:inside] != frames[:inside]


# ---------------------------------------------------------------------------------------
# Frames resumed inside a module after a nested graph break

_NESTED_SELF = re.compile(r"^L\['__nested_frame_values'\]\[(\d+)\]\[\d+\]")


def _trace_functions(node: fx.Node) -> List[Tuple[str, str]]:
    """(file, function) of each of the user's frames in ``node``'s stack trace, outermost first."""
    trace = str(node.meta.get("stack_trace") or "")
    found = re.findall(r'File "([^"]+)", line \d+, in (\S+)', trace)
    return [(file, name) for file, name in found if not file.startswith(_TORCH_DIR)]


def resumed_module_frames(gm: fx.GraphModule) -> None:
    """Put each node computed in a module's frame resumed after a nested graph break under
    that module in its ``module_stack``, as nodes of an unbroken call are.

    After a break inside ``inner.forward``, dynamo resumes the outer frame with the inner
    frame's values (``L['__nested_frame_values'][0]``); only calls of submodules of it have
    a module stack (``L['__nested_frame_values'][0][1].fc2``), and ops in the frame's own
    code (a ``relu``) have none. The frame at depth ``i + 1`` of the stack trace is the one
    of ``__nested_frame_values[i]``; its ``self`` is the module those submodule calls start
    from. Known from one such call, the module then heads the stack of every node computed
    in that frame, so ops get its path and its output is found (``inner``)."""
    selves: Dict[int, Tuple[str, Tuple[str, str]]] = {}  # depth -> (module's stack path, its frame)
    for node in gm.graph.nodes:
        for path, _ in module_stack(node).values():
            m = _NESTED_SELF.match(str(path))
            frames = _trace_functions(node)
            depth = int(m.group(1)) + 1 if m else -1
            if m and depth < len(frames):
                selves.setdefault(depth, (m.group(0), frames[depth]))
    if not selves:
        return
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        frames = _trace_functions(node)
        depths = [d for d in sorted(selves, reverse=True) if d < len(frames) and frames[d] == selves[d][1]]
        if not depths:
            continue
        path = selves[depths[0]][0]
        stack = dict(module_stack(node))
        if not any(str(p) == path for p, _ in stack.values()):
            node.meta[_STACK] = {path: (path, None), **stack}


# ---------------------------------------------------------------------------------------
# The frame that runs a graph, and whether it is a module's own call

_RESUMED = re.compile(r"^torch_dynamo_resume_in_(.+)_at_\d+$")


def code_key(code: Any) -> Optional[CodeKey]:
    """(file, function, first line) of a code object (None: none)."""
    return None if code is None else (code.co_filename, code.co_name, code.co_firstlineno)


def running_frame(start: Optional[FrameType], key: Optional[CodeKey]) -> Optional[FrameType]:
    """The first frame from ``start`` outwards that runs the code whose ``code_key`` is ``key``
    (the code dynamo compiled into the graph now running); None where none does."""
    frame = start
    for _ in range(64):
        if frame is None or key is None:
            return None
        if code_key(frame.f_code) == key:
            return frame
        frame = frame.f_back
    return None


def module_called(frame: Optional[FrameType], paths: Dict[int, str]) -> Optional[str]:
    """The path (``paths``: id -> path) of the module whose own call ``frame`` runs: its
    class's ``forward`` or ``__call__`` (or a function they wrap: a decorated ``forward``), or
    dynamo's resume of one after a graph break; None for any other frame."""
    if frame is None:
        return None
    code = frame.f_code
    first = code.co_varnames[0] if code.co_argcount else "self"
    module = frame.f_locals.get(first, frame.f_locals.get("self"))
    path = paths.get(id(module))
    if path is None:
        return None
    resumed = _RESUMED.match(code.co_name)
    name = resumed.group(1) if resumed else code.co_name
    return path if (code.co_filename, name) in _call_codes(type(module)) else None


@functools.lru_cache(maxsize=None)
def _call_codes(cls: type) -> frozenset:
    """(file, function) of a module class's ``forward`` and ``__call__``, and of what they wrap."""
    out = set()
    for attr in ("forward", "__call__"):
        fn = getattr(cls, attr, None)
        for _ in range(16):
            code = getattr(fn, "__code__", None)
            if code is not None:
                out.add((code.co_filename, code.co_name))
            fn = getattr(fn, "__wrapped__", None)
            if fn is None:
                break
    return frozenset(out)


def compiling_resume_frame() -> bool:
    """Whether dynamo is compiling the continuation of a frame after a graph break."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code.co_name.startswith("torch_dynamo_resume_in")
    except Exception:  # noqa: BLE001 - a dynamo internal; without it inputs are labelled
        return False


def compiling_code() -> Any:
    """The code object of the frame dynamo is compiling (a resume function after a graph
    break has its own); None where dynamo's internals do not say."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        return InstructionTranslator.current_tx().f_code
    except Exception:  # noqa: BLE001 - a dynamo internal
        return None
