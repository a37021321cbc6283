"""Settings: the package's environment switches, read once where the core is entered.

``Settings.from_env()`` parses every ``LIGHTNING_SCALE_*`` variable at once, into one
object that is passed down: ``ScaleMonitor`` reads it at fit start, ``Recorder`` and
``capture`` when they are created outside Lightning. Nothing below them reads the
environment. ``line()`` is the status line that names what is in use.

=====================================  ===========================================================
variable                               meaning
=====================================  ===========================================================
``LIGHTNING_SCALE_KERNEL``             device statistics: ``auto`` (Triton on CUDA devices, else
                                       torch), ``triton`` (everywhere: CPU tensors need
                                       ``TRITON_INTERPRET=1``), ``torch``
``LIGHTNING_SCALE_COMPILED_STATS``     compiled graphs' statistics: ``auto``/``host`` (one opaque
                                       host op where a graph's tensors are on the CPU, graph ops
                                       elsewhere), ``ops`` (graph ops everywhere)
``LIGHTNING_SCALE_HOST_READS``         unset: by device; ``0``: the device path everywhere; ``1``:
                                       host reads everywhere
``LIGHTNING_SCALE_NATIVE``             ``0``: never build nor use the native host kernel
``LIGHTNING_SCALE_CACHE``              where the native kernel is built (default
                                       ``$XDG_CACHE_HOME/lightning_scale`` or
                                       ``~/.cache/lightning_scale``)
=====================================  ===========================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

__all__ = ["COMPILED_STATS", "KERNELS", "Settings"]

KERNELS = ("auto", "triton", "torch")
COMPILED_STATS = ("auto", "host", "ops")
_PREFIX = "LIGHTNING_SCALE_"


@dataclass(frozen=True)
class Settings:
    """What the environment switches chose (the defaults where unset)."""

    #: ``LIGHTNING_SCALE_KERNEL``
    kernel: str = "auto"
    #: ``LIGHTNING_SCALE_COMPILED_STATS``
    compiled_stats: str = "auto"
    #: ``LIGHTNING_SCALE_HOST_READS``: None by device, else forced
    host_reads: Optional[bool] = None
    #: not ``LIGHTNING_SCALE_NATIVE=0``
    native: bool = True
    #: ``LIGHTNING_SCALE_CACHE`` (None: the default folder)
    cache: Optional[str] = None

    @staticmethod
    def from_env(environ: Optional[Mapping[str, str]] = None) -> "Settings":
        """Every switch parsed from ``environ`` (default ``os.environ``), at once.

        Raises:
            ValueError: a switch with a value it does not take (the message names it).
        """
        env = os.environ if environ is None else environ
        return Settings(
            kernel=_choice(env, "KERNEL", KERNELS),
            compiled_stats=_choice(env, "COMPILED_STATS", COMPILED_STATS),
            host_reads=_host_reads(env),
            native=_native(env),
            cache=env.get(_PREFIX + "CACHE") or None,
        )

    def apply(self) -> "Settings":
        """Configure what is process-wide (the native kernel: ``native.configure``); returns self."""
        from lightning_scale.record import native

        native.configure(self.native, self.cache)
        return self

    def line(self) -> str:
        """What is in use, for the status line (the variables that are set differently from
        their defaults by name)."""
        parts = [
            f"kernel={self.kernel}",
            f"compiled statistics={self.compiled_stats}",
            "host reads=" + ("by device" if self.host_reads is None else str(self.host_reads).lower()),
            "native kernel " + ("allowed" if self.native else "off"),
        ]
        return "settings: " + ", ".join(parts)


def _choice(env: Mapping[str, str], name: str, allowed: tuple) -> str:
    value = env.get(_PREFIX + name, "").strip().lower() or "auto"
    if value not in allowed:
        raise ValueError(f"`{_PREFIX}{name}` must be one of {', '.join(allowed)}; got {env[_PREFIX + name]!r}")
    return value


def _host_reads(env: Mapping[str, str]) -> Optional[bool]:
    value = env.get(_PREFIX + "HOST_READS", "").strip()
    if value == "":
        return None
    if value not in ("0", "1"):
        raise ValueError(
            f"`{_PREFIX}HOST_READS` must be 0 (device path forced) or 1 (host reads allowed), got {value!r}"
        )
    return value == "1"


def _native(env: Mapping[str, str]) -> bool:
    value = env.get(_PREFIX + "NATIVE", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"`{_PREFIX}NATIVE` must be 0 (off) or 1 (on, the default), got {value!r}")
    return value != "0"
