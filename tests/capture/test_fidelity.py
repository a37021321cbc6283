"""The fidelity probe: saved and restored state, bit-for-bit comparison, route choice."""

from __future__ import annotations

import random
import warnings
from typing import Any, Iterator, List, Tuple

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import Tensor, nn

from lightning_scale import ScaleMonitor
from lightning_scale.capture import capture, fidelity
from lightning_scale.capture.module_state import Snapshot, forked_rng


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    yield
    torch._dynamo.reset()


class Stateful(nn.Module):
    """BatchNorm statistics, dropout, a numpy draw, an attribute and a list written in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)
        self.calls = 0
        self.seen: List[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        self.seen.append(self.calls)
        noise = float(np.random.random_sample()) + random.random()
        return self.drop(self.bn(self.fc(x))) * noise


def rng_now() -> tuple:
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def same_rng(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and bool((a[1] == b[1]).all()) and a[2] == b[2]


def test_snapshot_puts_generators_buffers_attributes_and_containers_back() -> None:
    model = Stateful()
    model.fc.register_forward_hook(lambda *_: None)
    before_rng, before_state = rng_now(), {k: v.clone() for k, v in model.state_dict().items()}
    hooks = model.fc._forward_hooks
    snap = Snapshot(model)
    for _ in range(2):
        model(torch.randn(8, 4))
        model.fc.register_forward_hook(lambda *_: None)
        model.new_attribute = 1
        snap.restore()
        assert same_rng(before_rng, rng_now())
        assert all(torch.equal(before_state[k], v) for k, v in model.state_dict().items())
        assert model.calls == 0 and model.seen == [] and not hasattr(model, "new_attribute")
        assert model.fc._forward_hooks is hooks and len(hooks) == 1  # the same table, refilled


def test_forked_rng_names_the_generators_drawn_from() -> None:
    before = rng_now()
    with forked_rng() as drawn:
        torch.rand(1)
        np.random.random_sample()
    assert drawn == ["torch's CPU generator", "numpy's generator"] and same_rng(before, rng_now())
    with forked_rng() as drawn:
        pass
    assert drawn == []


def test_compare_says_which_output_differs_and_by_how_much() -> None:
    a = {"logits": torch.tensor([1.0, float("nan"), 3.0, 4.0]), "n": 3, "": torch.zeros(2)}
    b = {"logits": torch.tensor([1.0, float("nan"), 3.5, 4.0]), "n": 3, "": torch.zeros(2, dtype=torch.float64)}
    assert fidelity.compare(a, a) == []  # NaN where NaN is equal
    assert fidelity.compare(a, b) == [
        "output differs: torch.float32 (2,) on cpu != torch.float64 (2,) on cpu",
        "output `logits` differs: 1 of 4 elements differ, max |difference| 0.5",
    ]
    assert fidelity.compare({"n": 3}, {"n": 4, "x": 1}, "buffer") == [
        "buffer `n` differs: 3 != 4",
        "buffer `x` only in the captured forward",
    ]


def test_verify_leaves_the_state_as_it_was_and_takes_the_first_matching_route() -> None:
    torch.manual_seed(0)
    model = Stateful().train()
    x = torch.randn(8, 4)
    before_rng, before_state = rng_now(), {k: v.clone() for k, v in model.state_dict().items()}
    calls: List[str] = []

    def broken() -> Any:
        calls.append("broken")
        raise RuntimeError("no such route")

    def dynamo() -> Any:  # (fx refuses this model: its trace draws from numpy)
        calls.append("dynamo")
        return capture(model, "dynamo")

    outcome = fidelity.verify(model, model.forward, [("broken", broken), ("dynamo", dynamo)], (x,), {})
    assert calls == ["broken", "dynamo"] and outcome.capture is not None and outcome.capture.mode == "dynamo"
    assert outcome.describe().startswith("broken: could not capture (RuntimeError: no such route")
    assert outcome.describe().endswith("dynamo: bit-identical")
    assert same_rng(before_rng, rng_now()) and model.calls == 0
    assert all(torch.equal(before_state[k], v) for k, v in model.state_dict().items())


class Route:
    """A capture stand-in: ``verify`` only runs ``tracked()``."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def tracked(self) -> Any:
        return self.fn


def test_verify_catches_a_route_that_skips_a_buffer_update() -> None:
    torch.manual_seed(0)
    model = Stateful().train()

    def without_statistics(x: Tensor) -> Tensor:  # batch statistics, running ones left alone
        noise = float(np.random.random_sample()) + random.random()
        bn = model.bn
        return (
            model.drop(nn.functional.batch_norm(model.fc(x), None, None, bn.weight, bn.bias, training=True, eps=bn.eps))
            * noise
        )

    outcome = fidelity.verify(
        model, model.forward, [("skips", lambda: Route(without_statistics))], (torch.randn(8, 4),), {}
    )  # type: ignore[list-item, return-value]
    assert outcome.capture is None
    differences = outcome.verdicts[0].differences
    assert "buffer `bn.num_batches_tracked` differs: 1 of 1 elements differ" in differences
    assert any(
        d.startswith("buffer `bn.running_mean` differs: 4 of 4 elements differ, max |difference| ") for d in differences
    )


def test_verify_capture_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"`verify_capture` must be True or False, got 'yes'"):
        ScaleMonitor(verify_capture="yes")  # type: ignore[arg-type]


def test_verify_capture_is_set_from_yaml() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(ScaleMonitor, "monitor")
    cfg = parser.parse_string("monitor:\n  every_n_steps: 10\n  verify_capture: false\n")
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # (renamed in jsonargparse 4.49)
    monitor = instantiate(cfg).monitor
    assert monitor.verify_capture is False


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).square().mean()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path: Any, callbacks: List[Any]) -> Tuple[Net, List[str]]:
    torch.manual_seed(0)
    model = Net()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(24, 4)), batch_size=8)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        callbacks=callbacks,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=pl.loggers.TensorBoardLogger(tmp_path) if callbacks else False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(1)
        trainer.fit(model, data)
    return model, [str(w.message) for w in caught if "ScaleMonitor" in str(w.message)]


def test_a_failing_probe_leaves_training_as_it_is_with_one_warning(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("probe broke")

    plain, _ = fit(tmp_path / "plain", [])
    probed, warned = fit(tmp_path / "probed", [ScaleMonitor(every_n_steps=1)])  # BatchNorm and dropout: state put back
    monkeypatch.setattr(fidelity, "verify", broken)
    failed, failed_warned = fit(tmp_path / "failed", [ScaleMonitor(every_n_steps=1)])
    for other in (probed, failed):
        assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), other.state_dict().values()))
    assert warned == []
    assert failed_warned == [
        "ScaleMonitor: checking the capture of Net failed (RuntimeError: probe broke); training continues untracked."
    ]


def test_where_eager_does_not_reproduce_itself_a_route_may_differ_by_as_much() -> None:
    """Nondeterministic kernels (GPU atomics) make two eager runs differ: such an entry is
    judged against eager's own spread; every deterministic one still bit for bit."""
    import itertools

    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    calls = itertools.count()

    def jitter() -> Tensor:
        # From outside every saved generator, another value on every run (the probe runs at
        # most four forwards here): any two runs differ by 1e-6 to 3e-6, so a route's gap
        # from the eager output stays within 4x eager's own spread, whichever runs compare.
        return torch.tensor((next(calls) % 4) * 1e-6)

    def eager(x: Tensor) -> Tensor:
        return model(x) + jitter()

    def scaled(x: Tensor) -> Tensor:
        return model(x) * 1.01 + jitter()

    x = torch.randn(3, 4)
    outcome = fidelity.verify(
        model, eager, [("scaled", lambda: Route(scaled)), ("same", lambda: Route(eager))], (x,), {}
    )  # type: ignore[list-item, return-value]
    assert outcome.capture is not None and outcome.capture.fn is eager  # type: ignore[attr-defined]
    scaled_verdict, same_verdict = outcome.verdicts
    assert scaled_verdict.within_noise == []  # 1e-2 relative is far above the jitter (<= 3e-6)
    assert [d.split(":")[0] for d in scaled_verdict.differences] == [
        "output differs",
        "gradient of `bias` differs",
        "gradient of `weight` differs",
    ]
    assert same_verdict.matches and same_verdict.within_noise == ["output"]
    assert (
        same_verdict.describe()
        == "same: bit-identical but where the eager forward does not reproduce itself (output: within 4x its spread)"
    )
