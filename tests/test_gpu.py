"""GPU checks (skipped without CUDA; run by `make gpu-check` on a machine with a GPU)."""

from __future__ import annotations

import pytest
import torch

from lightning_scale.record import stats
from lightning_scale.capture import capture
from lightning_scale.report.pool import pool
from lightning_scale.tools.models import GPT, GPTConfig, synthetic_tokens
from lightning_scale.record.recorder import Recorder, recording

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _tracked_step(dtype: torch.dtype) -> tuple:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, dim=128)).cuda()
    x, y = (t.cuda() for t in synthetic_tokens(8, 64, 256))
    cap = capture(model, "fx")
    rec = Recorder(("moments", "range", "formats"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=dtype), recording(rec):
            logits = cap.tracked()(x)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        labels = cap.node_labels
        records = rec.records(labels, cap.aliases)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return labels, records, rec, model, x


def test_no_sync_before_the_one_read() -> None:
    labels, records, rec, _, _ = _tracked_step(torch.bfloat16)
    assert records.is_cuda
    host, _ = pool(records, labels)  # the one transfer
    assert (host[..., 0] > 0).any()
    rec.clear()


def test_gpu_statistics_match_float64() -> None:
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (1 + 1e-3 * torch.randn(100_000, device="cuda")).to(dtype)
        rec = stats.assemble([stats.record_of(x, ("moments", "range", "formats"))]).cpu()
        ref = x.double().cpu()
        assert float(stats.statistic(rec, "std")[0]) == pytest.approx(float(ref.std()), rel=1e-4)
        assert float(stats.statistic(rec, "absmax")[0]) == float(ref.abs().max())


def test_anomaly_detection_never_syncs_on_steps_it_reads_in_time() -> None:
    from lightning_scale.step.anomaly import AnomalyDetector

    det = AnomalyDetector(steps=2)
    losses = [torch.tensor(v, device="cuda") for v in [1.0] * 6 + [50.0] + [1.0] * 5]
    scale = torch.tensor(2.0**16, device="cuda")
    tracked = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any blocking device read raises
    try:
        for step, loss in enumerate(losses):
            if step >= 2:
                det._copying[2].synchronize()  # type: ignore[index]  # the test, not the detector, waits
            det.poll(step)
            tracked += [step] if det.tracks(step) else []
            det.observe(step, loss * 1, scale, scale * 1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert det.stalls == 0 and tracked == [8, 9]


def test_fused_kernel_matches_torch_kernels_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` takes the fused Triton kernel on CUDA; every field as torch's kernels give it
    (moments within 1e-6, counts and extremes exact), strided and half inputs included."""
    pytest.importorskip("triton")
    from lightning_scale.record import kernels

    torch.manual_seed(0)
    groups = ("moments", "range", "formats", "fp8")
    base = torch.randn(4096, 3 * 512, device="cuda") * 3 + 1
    base[0, 0], base[1, 1], base[2, 2] = float("nan"), float("inf"), 0.0
    for x in (base, base[:, 512:1024], base.t(), base.bfloat16(), base.half()[:, :700]):
        assert kernels.uses_triton(x, "auto")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fused = stats.assemble([stats.record_of(x, groups, host_reads=False, kernel="triton")])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ref = stats.assemble([stats.record_of(x, groups, host_reads=False, kernel="torch")])
        torch.testing.assert_close(fused.cpu(), ref.cpu(), rtol=1e-6, atol=0, equal_nan=True)
