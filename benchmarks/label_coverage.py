"""Module outputs tagged, as ``ScaleMonitor``'s first tracked step gets them, and the capture line.

For a tiny Mamba on transformers' slow path (hidden 32, state 4, 2 layers), a tiny Wav2Vec2
trained with its default SpecAugment masking and LayerDrop and a CTC loss, and an MLP whose
three hidden Linears torchao converted to ``Float8Linear`` (emulated): capture with
``auto``, run the fidelity probe on the first batch as the callback does (it may switch the
route), run one tracked step, and count the module calls of an eager run (forward hooks;
containers and the root left out) whose path is a tag. Then the capture line of a model with
sixteen converted layers. Counts, not timings: run it against any checkout with
``PYTHONPATH=<checkout> python benchmarks/label_coverage.py`` to compare.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import random
import warnings
from typing import Any, Callable, Dict, List

import numpy as np
import torch
from torch import Tensor, nn

from lightning_scale.capture import capture
from lightning_scale.record.recorder import Recorder, recording
from lightning_scale.step.verification import check_capture

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")


class Task(nn.Module):
    def __init__(self, model: nn.Module, loss: Callable[[nn.Module, Tensor], Tensor]) -> None:
        super().__init__()
        self.model, self.loss_fn = model, loss

    def forward(self, ids: Tensor) -> Tensor:
        return self.loss_fn(self.model, ids)


def seed(n: int) -> None:
    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def mamba() -> Task:
    import transformers

    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, use_mambapy=False)
    return Task(transformers.MambaForCausalLM(cfg), lambda m, ids: m(input_ids=ids, labels=ids).loss)


def wav2vec2() -> Task:
    import transformers

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
        mask_time_prob=0.05,
    )

    def ctc(m: nn.Module, ids: Tensor) -> Tensor:
        return m(input_values=torch.sin(ids.float().repeat(1, 40)), labels=ids[:, :4] % 15 + 1).loss

    return Task(transformers.Wav2Vec2ForCTC(cfg), ctc)


class MLP(nn.Module):
    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
        self.head = nn.Linear(32, 64)

    def forward(self, ids: Tensor) -> Tensor:
        logits = self.head(torch.relu(self.layers(self.emb(ids))))
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def float8_mlp(layers: int = 3) -> Task:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig(), emulate=True)
    model = convert_to_float8_training(MLP(layers), config=config, module_filter_fn=lambda m, fqn: "layers" in fqn)
    return Task(model, lambda m, ids: m(ids))


def called(task: Task, batch: Tensor) -> List[str]:
    """Paths of the module calls of an eager forward (containers and the root left out)."""
    seen: List[nn.Module] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: seen.append(m))
    seed(3)
    task(batch)
    handle.remove()
    paths = {id(m): p for p, m in task.named_modules()}
    containers = (nn.ModuleList, nn.ModuleDict)
    return sorted({paths[id(m)] for m in seen if paths.get(id(m)) and not isinstance(m, containers)})


def measure(name: str, make: Callable[[], Task]) -> Dict[str, Any]:
    torch._dynamo.reset()
    seed(0)
    task = make()
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    calls = called(copy.deepcopy(task), batch)
    cap = capture(task, "auto")
    seed(3)
    check = check_capture(task, cap, task.forward, (batch,), {}, build=lambda m: capture(task, m), agree=lambda ok: ok)
    cap = check.capture or cap
    seed(3)
    with recording(Recorder()):
        cap.tracked()(batch).backward()
    tags = set(cap.tags)
    route = check.why.rsplit("tracking with ", 1)[-1] if check.capture is not None else "untracked"
    return {"name": name, "route": route, "tagged": [p for p in calls if p in tags], "calls": calls}


def main() -> None:
    for name, make in (("mamba", mamba), ("wav2vec2", wav2vec2), ("float8 MLP", float8_mlp)):
        row = measure(name, make)
        untagged = [p for p in row["calls"] if p not in row["tagged"]]
        tagged = f"{len(row['tagged'])}/{len(row['calls'])}"
        print(f"{name}: {row['route']}; module outputs tagged {tagged}; untagged {untagged}")
    torch._dynamo.reset()
    seed(0)
    cap = capture(float8_mlp(16), "auto")
    with recording(Recorder()):
        cap.tracked()(torch.randint(0, 64, (2, 8))).backward()
    line = cap.describe()
    print(f"capture line, 16 converted layers ({len(line)} characters): {line}")


if __name__ == "__main__":
    main()
