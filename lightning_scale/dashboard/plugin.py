"""The ``scales`` TensorBoard plugin: routes that read what ``ScaleMonitor`` wrote, JSON out.

Registered through the ``tensorboard_plugins`` entry point, so it appears in any
TensorBoard started where the package is installed. Its frontend is the static ES module
``static/index.js`` (no build step); the server does the arithmetic (ranking, per-step
tables, which nodes are outside which format) on the run's per-step records
(``data.py``), cached until the run's logs grow, and the browser draws.

Routes (``run`` and ``prefix`` select a run and ``""`` / ``"val_"``): ``/runs``,
``/profile?step=``, ``/heatmap?stat=``, ``/series?label=``, ``/worst?step=&by=&regex=``,
``/code?step=``, ``/table`` (the formats and the statistics' declarations: the browser keeps
no list of its own), ``/advice?recipe=&snr_db=&flushed=`` (the precision advisor's decisions);
the Compare view's, with ``other`` naming run B: ``/compare?step=&stat=``,
``/compare_heatmap?stat=``, ``/compare_series?label=&stat=`` (``compare_tables.py``).
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import Request, wrappers

from lightning_scale.dashboard import advice, compare_tables, data, metadata, statistics, tables

__all__ = ["ScalesPlugin"]

_STATIC = Path(__file__).parent / "static"
_TYPES = {".js": "text/javascript", ".css": "text/css"}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def _dumps(body: Any) -> str:
    """JSON of ``body``; the tables already write non-finite values as None, so the walk that
    replaces them (a third of a 2,000-node profile's time) runs only where one slipped through."""
    try:
        return json.dumps(body, allow_nan=False)
    except ValueError:
        return json.dumps(_json_safe(body))


class ScalesPlugin(base_plugin.TBPlugin):
    """Profile, heatmap, worst nodes and annotated code of the scales ``ScaleMonitor`` logged.

    Args:
        context: TensorBoard's ``TBContext`` (its ``data_provider`` is read).
    """

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider
        self._cache: Dict[Tuple[str, str, str], Tuple[tuple, data.RunData]] = {}
        self._lock = threading.Lock()

    def get_plugin_apps(self) -> Dict[str, Callable[..., Any]]:
        """Routes: the static frontend files and the JSON endpoints."""
        apps: Dict[str, Callable[..., Any]] = {
            f"/{p.name}": self._static(p) for p in _STATIC.iterdir() if p.suffix in _TYPES
        }
        apps.update(
            {
                "/runs": self._runs,
                "/profile": self._profile,
                "/heatmap": self._heatmap,
                "/series": self._series,
                "/worst": self._worst,
                "/code": self._code,
                "/table": self._table,
                "/compare": self._compare,
                "/compare_heatmap": self._compare_heatmap,
                "/compare_series": self._compare_series,
                "/advice": self._advice,
            }
        )
        return apps

    def data_plugin_names(self) -> Tuple[str, ...]:
        """Active wherever the writer stored a node list."""
        return (metadata.PLUGIN_NAME,)

    def is_active(self) -> bool:
        """Also active for logs without a node list that hold ``scale/`` tags."""
        from tensorboard.context import RequestContext

        return bool(self._provider and data.list_runs(self._provider, RequestContext(), ""))

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        """The ES module frontend, in a tab named "Scales"."""
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Scales")

    # ---- routes -----------------------------------------------------------------------

    def _static(self, path: Path) -> Callable[..., Any]:
        @wrappers.Request.application
        def serve(request: Request) -> wrappers.Response:
            return http_util.Respond(request, path.read_bytes(), _TYPES[path.suffix])

        return serve

    def _respond(self, request: Request, compute: Callable[[data.RunData, Dict[str, str]], Any]) -> wrappers.Response:
        args = request.args
        try:
            run_data = self._load(request, args.get("run", ""), args.get("prefix", ""))
            body = compute(run_data, args)
        except ValueError as e:
            return http_util.Respond(request, {"error": str(e)}, "application/json", code=400)
        return http_util.Respond(request, _dumps(body), "application/json")

    @wrappers.Request.application
    def _runs(self, request: Request) -> wrappers.Response:
        from tensorboard import plugin_util

        ctx, eid = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        return http_util.Respond(request, json.dumps(data.list_runs(self._provider, ctx, eid)), "application/json")

    @wrappers.Request.application
    def _table(self, request: Request) -> wrappers.Response:
        if not request.args.get("run"):  # (before a run is picked: the package's own table)
            return http_util.Respond(request, _dumps(statistics.table([])), "application/json")
        return self._respond(request, lambda d, a: statistics.table(d.stats, d.meta))

    @wrappers.Request.application
    def _profile(self, request: Request) -> wrappers.Response:
        return self._respond(request, lambda d, a: tables.profile(d, _int(a, "step")))

    @wrappers.Request.application
    def _heatmap(self, request: Request) -> wrappers.Response:
        return self._respond(request, lambda d, a: tables.heatmap(d, a.get("stat", "std")))

    @wrappers.Request.application
    def _series(self, request: Request) -> wrappers.Response:
        return self._respond(request, lambda d, a: tables.series(d, a.get("label", "")))

    @wrappers.Request.application
    def _worst(self, request: Request) -> wrappers.Response:
        return self._respond(
            request, lambda d, a: tables.worst(d, _int(a, "step"), a.get("by", "fp16"), a.get("regex", ""))
        )

    @wrappers.Request.application
    def _code(self, request: Request) -> wrappers.Response:
        return self._respond(request, lambda d, a: tables.code(d, _int(a, "step")))

    def _respond_pair(
        self, request: Request, compute: Callable[[data.RunData, data.RunData, Dict[str, str], Any], Any]
    ) -> wrappers.Response:
        """As ``_respond``, for run ``run`` (A) against run ``other`` (B)."""

        args = request.args
        run, other, prefix = args.get("run", ""), args.get("other", ""), args.get("prefix", "")
        try:
            self._check_other(request, other, prefix)
            body = compute(self._load(request, run, prefix), self._load(request, other, prefix), args, (run, other))
        except ValueError as e:
            return http_util.Respond(request, {"error": str(e)}, "application/json", code=400)
        return http_util.Respond(request, _dumps(body), "application/json")

    @wrappers.Request.application
    def _advice(self, request: Request) -> wrappers.Response:
        from tensorboard import plugin_util

        ctx, eid = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        try:
            body = advice.view(self._provider, ctx, eid, request.args)
        except ValueError as e:
            return http_util.Respond(request, {"error": str(e)}, "application/json", code=400)
        return http_util.Respond(request, _dumps(body), "application/json")

    def _check_other(self, request: Request, other: str, prefix: str) -> None:
        """``other`` must be a run with node statistics under ``prefix``: its node list is looked
        up first (listing every run's scalars takes ~0.3 s a 2,000-node run), then its scalars."""
        from tensorboard import plugin_util
        from tensorboard.data.provider import RunTagFilter

        ctx, eid = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        tags = self._provider.list_tensors(
            ctx, experiment_id=eid, plugin_name=metadata.PLUGIN_NAME, run_tag_filter=RunTagFilter(runs=[other])
        ).get(other, {})
        if f"{prefix}{metadata.TAG}" in tags:
            return
        runs = data.list_runs(self._provider, ctx, eid)
        if prefix not in runs.get(other, []):
            with_prefix = [r for r, p in runs.items() if prefix in p]
            raise ValueError(
                f"`other` must name a run with node statistics under prefix {prefix!r} to compare with "
                f"(runs: {with_prefix}), got {other!r}"
            )

    @wrappers.Request.application
    def _compare(self, request: Request) -> wrappers.Response:
        return self._respond_pair(
            request, lambda a, b, q, n: compare_tables.profile(a, b, _int(q, "step"), q.get("stat", "std"), n)
        )

    @wrappers.Request.application
    def _compare_heatmap(self, request: Request) -> wrappers.Response:
        return self._respond_pair(request, lambda a, b, q, n: compare_tables.heatmap(a, b, q.get("stat", "std"), n))

    @wrappers.Request.application
    def _compare_series(self, request: Request) -> wrappers.Response:
        return self._respond_pair(
            request, lambda a, b, q, n: compare_tables.series(a, b, q.get("label", ""), q.get("stat", "std"), n)
        )

    def _load(self, request: Request, run: str, prefix: str) -> data.RunData:
        from tensorboard import plugin_util

        eid, ctx = plugin_util.experiment_id(request.environ), plugin_util.context(request.environ)
        key = (eid, run, prefix)
        stamp = data.fingerprint(self._provider, ctx, eid, run)
        with self._lock:
            hit = self._cache.get(key)
        if hit and hit[0] == stamp:  # nothing new since the last read
            return hit[1]
        loaded = data.load(self._provider, ctx, eid, run, prefix)
        with self._lock:
            self._cache[key] = (stamp, loaded)
        return loaded


def _int(args: Dict[str, str], name: str) -> Optional[int]:
    raw = args.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"`{name}` must be an integer step, got {raw!r}") from e
