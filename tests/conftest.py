"""Test-session setup: Triton's interpreter on machines without CUDA.

``TRITON_INTERPRET=1`` must be set before triton is imported (it decides at each
``@triton.jit`` whether to compile or interpret), so it is set here, before any test
module loads. With it, ``LIGHTNING_SCALE_KERNEL=triton`` runs the fused statistics
kernel (``lightning_scale.record.triton_stats``) on CPU tensors; ``auto`` keeps CPU
tensors on torch's kernels, so other tests are unaffected.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
