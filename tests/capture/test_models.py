"""Real models, built from tiny configs: tracking never changes training, covers the model,
warns about nothing, and records what independent float64 hooks measure.

Every case trains two steps tracked and two steps eagerly and compares gradients, parameters
and buffers bit for bit, checks module outputs against forward and tensor hooks on the
eager copy (float64) and the coverage report. One case per capture route also trains in a
``Trainer`` with and without ``ScaleMonitor(every_n_steps=1)``, compared bit for bit. torchvision does
not import against the CPU torch build and timm imports torchvision: neither is here.
"""

from __future__ import annotations

import copy
import os
import random
import warnings
from typing import Any, Callable, Dict, List, Tuple

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import Tensor, nn

from tests.compiling import tiny_llama
from lightning_scale.record import stats
from lightning_scale.callback import ScaleMonitor
from lightning_scale.capture import capture
from lightning_scale.record.recorder import BACKWARD, FORWARD, Recorder, recording

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
VOCAB, SEQ, BATCH = 64, 8, 2


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    yield
    torch._dynamo.reset()


def tokens(seed: int) -> Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def lm_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss


def t5_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids.flip(1)).loss


def gpt2(checkpointing: bool = False) -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(cfg)
    if checkpointing:
        model.gradient_checkpointing_enable()
    return model


def bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(cfg)


def t5() -> nn.Module:
    cfg = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0
    )
    return transformers.T5ForConditionalGeneration(cfg)


def llama() -> nn.Module:
    return tiny_llama(VOCAB)


def mixtral() -> nn.Module:
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
    )
    return transformers.MixtralForCausalLM(cfg)


def demo_transformer() -> nn.Module:
    from lightning.pytorch.demos import Transformer

    return Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1)


def demo_loss(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(ids, ids)
    return nn.functional.nll_loss(out.view(-1, out.size(-1)), ids.view(-1))


def unit_scaled() -> nn.Module:
    uu = pytest.importorskip("unit_scaling")

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = uu.Embedding(VOCAB, 64)
            self.fc1 = uu.Linear(64, 256)
            self.fc2 = uu.Linear(256, 64)
            self.head = uu.Linear(64, VOCAB)

        def forward(self, ids: Tensor, labels: Tensor) -> Any:
            h = self.fc2(uu.functional.gelu(self.fc1(self.embed(ids))))
            return type("Out", (), {"loss": uu.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())})

    return MLP()


def unit_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(ids, ids).loss


def olmoe() -> nn.Module:
    """A real transformers MoE asked for its router logits (output-capturing hooks,
    registered on the first forward that wants them)."""
    cfg = transformers.OlmoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=16,
        output_router_logits=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.OlmoeForCausalLM(cfg)


def wav2vec2() -> nn.Module:
    """CTC speech model with SpecAugment (`mask_time_prob`): its masks come from numpy."""
    cfg = transformers.Wav2Vec2Config(
        vocab_size=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.3,
        mask_time_length=2,
        layerdrop=0.0,  # (LayerDrop skips the one layer on some steps: no records of it there, by design)
    )
    return transformers.Wav2Vec2ForCTC(cfg)


def ctc_loss(model: nn.Module, ids: Tensor) -> Tensor:
    audio = torch.sin(ids.float().repeat(1, 40))  # (B, 320) samples
    return model(input_values=audio, labels=ids[:, :4] % 15 + 1).loss


def mamba() -> nn.Module:
    """Takes its `associative_scan` path while dynamo compiles it."""
    cfg = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=4
    )
    return transformers.MambaForCausalLM(cfg)


def moe_loss(model: nn.Module, ids: Tensor) -> Tensor:
    out = model(input_ids=ids, labels=ids)
    assert out.aux_loss is not None  # the router logits were collected
    return out.loss


class RecurrentLM(nn.Module):
    """Embedding, a 2-layer LSTM or GRU with dropout between layers, a head."""

    def __init__(self, cell: str = "lstm") -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(32, 32, num_layers=2, batch_first=True, dropout=0.1)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        h, _ = self.rnn(self.embed(ids))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class NumpyMasked(nn.Module):
    """SpecAugment-style masking of feature channels drawn from numpy's generator."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mask_embed = nn.Parameter(torch.rand(32))
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        h = self.embed(ids)
        if self.training:  # (a fixed shape: an fx trace would draw it once, for every step)
            mask = torch.from_numpy(np.random.random_sample(32) < 0.3)
            h = torch.where(mask, self.mask_embed, h)
        h = torch.relu(self.fc(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class Gate(nn.Module):
    """Data-dependent control flow: fx keeps it as a leaf, so ``auto`` picks dynamo."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, h: Tensor) -> Tensor:
        return h if h.abs().max() > 1e6 else self.fc(h)


class CompileAware(nn.Module):
    """Takes another path while TorchDynamo traces it, asked as such (``is_dynamo_compiling``:
    the probe's dynamo variant with ``is_compiling()`` false, which puts Mamba's scan back, keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.gate = Gate()
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        h = self.embed(ids)
        h = h * (1 + 2**-20) if torch.compiler.is_dynamo_compiling() else h  # (another algorithm: other rounding)
        h = self.gate(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, 3, padding=1, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pw1, self.pw2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop_path = nn.Identity()  # (drop_path_rate=0, as ConvNeXt and Swin build it)

    def forward(self, x: Tensor) -> Tensor:
        y = self.dwconv(x.transpose(1, 2)).transpose(1, 2)
        return x + self.drop_path(self.pw2(nn.functional.gelu(self.pw1(self.norm(y)))))


class ConvNeXtLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.Sequential(*[ConvNeXtBlock(16) for _ in range(3)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        return nn.functional.cross_entropy(self.head(self.blocks(self.embed(ids))).flatten(0, 1), labels.flatten())


def plain_loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(ids, ids)


# name -> (builder, loss, modules whose output is checked against hooks)
CASES: Dict[str, Tuple[Callable[[], nn.Module], Callable[[nn.Module, Tensor], Tensor], List[str]]] = {
    # (GPT-2's loss starts with a graph break right after `lm_head`: it had returned, so its
    # output is tagged, capture/breaks.py)
    "gpt2": (gpt2, lm_loss, ["transformer.h.0.mlp.c_fc", "transformer.h.1.ln_2", "transformer.ln_f", "lm_head"]),
    "gpt2-checkpointing": (
        lambda: gpt2(True),
        lm_loss,
        ["transformer.h.0.mlp.c_fc", "transformer.h.1.ln_2", "transformer.ln_f"],
    ),
    "bert": (bert, lm_loss, ["bert.encoder.layer.0.intermediate.dense", "bert.encoder.layer.1.output.LayerNorm"]),
    "t5": (t5, t5_loss, ["encoder.block.0.layer.1.DenseReluDense.wi", "decoder.final_layer_norm", "lm_head"]),
    "llama": (llama, lm_loss, ["model.layers.0.mlp.down_proj", "model.layers.1.input_layernorm", "lm_head"]),
    "mixtral": (mixtral, lm_loss, ["model.layers.0.self_attn.q_proj", "lm_head"]),
    "lightning-demo-transformer": (demo_transformer, demo_loss, ["transformer.encoder.layers.0.linear1", "decoder"]),
    "unit-scaling": (unit_scaled, unit_loss, ["fc1", "fc2", "head"]),
    "olmoe-router-logits": (olmoe, moe_loss, ["model.layers.0.self_attn.q_proj", "lm_head"]),
    "lstm-lm": (RecurrentLM, plain_loss, ["embed", "rnn", "head"]),
    "gru-lm": (lambda: RecurrentLM("gru"), plain_loss, ["rnn", "head"]),
    "numpy-rng": (NumpyMasked, plain_loss, ["fc", "head"]),
    "convnext-drop-path": (ConvNeXtLM, plain_loss, ["blocks.0.drop_path", "blocks.2.pw2", "head"]),
    "wav2vec2-specaugment": (
        wav2vec2,
        ctc_loss,
        ["wav2vec2.feature_extractor.conv_layers.1.conv", "wav2vec2.feature_extractor", "lm_head"],
    ),
}
# Trained only in a Trainer, where the fidelity probe chooses the route: dynamo changes
# this model's forward, so the step by step test below, which captures with `auto`
# alone, would not match.
PROBED: Dict[str, Tuple[Callable[[], nn.Module], Callable[[nn.Module, Tensor], Tensor], List[str]]] = {
    "is-compiling-branch": (CompileAware, plain_loss, ["gate", "head"]),
    # (the probe tracks it with dynamo, `is_compiling()` false: the mixers' projections are tagged)
    "mamba": (
        mamba,
        lm_loss,
        [f"backbone.layers.0.mixer.{p}" for p in ("in_proj", "x_proj", "out_proj")] + ["lm_head"],
    ),
}


class Task(pl.LightningModule):
    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Tensor], Tensor]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss

    def forward(self, ids: Tensor) -> Tensor:
        return self.loss_fn(self.model, ids)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def seed(n: int) -> None:
    """Every generator a forward may draw from: torch's, numpy's, Python's."""
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def fit(
    tmp_path: Any,
    name: str,
    make: Callable[[], nn.Module],
    loss: Callable[[nn.Module, Tensor], Tensor],
    monitor: bool,
    task: type = None,
    **kwargs: Any,
) -> Tuple[pl.LightningModule, List[str], Any]:
    torch.manual_seed(0)
    module = (task or Task)(make(), loss)
    data = torch.utils.data.DataLoader([tokens(i)[0] for i in range(6)], batch_size=BATCH)
    callback = ScaleMonitor(every_n_steps=1, figure=False, **kwargs) if monitor else None
    trainer = pl.Trainer(
        default_root_dir=tmp_path / name,
        max_steps=2,
        callbacks=[callback] if callback else [],
        accelerator="cpu",
        devices=1,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=pl.loggers.TensorBoardLogger(tmp_path / name) if monitor else False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seed(1)
        trainer.fit(module, data)
    module.warned = [f"{w.category.__name__}: {w.message}" for w in caught]  # every warning, whoever raised it
    return module, [str(w.message) for w in caught if "ScaleMonitor" in str(w.message)], callback


def same_state(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# Trainer runs cost seconds each: one per capture route (fx leaves, dynamo with graph
# breaks and checkpointing, side effects in forward, unit scaling) and each model of the
# fidelity round (RNN leaves, MoE hooks, numpy draws, a route the probe must switch,
# Identity); every case also trains bit-identically step by step below, outside the Trainer.
TRAINER_CASES = [
    "gpt2-checkpointing",
    "mixtral",
    "lightning-demo-transformer",
    "unit-scaling",
    "olmoe-router-logits",
    "lstm-lm",
    "numpy-rng",
    "is-compiling-branch",
    "convnext-drop-path",
    "mamba",
]


@pytest.mark.parametrize("name", TRAINER_CASES)
def test_training_is_bit_identical_and_warns_about_nothing(tmp_path: Any, name: str) -> None:
    make, loss, paths = {**CASES, **PROBED}[name]
    plain, _, _ = fit(tmp_path, "plain", make, loss, monitor=False)
    tracked, warned, monitor = fit(tmp_path, "tracked", make, loss, monitor=True)
    # No warning at all: causal masks (-inf) are counted, not warned; coverage is >= 90%;
    # and no warning of torch's or dynamo's that the plain fit does not raise too.
    assert warned == []
    assert [w for w in tracked.warned if w not in plain.warned] == []
    for (key, a), b in zip(plain.state_dict().items(), tracked.state_dict().values()):
        assert torch.equal(a, b), key
    cap = next(iter(monitor.captures.values()))
    assert {f"model.{p}" for p in paths} <= set(cap.tags)  # module outputs under their paths


def test_the_probe_switches_to_the_route_that_keeps_the_forward(tmp_path: Any) -> None:
    """Dynamo makes `is_dynamo_compiling()` true: the probe sees the loss differ and tracks with fx
    (the data-dependent gate a leaf); without the probe, dynamo's forward trains differently."""
    make, loss, _ = PROBED["is-compiling-branch"]
    plain, _, _ = fit(tmp_path, "plain", make, loss, monitor=False)
    _, warned, monitor = fit(tmp_path, "probed", make, loss, monitor=True)
    assert warned == [] and [c.mode for c in monitor.captures.values()] == ["fx"]
    unverified, warned, monitor = fit(tmp_path, "unverified", make, loss, monitor=True, verify_capture=False)
    assert warned == [] and [c.mode for c in monitor.captures.values()] == ["dynamo"]
    assert not same_state(plain, unverified)


class CompileAwareTask(Task):
    """No route reproduces it: fx cannot trace its own forward, dynamo changes it."""

    def forward(self, ids: Tensor) -> Tensor:
        loss = self.loss_fn(self.model, ids)
        if ids.sum() < 0:  # data-dependent: fx fails on the captured module itself
            loss = -loss
        return loss * (1 + 2**-20) if torch.compiler.is_dynamo_compiling() else loss


def test_a_model_no_route_reproduces_trains_untracked_with_one_warning(tmp_path: Any) -> None:
    """``shadow="never"``: where the probe refuses tracking in place, nothing is tracked."""
    make, loss = RecurrentLM, plain_loss
    plain, _, _ = fit(tmp_path, "plain", make, loss, monitor=False, task=CompileAwareTask)
    tracked, warned, monitor = fit(tmp_path, "tracked", make, loss, monitor=True, task=CompileAwareTask, shadow="never")
    assert same_state(plain, tracked)
    assert len(warned) == 1, warned
    assert warned[0].startswith(
        "ScaleMonitor: the captured forward of CompileAwareTask does not reproduce its own forward bit for bit, "
        "so tracking would change training (dynamo: output differs: 1 of 1 elements differ, max |difference| "
    )
    assert "; gradient of `model.head.bias` differs: 64 of 64 elements differ" in warned[0]
    assert (
        "; fx: could not capture (CaptureError: torch.fx could not trace CompileAwareTask: TraceError: symbolically "
        "traced" in warned[0]
    )
    assert warned[0].endswith("pass `verify_capture=False` to track it anyway; training continues untracked.")
    # one capture, its probe failed: no other step tracked
    assert monitor.captures.disabled and list(monitor.captures.values())


def test_a_model_no_route_reproduces_is_tracked_by_a_shadow_pass(tmp_path: Any) -> None:
    """By default (``shadow="auto"``) the route the probe refused still runs: the step trains
    untouched and a shadow pass records, through the route that ran (dynamo: fx cannot trace
    this model). Its loss is the instrumented version's: 1 + 2**-20 times the model's."""
    make, loss = RecurrentLM, plain_loss
    plain, _, _ = fit(tmp_path, "plain", make, loss, monitor=False, task=CompileAwareTask)
    tracked, warned, monitor = fit(tmp_path, "tracked", make, loss, monitor=True, task=CompileAwareTask)
    assert same_state(plain, tracked) and warned == []
    (cap,) = list(monitor.captures.values())
    assert cap.mode == "dynamo" and cap.shadowed and not monitor.captures.disabled
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(tracked.trainer.logger.log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("scale/")]
    assert "scale/fwd/model.rnn" in tags and "scale/bwd/model.head.weight" in tags
    assert {e.step for e in acc.Scalars("scale/bwd/model.head.weight")} == {0, 1}


def hook_reference(model: nn.Module, paths: List[str], run: Callable[[], Tensor]) -> Dict[str, Tuple[float, float]]:
    """(forward std, gradient std) in float64 of each module's output, from hooks."""
    outs: Dict[str, Tensor] = {}
    grads: Dict[str, Tensor] = {}

    def keep(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            out = out[0] if isinstance(out, tuple) else out  # (an RNN's output, state)
            outs[path] = out.detach().double().clone()
            out.register_hook(lambda g: grads.__setitem__(path, g.double()))

        return hook

    handles = [model.get_submodule(p).register_forward_hook(keep(p)) for p in paths]
    run().backward()
    for h in handles:
        h.remove()
    return {p: (float(outs[p].std()), float(grads[p].std())) for p in paths}


@pytest.mark.parametrize("name", list(CASES))
def test_records_match_hooks_train_bit_identically_and_cover_the_model(name: str) -> None:
    make, loss, paths = CASES[name]
    torch.manual_seed(0)
    model = make().train()
    reference = copy.deepcopy(model)
    cap = capture(Task(model, loss), "auto")
    for step in range(2):
        ids = tokens(step)
        rec = Recorder()
        seed(step + 1)
        with recording(rec):
            out = cap.tracked()(ids)
        out.backward()
        records = rec.records(cap.tags, cap.aliases)
        rec.clear()
        seed(step + 1)
        expected = hook_reference(reference, paths, lambda ids=ids: loss(reference, ids))  # type: ignore[misc]
        for (key, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), key
        sgd_step(model)
        sgd_step(reference)
    for (key, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), key
    std = stats.statistic(records, "std")
    for path, (fwd, bwd) in expected.items():
        i = cap.tags.index(f"model.{path}")
        assert float(std[i, FORWARD]) == pytest.approx(fwd, rel=1e-5), path
        assert float(std[i, BACKWARD]) == pytest.approx(bwd, rel=1e-4), path
    recorded = [label for label, row in zip(cap.tags, records) if bool((row[:, 0] > 0).any())]
    report = cap.coverage(recorded)
    assert report.warning() is None, report.warning()
    assert min(report.parameter_fraction, report.module_fraction) >= 0.9


def sgd_step(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.1 * p.grad
                p.grad = None


def test_unit_scaled_layer_outputs_sit_near_one() -> None:
    """The module output of a unit-scaled Linear is its scaled output (std ~1), not the
    unscaled matmul inside it (std ~sqrt(fan_in))."""
    uu = pytest.importorskip("unit_scaling")
    torch.manual_seed(0)
    model = nn.Sequential(uu.Linear(256, 256), uu.Linear(256, 256))
    cap = capture(model, "auto")
    rec = Recorder()
    with recording(rec):
        out = cap.tracked()(torch.randn(64, 256))
    out.sum().backward()
    std = stats.statistic(rec.records(cap.tags, cap.aliases), "std")[:, FORWARD]
    for path in ("0", "1"):
        assert float(std[cap.tags.index(path)]) == pytest.approx(1.0, abs=0.1), path
    assert float(std[cap.tags.index("0/linear")]) > 5  # the unscaled matmul, fan_in 256
