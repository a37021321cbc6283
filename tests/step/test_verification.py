"""The capture check's outcome (``step.verification.check_capture``) and what the callback
does with it: verified, switched, failed, interrupted; and a 2-rank gloo run where rank 1
raises on the probed step: the fit ends with rank 1's error, and rank 0 does not claim
that training continues untracked."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, List

import pytest
import torch
from torch import Tensor, nn

from lightning_scale.capture import Capture, capture
from lightning_scale.step.verification import CaptureCheck, Verification, check_capture

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "run_probe_raise.py"


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    yield
    torch._dynamo.reset()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.fc(x))


class Doubled:
    """A capture stand-in whose forward is not the model's: twice its output."""

    mode = "fx"

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def tracked(self) -> Callable[[Tensor], Tensor]:
        return lambda x: 2 * self.model(x)


def check(model: nn.Module, cap: Any, build: Callable[[str], Capture], **kwargs: Any) -> CaptureCheck:
    eager = kwargs.pop("eager", model.forward)
    agree = kwargs.pop("agree", lambda ok: ok)
    return check_capture(model, cap, eager, (torch.randn(2, 4),), {}, build=build, agree=agree)


def test_a_capture_that_reproduces_the_forward_is_verified() -> None:
    model = Net()
    cap = capture(model, "fx")
    out = check(model, cap, build=lambda mode: pytest.fail("the other route is not needed"))
    assert (out.kind, out.checked, out.capture) == ("verified", cap, cap)
    assert out.why == "ScaleMonitor: capture of Net verified (fx: bit-identical); tracking with fx"


def test_a_capture_that_differs_switches_to_the_other_route() -> None:
    model = Net()
    wrong, built = Doubled(model), []

    def build(mode: str) -> Capture:
        built.append(mode)
        return capture(model, mode)

    out = check(model, wrong, build=build)
    assert built == ["dynamo"]
    assert out.kind == "switched" and out.checked is wrong and out.capture is not None
    assert out.capture.mode == "dynamo"
    assert out.why.startswith("ScaleMonitor: capture of Net verified (fx: output differs: 6 of 6 elements differ")
    assert out.why.endswith("dynamo: bit-identical); tracking with dynamo")


def test_no_route_that_reproduces_the_forward_fails_with_the_reason() -> None:
    model = Net()
    out = check(model, Doubled(model), build=lambda mode: Doubled(model))  # type: ignore[arg-type, return-value]
    assert (out.kind, out.capture) == ("failed", None)
    assert out.why.startswith("the captured forward of Net does not reproduce its own forward bit for bit")
    assert out.why.endswith("pass `verify_capture=False` to track it anyway")


def test_the_models_own_forward_raising_interrupts_the_check() -> None:
    model = Net()

    def eager(x: Tensor) -> Tensor:
        raise ValueError("user forward failed")

    out = check(model, capture(model, "fx"), build=lambda mode: pytest.fail("no route is tried"), eager=eager)
    assert (out.kind, out.capture) == ("interrupted", None)
    assert out.why.startswith(
        "the check of the capture of Net was interrupted "
        "(the model's own forward raised ValueError: user forward failed"
    )


def test_ranks_that_cannot_agree_interrupt_the_check() -> None:
    model = Net()

    def agree(ok: bool) -> bool:
        raise RuntimeError("Connection closed by peer")

    out = check(model, capture(model, "fx"), build=lambda mode: pytest.fail("no other route"), agree=agree)
    assert (out.kind, out.capture) == ("interrupted", None)
    assert out.why == (
        "the check of the capture of Net was interrupted (the ranks could not compare verdicts "
        "(RuntimeError: Connection closed by peer); another rank has likely failed)"
    )


def test_only_acted_on_checks_are_settled() -> None:
    model = Net()
    cap, other = capture(model, "fx"), capture(model, "dynamo")
    verification = Verification(True)
    verification.settle(CaptureCheck("interrupted", cap, None, "interrupted"))
    assert verification.probes(cap, "DDPStrategy")  # probed again on its next tracked step
    verification.settle(CaptureCheck("switched", cap, other, "switched"))
    assert not verification.probes(cap, "DDPStrategy") and not verification.probes(other, "DDPStrategy")
    assert not Verification(True).probes(cap, "FSDPStrategy")
    with pytest.raises(ValueError, match=r"`verify_capture` must be True or False, got 1"):
        Verification(1)  # type: ignore[arg-type]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(out: Path, callback: str) -> "subprocess.Popen[str]":
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    cmd = [sys.executable, str(SCRIPT), str(out), callback]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def test_rank_1_raising_on_the_probed_step_ends_the_fit_without_a_false_warning(tmp_path: Path) -> None:
    procs = [_start(tmp_path / cb, cb) for cb in ("off", "on")]  # together: much of a run is start-up
    outputs: List[str] = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    for proc, output in zip(procs, outputs):
        assert proc.returncode != 0, output[-3000:]
        assert "ValueError: rank 1 failed in forward" in output, output[-3000:]  # rank 1's own error
    with_callback = outputs[1]
    assert "ScaleMonitor: captured Module" in with_callback  # the callback ran
    assert "training continues untracked" not in with_callback
    assert "checking the capture" not in with_callback
