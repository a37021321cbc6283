"""Worker: runs the writing of tracked steps on one background thread, in order.

Writing a step (scalars, histograms, annotated code, the figure) takes milliseconds to a
second; none of it needs the training thread. Jobs run one at a time in the order they
were submitted, from an unbounded queue, so no step's data is dropped or reordered.
``flush`` waits until every submitted job has run (fit end, exceptions, teardown). A job
that raises is reported with ``warnings.warn`` (once per distinct error) and never
reaches training.
"""

from __future__ import annotations

import queue
import threading
import warnings
from typing import Any, Callable, Optional, Set, Tuple

__all__ = ["Worker"]

_Job = Optional[Tuple[str, Callable[..., Any], Tuple[Any, ...]]]


class Worker:
    """One background thread that runs submitted jobs in submission order.

    Args:
        name: the thread's name (shown in profiles and thread dumps).

    Example::

        worker = Worker()
        worker.submit("step 3", print, "written")
        worker.flush()
    """

    def __init__(self, name: str = "lightning-scale-writer") -> None:
        self.name = name
        self.errors = 0
        self._seen: Set[Tuple[type, str]] = set()
        self._queue: "queue.Queue[_Job]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # A copy (ddp_spawn pickles callbacks into each process) starts with no queue.
        return {"name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["name"])  # type: ignore[misc]

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` after every job submitted before it; ``what`` names it in a warning."""
        self._ensure_thread()
        self._queue.put((what, fn, args))

    def run_now(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` now, on the calling thread, with a job's failure handling (for
        loggers that must not be called from another thread)."""
        self._call(what, fn, args)

    def flush(self) -> None:
        """Block until every job submitted so far has run."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Flush, then stop the thread (a later ``submit`` starts a new one)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None or not thread.is_alive():
            return
        self._queue.put(None)
        thread.join()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                # A daemon thread: a writer stuck in I/O must not keep the process alive.
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._call(*job)
            finally:
                job = None  # release the step's data before flush() returns, not at the next job
                self._queue.task_done()

    def _call(self, what: str, fn: Callable[..., Any], args: Tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - writing must never reach training
            self.errors += 1
            if (type(err), str(err)) in self._seen:  # a logger that keeps failing warns once
                return
            self._seen.add((type(err), str(err)))
            warnings.warn(
                f"ScaleMonitor: writing {what} failed ({type(err).__name__}: {err}); training continues",
                UserWarning,
                stacklevel=1,
            )
