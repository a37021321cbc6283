"""Shared by the compiled-model tests and their rank script: a tiny Hugging Face Llama and
a callback counting dynamo's compiled graphs."""

from __future__ import annotations

import os
from typing import Any, List

import lightning.pytorch as pl
import torch
from torch import nn


def tiny_llama(vocab: int) -> nn.Module:
    """``LlamaForCausalLM`` of 2 layers, hidden size 32, 2 heads sharing one key/value head."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(cfg)


class GraphCount(pl.Callback):
    """Dynamo's count of compiled graphs at the end of each training batch."""

    def __init__(self) -> None:
        self.counts: List[int] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.counts.append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
