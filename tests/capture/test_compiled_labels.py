"""Labels of the compiled route's graphs: which nodes return a tensor of the graph itself.

A node that returns its input unchanged is recorded once, at its source, and logged under
both labels (``FrameGraph.copies``): the eager routes see one tensor there, and a second
record would read the same values again. Dynamo's example values show most such nodes
(the very same object); a dropout that does nothing (``p`` 0, or eval mode) gets a new
example value although ATen returns its input, so ``returned_input`` names it.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from lightning_scale.capture.compiled_labels import CompiledLabels, returned_input, same_tensor
from lightning_scale.tools.models import Block, GPTConfig


class Dropouts(nn.Module):
    """Each way a model calls dropout, after a linear layer each."""

    def __init__(self) -> None:
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.zero = nn.Dropout(0.0)
        self.live = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        a = self.zero(self.lins[0](x))  # p = 0 in training: ATen returns its input
        b = F.dropout(self.lins[1](x), 0.3, training=False)  # eval mode: returns its input
        c = F.dropout(self.lins[2](x), p=0.0)  # p = 0 by keyword
        d = self.live(self.lins[3](x))  # live: new values
        e = F.dropout(self.lins[4](x))  # the default p = 0.5 in training: new values
        f = torch.dropout(self.lins[5](x), 0.0, True)  # the ATen function, p = 0
        return a + b + c + d + e + f


def dynamo_graph(module: nn.Module, *args: Any) -> fx.GraphModule:
    """The one graph dynamo hands a backend for ``module(*args)``."""
    graphs: List[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=keep, fullgraph=True)(*args)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def dropout_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (F.dropout, torch.dropout)]


def test_dropout_that_does_nothing_returns_its_input() -> None:
    gm = dynamo_graph(Dropouts().train(), torch.randn(2, 8))
    dropouts = dropout_nodes(gm)
    assert len(dropouts) == 6
    given: Dict[str, Any] = {n.name: returned_input(n) for n in dropouts}
    sources = {n.name: n.args[0] for n in dropouts}
    # the zero-p module, eval-mode call, zero-p keyword and torch.dropout return their input;
    # the live module and the default p do not
    assert [given[n.name] is sources[n.name] for n in dropouts] == [True, True, True, False, False, True]
    assert all(v is None or isinstance(v, fx.Node) for v in given.values())
    assert returned_input(next(n for n in gm.graph.nodes if n.op == "placeholder")) is None


def test_a_dropout_that_does_nothing_is_a_copy_of_its_input() -> None:
    model = Dropouts().train()
    gm = dynamo_graph(model, torch.randn(2, 8))
    labelled = {n.name for n in gm.graph.nodes if n.op != "output"}
    aliases, stand_ins, _ = same_tensor(gm, labelled)
    dropouts = dropout_nodes(gm)
    copied = {n.name: n.args[0].name for i, n in enumerate(dropouts) if i in (0, 1, 2, 5)}
    assert {k: aliases[k] for k in copied} == copied
    assert not any(n.name in aliases for i, n in enumerate(dropouts) if i in (3, 4))
    assert not stand_ins


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_a_blocks_zero_dropout_is_recorded_once_at_its_source(p: float) -> None:
    """The instrumented graph's recorded nodes leave out a GPT block's ``nn.Dropout(0.0)``
    (logged as a copy of ``fc2``'s record) and keep a live one."""
    cfg = GPTConfig(vocab=32, seq=8, layers=1, dim=32, heads=2, dropout=p)
    block = Block(cfg).train()
    holder = nn.Module()
    holder.model = block
    gm = dynamo_graph(block, torch.randn(2, 8, 32))
    graph = CompiledLabels(holder).frame_graph(gm)
    drop = dropout_nodes(gm)[0].name
    if p == 0.0:
        assert graph.copies.get(drop) is not None
    else:
        assert drop not in graph.copies and drop not in graph.views
