"""Reading ``ScaleMonitor``'s logs outside TensorBoard's server: the command-line tools' input.

``LogDir(path)`` loads every run under ``path`` (a TensorBoard log directory, or one run's
own directory) with TensorBoard's event multiplexer and data provider, the very reader the
SCALES dashboard uses (``data.load``), so the tools and the dashboard see the same numbers.
A run is named by its path relative to ``path`` (``"."`` for ``path`` itself).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from lightning_scale.dashboard import data

__all__ = ["LogDir", "NoRunError"]


class NoRunError(ValueError):
    """A path holds no run that ``ScaleMonitor`` wrote (the message says what was looked for)."""


class LogDir:
    """Every run ``ScaleMonitor`` wrote under ``path``.

    Args:
        path: a log directory (TensorBoard's ``--logdir``) or one run's directory.

    Raises:
        NoRunError: ``path`` does not exist or holds no run with SCALES records or scalars.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"]) -> None:
        from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
        from tensorboard.context import RequestContext

        self.path = Path(path)
        if not self.path.exists():
            raise NoRunError(f"`{path}` does not exist")
        mux = plugin_event_multiplexer.EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
        mux.AddRunsFromDirectory(str(self.path))
        mux.Reload()
        self._provider = data_provider.MultiplexerDataProvider(mux, str(self.path))
        self._ctx = RequestContext()
        #: run name -> the tag prefixes it logged node statistics under ("" training, "val_" validation)
        self.runs: Dict[str, List[str]] = data.list_runs(self._provider, self._ctx, "")
        if not self.runs:
            raise NoRunError(
                f"`{path}` holds no run written by ScaleMonitor (no event file with SCALES records or per-node "
                "scale scalars under it)"
            )

    def run_name(self, run: Optional[str]) -> str:
        """The run named ``run`` (None: the only run; a path relative to ``path`` or its last part).

        Raises:
            NoRunError: no such run, or ``run`` is None and there are several.
        """
        names = sorted(self.runs)
        if run is None:
            if len(names) == 1:
                return names[0]
            raise NoRunError(f"`{self.path}` holds {len(names)} runs; name one of {names}")
        wanted = os.path.normpath(run)
        for name in names:
            if name == wanted or os.path.normpath(name) == wanted:
                return name
        tails = [name for name in names if Path(name).name == Path(wanted).name]
        if len(tails) == 1:
            return tails[0]
        raise NoRunError(f"no run {run!r} under `{self.path}`; runs: {names}")

    def load(self, run: Optional[str] = None, prefix: str = "") -> data.RunData:
        """One run's per-node statistics (``data.RunData``) under the tag ``prefix``.

        Raises:
            NoRunError: no such run, or it logged nothing under ``prefix``.
        """
        name = self.run_name(run)
        if prefix not in self.runs[name]:
            raise NoRunError(
                f"run {name!r} logged no node statistics under prefix {prefix!r} (it has {self.runs[name]})"
            )
        return data.load(self._provider, self._ctx, "", name, prefix)

    @property
    def provider(self) -> Any:
        """TensorBoard's data provider over the runs (for readers beyond ``data.load``)."""
        return self._provider
