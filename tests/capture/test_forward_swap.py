"""ForwardSwap: a module's forward replaced for a while, and exactly what was there put back."""

from __future__ import annotations

import torch
from torch import nn

from lightning_scale.capture.forward_swap import ForwardSwap


def test_the_class_forward_shows_through_again_and_an_instance_forward_is_put_back() -> None:
    plain, wrapped = nn.Linear(2, 2), nn.Linear(2, 2)

    def own(x: torch.Tensor) -> torch.Tensor:  # an instance forward set by the user
        return x + 1

    wrapped.forward = own  # type: ignore[method-assign]
    x = torch.ones(1, 2)
    with ForwardSwap() as swap:
        assert swap.replace(plain, lambda x: x * 0).__func__ is nn.Linear.forward  # the class's, bound
        assert swap.replace(wrapped, lambda x: x * 3) is own
        swap.replace(wrapped, lambda x: x * 5)  # a second swap of the same module keeps the first original
        assert swap.original(wrapped) is own
        assert torch.equal(plain(x), torch.zeros(1, 2)) and torch.equal(wrapped(x), 5 * x)
    assert "forward" not in plain.__dict__ and wrapped.__dict__["forward"] is own
    assert torch.equal(wrapped(x), x + 1)
