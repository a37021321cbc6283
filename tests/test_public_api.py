"""The public API: exactly these names, sorted, each importable from the package."""

import lightning_scale

PUBLIC = {
    "Capture",
    "CaptureError",
    "DeepTracer",
    "Recorder",
    "ScaleMonitor",
    "ScalePair",
    "ScaleTrackingInterpreter",
    "Statistic",
    "analyse_module",
    "capture",
    "check_recipe",
    "coord_check",
    "records_table",
    "recording",
}


def test_all_is_sorted_and_complete() -> None:
    assert lightning_scale.__all__ == sorted(lightning_scale.__all__)
    assert set(lightning_scale.__all__) == PUBLIC
    for name in lightning_scale.__all__:
        assert getattr(lightning_scale, name) is not None
