"""The shadow pass: a tracked step whose statistics come from a second, instrumented run.

Where tracking in place would change training (the fidelity probe finds that no capture
reproduces the model's forward bit for bit: a model compiled with Inductor, whose kernels
fuse and order reductions differently once statistics read the intermediates), or where
``ScaleMonitor(shadow="always")`` asks for it, a tracked step runs the user's forward, loss,
backward and optimizer step exactly as without the callback; ``Shadow`` only watches it.

* On the forward's first call it keeps what that forward starts from: the state
  (``module_state.Snapshot``: the random number generators, buffer values, module
  attributes), the inputs, and the grad, inference and autocast modes; and it hooks the
  outputs, so that the gradient backward brings each of them is kept (one copy, the size of
  the output).
* ``run``, after the user's backward (before the optimizer step: the parameters are those
  the forward read, and the user's activations are freed), puts that state back, runs the
  capture's instrumented forward on the same inputs in the same modes under the step's
  recorder, and backward from the kept gradients (``backward_apart``: no ``.grad`` is
  touched, and no hook that runs when a gradient is accumulated, DDP's all-reduce among
  them, fires); then it puts back the state the user's step left.

So training is bit-identical with and without the callback by construction, and the
statistics are those of the instrumented version: the same tensors up to its rounding.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from lightning_scale.capture import Capture
from lightning_scale.capture.fidelity import output_leaves
from lightning_scale.capture.forward_swap import ForwardSwap
from lightning_scale.capture.module_state import Snapshot
from lightning_scale.record.recorder import Recorder, recording

__all__ = ["SHADOW_MODES", "Modes", "Shadow", "backward_apart", "graph_leaves"]

#: ``ScaleMonitor(shadow=...)``: where the probe refuses in place, every tracked step, never.
SHADOW_MODES: Tuple[str, ...] = ("auto", "always", "never")

_DEVICES = tuple(d for d in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(d))


@dataclass(frozen=True)
class Modes:
    """The grad, inference and autocast modes a forward ran in (autocast: (device type,
    dtype) of each device type it was on for), to run another forward in them."""

    grad: bool
    inference: bool
    autocast: Tuple[Tuple[str, torch.dtype], ...]

    @classmethod
    def now(cls) -> "Modes":
        """The modes in force here."""
        cast = tuple((d, torch.get_autocast_dtype(d)) for d in _DEVICES if torch.is_autocast_enabled(d))
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), cast)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """These modes in the block (autocast off where it was off, whatever is in force here)."""
        on = dict(self.autocast)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device in _DEVICES:
                if device in on:
                    stack.enter_context(torch.autocast(device, dtype=on[device]))
                elif torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            yield


class Shadow:
    """One tracked step's shadow pass (see the module docstring).

    Args:
        target: the captured module, whose forward the step calls (its state is saved and put back).
        cap: the capture whose instrumented forward the shadow runs.
        recorder: where the shadow's statistics go.
    """

    def __init__(self, target: nn.Module, cap: Capture, recorder: Recorder) -> None:
        self.target, self.capture, self.recorder = target, cap, recorder
        self.watched = False  # the user's forward ran, and what the shadow needs was kept
        self.ran = False  # the shadow ran (whether it recorded or failed)
        self._before: Optional[Snapshot] = None
        self._modes = Modes(True, False, ())
        self._inputs: Tuple[Tuple[Any, ...], Dict[str, Any]] = ((), {})
        self._grads: Dict[str, Tensor] = {}
        self._fault: Optional[BaseException] = None  # (a hook's: raised by ``run``, never into backward)

    def watching(self, eager: Callable[..., Any]) -> Callable[..., Any]:
        """``eager`` (the user's forward) as it is; its first call also keeps what ``run`` needs."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.watched:  # (a later call in the same step)
                return eager(*args, **kwargs)
            self.watched = True
            try:
                self._before, self._modes, self._inputs = Snapshot(self.target), Modes.now(), (args, kwargs)
            except Exception as err:  # noqa: BLE001 - never into the user's forward: ``run`` says why
                self._before, self._fault = None, err
            out = eager(*args, **kwargs)
            self._hook_outputs(out)
            return out

        return forward

    def _hook_outputs(self, out: Any) -> None:
        """A tensor hook on each floating output that requires grad: ``_keep`` its gradient."""
        if not torch.is_grad_enabled():
            return
        try:
            for name, value in output_leaves(out):
                if isinstance(value, Tensor) and value.requires_grad and value.is_floating_point():
                    value.register_hook(functools.partial(self._keep, name))
        except Exception as err:  # noqa: BLE001 - never into the user's step
            self._fault = err

    def _keep(self, name: str, grad: Tensor) -> None:
        """The gradient the user's backward brings output ``name`` (its first, copied: the
        user's backward goes on with the original)."""
        if name in self._grads:
            return
        try:
            self._grads[name] = grad.detach().clone()
        except Exception as err:  # noqa: BLE001 - never break the user's backward
            self._fault = err

    def run(self) -> None:
        """The instrumented forward from the kept state and inputs, and backward where the
        user's outputs got gradients; then the state the user's step left. Runs once; a
        failure becomes the recorder's ``error`` (the step logs nothing, one warning says why)."""
        if self.ran or not self.watched:
            return
        self.ran = True
        try:
            after = Snapshot(self.target)
        except Exception as err:  # noqa: BLE001 - nothing ran: nothing to put back
            self._failed(err)
            return
        try:
            if self._fault is not None or self._before is None:
                raise self._fault or RuntimeError("no saved state")
            self._before.restore()
            self._replay()
        except Exception as err:  # noqa: BLE001 - a fault of the monitor never reaches the user's step
            self._failed(err)
        finally:
            after.restore()
            self._before, self._inputs, self._grads = None, ((), {}), {}

    def _failed(self, err: BaseException) -> None:
        if self.recorder.error is None:
            self.recorder.error = RuntimeError(f"the shadow pass failed ({type(err).__name__}: {err})")

    def _replay(self) -> None:
        args, kwargs = self._inputs
        (_, root), *units = self.capture.parts()
        with ForwardSwap() as swap, recording(self.recorder):
            for path, fn in units:  # (FSDP units captured one by one: run by the root's graph)
                swap.replace(self.target.get_submodule(path), fn)
            with self._modes.entered():
                out = root(*args, **kwargs)
            pairs = [
                (value, self._grads[name])
                for name, value in output_leaves(out)
                if name in self._grads and isinstance(value, Tensor) and value.requires_grad
            ]
            if pairs:
                backward_apart([o for o, _ in pairs], [g for _, g in pairs])


def graph_leaves(outputs: Sequence[Tensor]) -> List[Tensor]:
    """The leaf tensors that require grad (parameters, inputs, probes) the autograd graph of
    ``outputs`` reaches, each once."""
    leaves: Dict[int, Tensor] = {id(o): o for o in outputs if o.grad_fn is None and o.requires_grad}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: Set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # (an AccumulateGrad node: its leaf)
        if isinstance(variable, Tensor):
            leaves.setdefault(id(variable), variable)
        else:
            stack.extend(f for f, _ in fn.next_functions if f is not None)
    return list(leaves.values())


def backward_apart(outputs: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """Backward from ``outputs`` with ``grads`` through every part of their graph that leads
    to a leaf, leaving every leaf's ``.grad`` as it is: ``torch.autograd.grad`` over the
    leaves. Tensor hooks (a recorder's) see every gradient; hooks that run when a gradient is
    accumulated (DDP's all-reduce, ``register_post_accumulate_grad_hook``) do not run. Each
    leaf's gradient is dropped as it arrives (a hook after the others' turns it into an
    expanded zero), so no second set of parameter gradients is held.

    Example::

        >>> lin = nn.Linear(2, 3)
        >>> seen = []
        >>> _ = lin.weight.register_hook(lambda g: seen.append(g.shape))
        >>> backward_apart([lin(torch.ones(4, 2))], [torch.ones(4, 3)])
        >>> seen, lin.weight.grad
        ([torch.Size([3, 2])], None)
    """
    leaves = graph_leaves(outputs)
    if not leaves:
        return
    handles = [leaf.register_hook(_dropped) for leaf in leaves]
    try:
        torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()


def _dropped(grad: Tensor) -> Optional[Tensor]:
    """A zero of ``grad``'s shape that holds no memory; a DTensor or sparse gradient is kept
    until backward ends."""
    if type(grad) is not Tensor or grad.layout is not torch.strided:
        return None
    return grad.new_zeros(()).expand(grad.shape)
