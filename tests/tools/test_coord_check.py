"""coord_check: the table equals float64 references of the same tensors; slopes match
closed forms for standard and unit-scaled MLPs; the figure; argument errors."""

import csv
import io
import math
import sys
from typing import Any, Dict, List, Tuple

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_scale import coord_check
from lightning_scale.tools.coord_check import CoordCheck, CoordRow, op_type

D_IN = 32


class MLP(pl.LightningModule):
    """x -> fc1 -> act1 -> fc2 -> act2 -> out, weights N(0, 1), biases 0.

    ``unit``: every matmul output scaled by 1/sqrt(fan_in) (the ``scale1``/``scale2``
    nodes), so unit-scale inputs keep unit scale at any width.
    """

    def __init__(self, width: int, unit: bool = False, lr: float = 0.0, data: Any = None) -> None:
        super().__init__()
        self.fc1, self.act1 = nn.Linear(D_IN, width), nn.ReLU()
        self.fc2, self.act2 = nn.Linear(width, width), nn.ReLU()
        self.out = nn.Linear(width, 1)
        for layer in (self.fc1, self.fc2, self.out):
            nn.init.normal_(layer.weight)
            nn.init.zeros_(layer.bias)
        self.unit, self.lr, self.data = unit, lr, data

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if self.unit:
            h = h * D_IN**-0.5
        h = self.fc2(self.act1(h))
        if self.unit:
            h = h * self.fc2.in_features**-0.5
        return self.out(self.act2(h))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader:
        return self.data


def _loader(n: int = 128, batch: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(n, D_IN, generator=g), torch.randn(n, 1, generator=g)), batch_size=batch
    )


def _std(t: Tensor) -> float:
    """torch.std in float64; one element has spread 0 (the recorder's convention, not NaN)."""
    return float(t.detach().double().std()) if t.numel() > 1 else 0.0


def _reference(width: int, steps: int, lr: float) -> Dict[Tuple[str, str, int], float]:
    """(node, direction, step) -> std in float64, from module and tensor hooks on a plain
    training loop with the same seed, batches and optimizer."""
    torch.manual_seed(0)
    module = MLP(width, lr=lr)
    opt = module.configure_optimizers()
    out: Dict[Tuple[str, str, int], float] = {}
    step = 0

    def hook(name: str) -> Any:
        def record(mod: nn.Module, args: Any, y: Tensor) -> None:
            s = step
            for node in (f"{name}/{type(mod).__name__.lower()}", name):  # the op, and the module's output
                out[node, "fwd", s] = _std(y)
                y.register_hook(lambda g, node=node: out.__setitem__((node, "bwd", s), _std(g)))  # type: ignore[misc]

        return record

    for name in ("fc1", "act1", "fc2", "act2", "out"):
        getattr(module, name).register_forward_hook(hook(name))
    batches = iter(_loader())
    for step in range(steps):
        x, y = next(batches)
        out["x", "fwd", step] = _std(x)
        params = {n: _std(p) for n, p in module.named_parameters()}
        opt.zero_grad()
        module.training_step((x, y), step).backward()
        for n, p in module.named_parameters():
            out[n, "fwd", step] = params[n]
            out[n, "bwd", step] = _std(p.grad)
        opt.step()
    return out


def test_table_equals_float64_std_of_the_same_tensors() -> None:
    widths, steps, lr = [16, 64], 2, 1e-4
    result = coord_check(lambda w: MLP(w, lr=lr), widths, steps=steps, batches=_loader(), prune_views=False)
    assert result.widths == widths and result.steps == list(range(steps))
    for width in widths:
        ref = _reference(width, steps, lr)
        got = {(r.node, r.direction, r.step): r.std for r in result.rows if r.width == width}
        assert set(got) == set(ref)
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key
    # training moved the weights: step 1 differs from step 0
    w = {r.step: r.std for r in result.rows if r.node == "fc2.weight" and r.direction == "fwd" and r.width == 64}
    assert w[0] != w[1]


def test_standard_grows_as_sqrt_width_unit_scaled_is_flat() -> None:
    widths = [16, 64, 256]
    called: List[int] = []

    def loader(width: int) -> DataLoader:
        called.append(width)
        return _loader(n=256, batch=256)

    standard = coord_check(lambda w: MLP(w), widths, steps=1, batches=loader)
    unit = coord_check(
        lambda w: MLP(w, unit=True, data=_loader(n=256, batch=256)), widths, steps=1
    )  # the module's own loader
    assert called == widths
    s, u = standard.slopes(step=0), unit.slopes(step=0)
    # fc1's fan-in is fixed: std(fc1) = sqrt(D_IN) (standard), 1 (unit), at every width.
    assert abs(s["fc1/linear", "fwd"]) < 0.05 and abs(u["mul", "fwd"]) < 0.05
    # fc2 sums `width` terms of second moment D_IN / 2: std = sqrt(width * D_IN / 2), slope 1/2.
    assert s["fc2/linear", "fwd"] == pytest.approx(0.5, abs=0.03)
    for r in standard.rows:
        if r.node == "fc2/linear" and r.direction == "fwd":
            assert r.std == pytest.approx(math.sqrt(r.width * D_IN / 2), rel=0.05)
    # unit-scaled: std = sqrt(1/2) at every width, slope 0
    assert u["mul_1", "fwd"] == pytest.approx(0.0, abs=0.03)
    for r in unit.rows:
        if r.node == "mul_1" and r.direction == "fwd":
            assert r.std == pytest.approx(math.sqrt(0.5), rel=0.05)
    # the op group "linear" of the standard MLP grows; its slope is the mean of its nodes'
    by_op = standard.slopes(group="op", step=0)
    linear = [s[n, "fwd"] for n in ("fc1/linear", "fc2/linear", "out/linear")]
    assert by_op["linear", "fwd"] == pytest.approx(sum(linear) / 3, abs=1e-9)


def _synthetic() -> CoordCheck:
    """std = c * width**p per node, so slopes are p exactly."""
    rows = []
    for width in (8, 32, 128):
        for node, c, p in (
            ("a.w", 1.0, -0.5),
            ("l1/linear", 2.0, 0.5),
            ("l2/linear_1", 3.0, 0.0),
            ("l2/relu", 0.5, 0.25),
        ):
            rows.append(CoordRow(node, "fwd", width, 0, c * width**p))
            rows.append(CoordRow(node, "bwd", width, 0, 0.0))  # zero std: no log2, left out
    return CoordCheck(tuple(rows), frozenset({"a.w"}))


def test_slopes_groups_and_csv_of_a_known_table() -> None:
    result = _synthetic()
    assert result.slopes() == pytest.approx(
        {("a.w", "fwd"): -0.5, ("l1/linear", "fwd"): 0.5, ("l2/linear_1", "fwd"): 0.0, ("l2/relu", "fwd"): 0.25}
    )
    assert result.slopes(group="op") == pytest.approx(
        {("parameter", "fwd"): -0.5, ("linear", "fwd"): 0.25, ("relu", "fwd"): 0.25}
    )
    assert result.slopes(group=r"^(l\d)/") == pytest.approx({("l1", "fwd"): 0.5, ("l2", "fwd"): 0.125})
    assert result.slopes(group=lambda n: "relu" if n.endswith("relu") else None) == pytest.approx(
        {("relu", "fwd"): 0.25}
    )
    curve = result.curves(group="op")["linear", "fwd"]
    assert curve[8] == pytest.approx((math.log2(2 * 8**0.5) + math.log2(3.0)) / 2)
    assert op_type("blocks.0/add_1") == "add" and op_type("w", ["w"]) == "parameter"
    text = result.to_csv()
    back = list(csv.DictReader(io.StringIO(text)))
    assert [
        CoordRow(d["node"], d["direction"], int(d["width"]), int(d["step"]), float(d["std"])) for d in back
    ] == list(result.rows)
    assert result.to_dicts()[0] == {"node": "a.w", "direction": "fwd", "width": 8, "step": 0, "std": 8**-0.5}


def test_plot_draws_one_line_per_group_and_names_the_extra(monkeypatch: Any) -> None:
    fig = _synthetic().plot(group="op")
    fwd, bwd = fig.axes
    assert sorted(line.get_label() for line in fwd.get_lines()) == [
        "linear (+0.25)",
        "parameter (-0.50)",
        "relu (+0.25)",
    ]
    assert list(fwd.get_lines()[0].get_xdata()) == [8, 32, 128] and not bwd.get_lines()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'pip install "lightning-scale\[plot\]"'):
        _synthetic().plot()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(widths=[16]), ValueError, "`widths` must be a sequence of at least 2 distinct positive"),
        (dict(widths=[16, 16]), ValueError, r"`widths`.*none repeated"),
        (dict(widths=[0, 4]), ValueError, "`widths`"),
        (dict(widths=[4, True]), ValueError, "`widths`"),
        (dict(widths=16), ValueError, r"`widths` must be a list of positive integers, got 16 \(int\)"),
        (dict(widths="816"), ValueError, r"`widths` must be a list of positive integers, got '816' \(str\)"),
        (dict(steps=0), ValueError, "`steps` must be a positive integer, got 0"),
        (dict(steps=1.5), ValueError, r"`steps` must be a positive integer, got 1.5 \(float\)"),
        (dict(steps=True), ValueError, r"`steps` must be a positive integer, got True \(bool\)"),
        (dict(make_module=3), ValueError, "`make_module` must be a callable"),
        (
            dict(make_module=lambda w: nn.Linear(w, w)),
            TypeError,
            "`make_module` must return a LightningModule, got Linear",
        ),
        (dict(batches=5), ValueError, r"`batches` must be a DataLoader .*got 5 \(int\)"),
        (dict(seed="0"), ValueError, r"`seed` must be an integer, got '0' \(str\)"),
        (dict(seed=False), ValueError, r"`seed` must be an integer, got False \(bool\)"),
        (dict(trainer_options=[1]), ValueError, "`trainer_options` must be a dict of Trainer arguments, got list"),
        (dict(trainer_options={"logger": False}), ValueError, r"`trainer_options` must not set \['logger'\]"),
        (dict(include="("), ValueError, "`include` must be a valid regular expression"),
        (
            dict(exclude=b"fc"),
            ValueError,
            r"`exclude` must be a regular expression \(a str\) or None, got b'fc' \(bytes\)",
        ),
        (dict(prune_views="no"), ValueError, r"`prune_views` must be True or False, got 'no' \(str\)"),
    ],
)
def test_arguments_are_checked(kwargs: Dict[str, Any], error: type, match: str) -> None:
    args: Dict[str, Any] = dict(make_module=lambda w: MLP(w), widths=[8, 16], steps=1, batches=_loader())
    args.update(kwargs)
    with pytest.raises(error, match=match):
        coord_check(**args)


def test_result_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"`step` must be one of the tracked steps \[0\], got 3"):
        _synthetic().slopes(step=3)
    with pytest.raises(ValueError, match="`group` must be 'node', 'op' or a valid regular expression"):
        _synthetic().curves(group="(")
    with pytest.raises(ValueError, match=r"`group` must be 'node', 'op', a regex or a callable, got 5 \(int\)"):
        _synthetic().curves(group=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`axes` must be two matplotlib axes"):
        _synthetic().plot(axes=[None])


class Bypass(MLP):
    """Calls a submodule, not ``self(...)``: the captured forward never runs."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self.out(self.act1(self.fc1(x))).expand_as(y), y)


def test_a_width_that_records_nothing_raises() -> None:
    with (
        pytest.warns(UserWarning, match="nothing recorded"),
        pytest.raises(RuntimeError, match=r"at width 8 ScaleMonitor recorded steps \[\], expected 0..0"),
    ):
        coord_check(lambda w: Bypass(w), [8, 16], steps=1, batches=_loader())


@pytest.mark.parametrize("dim", [32, 128])
def test_unit_scaled_gpt_has_unit_scale_at_init(dim: int) -> None:
    from lightning_scale.tools.models import GPT, GPTConfig, UnitLinear

    torch.manual_seed(0)
    x = torch.randn(256, 4 * dim)
    layer = UnitLinear(4 * dim, dim)
    assert float(layer.weight.std()) == pytest.approx(1.0, rel=0.05) and float(layer.bias.abs().max()) == 0.0
    assert float(layer(x).std()) == pytest.approx(1.0, rel=0.05)  # sum of 4*dim unit terms / sqrt(4*dim)
    model = GPT(GPTConfig(vocab=64, seq=16, layers=2, dim=dim, heads=4, unit_scaled=True))
    idx = torch.randint(64, (8, 16))
    assert float(model(idx).std()) == pytest.approx(1.0, rel=0.1)  # LayerNorm'd input, unit head
    emb = model.tok(idx) + model.pos(torch.arange(16))
    assert float(emb.std() * 2**-0.5) == pytest.approx(1.0, rel=0.1)
    assert all(
        type(m) is torch.nn.Linear
        for m in GPT(GPTConfig(dim=dim, layers=1)).modules()
        if isinstance(m, torch.nn.Linear)
    )
