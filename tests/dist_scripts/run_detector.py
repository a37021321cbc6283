"""One rank of the two-rank AnomalyDetector test over gloo, without Lightning.

Usage: ``python run_detector.py OUT RANK`` with ``MASTER_ADDR``/``MASTER_PORT`` set. Rank 1
alone sees a loss spike at step 6 and a NaN at step 12; both ranks must track the same
steps. Writes ``OUT/rank<RANK>.pt``: the tracked steps and the events.

``anomaly.py`` imports only torch and ``lightning_scale.arguments``, so both are loaded from
their files under an empty ``lightning_scale`` package: a rank then starts in the time torch
takes to import, not Lightning's (the package ``__init__`` imports the callback, hence
Lightning).
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, List

import torch
import torch.distributed as dist

_PACKAGE = Path(__file__).resolve().parents[2] / "lightning_scale"
_FILE = _PACKAGE / "step" / "anomaly.py"


def _anomaly_module() -> Any:
    package = types.ModuleType("lightning_scale")  # without its __init__ (Lightning)
    package.__path__ = [str(_PACKAGE)]
    sys.modules["lightning_scale"] = package
    spec = importlib.util.spec_from_file_location("_anomaly_alone", _FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def losses_of(rank: int) -> List[float]:
    """Every rank's losses: all 1.0, but rank 1 spikes at step 6 and is NaN at step 12."""
    losses = [1.0] * 20
    if rank == 1:
        losses[6], losses[12] = 40.0, math.nan
    return losses


def main(out: Path, rank: int) -> None:
    anomaly = _anomaly_module()
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    det = anomaly.AnomalyDetector(steps=2)
    tracked = []
    for step, loss in enumerate(losses_of(rank)):  # as the callback drives it
        det.poll(step)
        if det.tracks(step):
            tracked.append(step)
        det.observe(step, torch.tensor(loss))
    torch.save(
        {"tracked": tracked, "events": [(a.step, a.loss, a.reason) for a in det.anomalies]}, out / f"rank{rank}.pt"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
