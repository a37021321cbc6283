"""The statistics of a run: the user statistics this process knows, the record layout of a
set of groups, and what a user asks for (``ScaleMonitor(statistics=...)``), resolved.

A user statistic (``table.Statistic`` with ``sums``/``maxes``) is registered under a group
key (``user:<name>``) that travels with the built-in groups wherever groups go (recorders,
compiled graphs' host op, the pool), so every computation finds its functions by the key.
"""

from __future__ import annotations

import importlib
import itertools
import threading
from typing import Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from lightning_scale.record.stats.table import ALL, BUILTIN, CHANNEL, TABLE, Field, FieldFn, Statistic, USER_PREFIX

__all__ = ["Layout", "Resolved", "check", "is_user", "layout", "register", "registered", "resolve"]


_lock = threading.Lock()
_REGISTRY: Dict[str, Statistic] = {}  # group key -> user statistic


def register(stat: Statistic) -> str:
    """Make a user statistic known to this process's computations under a group key (its
    ``group``: ``user:<name>``, or ``user:<name>#<k>`` where another statistic of the same
    name was registered first), and return the key. Registering it again returns the same key,
    also in another process (a statistic that arrives pickled, in a spawned rank: its key is
    kept, so that every rank's groups agree).

    Raises:
        ValueError: ``stat`` is a built-in statistic, or its name is a built-in's.
    """
    if stat.builtin:
        raise ValueError(f"{stat!r} is built in: name it by its name, {stat.name!r}")
    if stat.name in BUILTIN or stat.name in CHANNEL:
        raise ValueError(f"Statistic {stat.name!r}: the name is a built-in statistic's; choose another")
    with _lock:
        held = _REGISTRY.get(stat.group)
        if held is stat:
            return stat.group
        if held is None and stat.group.startswith(USER_PREFIX):  # (its own key: kept in a new process too)
            _REGISTRY[stat.group] = stat
            return stat.group
        base = f"{USER_PREFIX}{stat.name}"
        candidates = itertools.chain([base], (f"{base}#{i}" for i in itertools.count(2)))
        key = next(k for k in candidates if k not in _REGISTRY)
        stat.group = key
        _REGISTRY[key] = stat
        return key


def registered(key: str) -> Statistic:
    """The user statistic registered under ``key``.

    Raises:
        ValueError: no statistic is registered under ``key`` in this process.
    """
    found = _REGISTRY.get(key)
    if found is None:
        raise ValueError(f"no user statistic is registered under {key!r} in this process (see `table.register`)")
    return found


def is_user(group: str) -> bool:
    """Whether ``group`` is a user statistic's key."""
    return group.startswith(USER_PREFIX)


class Layout:
    """The record layout of a set of groups: the built-in fields (``TABLE``, always, in
    their columns), then each user statistic's fields in the order of its group in ``groups``.

    Args:
        groups: computation groups: built-in ones (``GROUPS``) and user statistics' keys.
    """

    def __init__(self, groups: Sequence[str]) -> None:
        self.user: Tuple[Statistic, ...] = tuple(registered(g) for g in groups if is_user(g))
        self.fields: Tuple[Field, ...] = TABLE + tuple(f for s in self.user for f in s.own_fields())
        self.names: Tuple[str, ...] = tuple(f.name for f in self.fields)
        self.ix: Dict[str, int] = {name: i for i, name in enumerate(self.names)}
        self.width = len(self.fields)
        #: the user fields' columns, and for each its elementwise function and merge
        self.user_columns: Tuple[Tuple[int, FieldFn, str], ...] = tuple(
            (self.ix[f"{s.name}.{k}"], fn, merge)
            for s in self.user
            for merge, fns in (("sum", s.sums), ("max", s.maxes))
            for k, fn in fns.items()
        )
        self._by_name = {s.name: s for s in self.user}

    def statistic(self, name: str) -> Statistic:
        """The statistic ``name`` (built in, or one of this layout's user statistics).

        Raises:
            ValueError: an unknown name.
        """
        found = BUILTIN.get(name) or self._by_name.get(name) or CHANNEL.get(name)
        if found is None:
            known = sorted([*BUILTIN, *self._by_name])
            raise ValueError(f"Unknown statistic {name!r}; choose from {known}")
        return found

    def view(self, records: Tensor, stat: Statistic) -> Mapping[str, Tensor]:
        """``stat``'s fields of ``records`` ``[..., width]`` by name (every built-in field for a
        built-in statistic; its own fields and ``count`` for a user one)."""
        if stat.builtin:
            return _Columns(records, self.ix)
        own = {k: self.ix[f"{stat.name}.{k}"] for k in (*stat.sums, *stat.maxes)}
        return _Columns(records, {**own, "count": 0})

    def value(self, records: Tensor, name: str) -> Tensor:
        """Statistic ``name`` of records ``[..., width]`` (a record-derived one: not a channel statistic)."""
        stat = self.statistic(name)
        if stat.group == "channels":
            raise ValueError(f"{name!r} is not derived from a record: the channel rows give it")
        return stat.value(self.view(records, stat))


class _Columns(Mapping[str, Tensor]):
    """Columns of a records tensor by name (views, no copy)."""

    def __init__(self, records: Tensor, ix: Mapping[str, int]) -> None:
        self._records, self._ix = records, ix

    def __getitem__(self, key: str) -> Tensor:
        return self._records[..., self._ix[key]]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._ix)

    def __len__(self) -> int:
        return len(self._ix)


_LAYOUTS: Dict[Tuple[str, ...], Layout] = {}


def layout(groups: Iterable[str] = ()) -> Layout:
    """The ``Layout`` of ``groups`` (cached; built-in groups add no field beyond ``TABLE``)."""
    key = tuple(g for g in groups if is_user(g))
    found = _LAYOUTS.get(key)
    if found is None:
        found = _LAYOUTS[key] = Layout(key)
    return found


# ---------------------------------------------------------------------------------------
# What a user asks for: names, import paths, Statistic objects.


class Resolved(NamedTuple):
    """What a user asked for, resolved: the names to log, the groups that compute them
    ("moments" and the built-in groups they read, sorted, then the user statistics' keys) and
    the user statistics themselves (registered again in a new process: ``register``)."""

    names: List[str]
    groups: List[str]
    user: List[Statistic]


def resolve(statistics: Optional[Sequence[object]], arg: str = "statistics") -> Resolved:
    """``Resolved`` of what a user asks for: built-in
    names (``ALL``), ``Statistic`` objects, or dotted import paths of ``Statistic`` objects
    (``"my_package.stats.mean_abs"``: how LightningCLI YAML names one). None: ``["std"]``.
    User statistics are checked (``check``) and registered (``register``).

    Raises:
        ValueError: an unknown name, an import path that names no ``Statistic``, a name given
            twice or taken by a built-in, or a user statistic that cannot work (``check``).
    """
    if statistics is None:
        return Resolved(["std"], ["moments"], [])
    what = "a non-empty list of statistic names, `Statistic`s or their import paths"
    if isinstance(statistics, (str, Statistic)) or not isinstance(statistics, Sequence):
        raise ValueError(f"`{arg}` must be {what}, or None, got {statistics!r} ({type(statistics).__name__})")
    if not statistics:
        raise ValueError(f"`{arg}` must be {what}, got []")
    chosen = [_resolved(item, arg) for item in statistics]
    names = [s.name for s in chosen]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"`{arg}` must name each statistic once, got {names} (repeated: {twice})")
    builtin = sorted({"moments", *(s.group for s in chosen if s.builtin)})
    user = sorted((s for s in chosen if not s.builtin), key=lambda s: register(check(s)))
    return Resolved(names, builtin + [s.group for s in user], user)


def _resolved(item: object, arg: str) -> Statistic:
    if isinstance(item, Statistic):
        return item
    if not isinstance(item, str):
        raise ValueError(
            f"`{arg}` entries must be statistic names or `Statistic`s, got {item!r} ({type(item).__name__})"
        )
    if item in ALL:
        return ALL[item]
    if "." not in item:
        raise ValueError(
            f"`{arg}` has an unknown statistic {item!r}; choose from {sorted(ALL)}, a `Statistic`, or the import "
            "path of one ('my_package.stats.mean_abs')"
        )
    module, _, attr = item.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"`{arg}`: cannot import {item!r} ({type(e).__name__}: {e})") from e
    if not isinstance(found, Statistic):
        raise ValueError(f"`{arg}`: {item!r} is a {type(found).__name__}, not a `lightning_scale.Statistic`")
    return found


#: The small tensor a user statistic is tried on: signs, zero, a wide range, a NaN-free float32.
_PROBE = torch.tensor([[-3.0, -0.5, 0.0, 0.25], [1.0, 2.0, 1e-3, 7.5], [-1e4, 4.0, 0.125, -0.0]])


def check(stat: Statistic) -> Statistic:
    """``stat`` itself, once its functions are tried on a small tensor: each of ``sums`` and
    ``maxes`` must be elementwise (the same shape out, each element's value its own: applied to
    a part of the tensor it gives that part of the result), and ``value`` must give a result of
    the records' shape from the fields.

    Raises:
        ValueError: naming the statistic and what is wrong.
    """
    for kind, fns in (("sums", stat.sums), ("maxes", stat.maxes)):
        for key, fn in fns.items():
            _check_elementwise(stat.name, f"{kind}[{key!r}]", fn)
    s = {"count": torch.tensor([12.0, 3.0], dtype=torch.float64)}
    for key, fn in (*stat.sums.items(), *stat.maxes.items()):
        out = fn(_PROBE).to(torch.float64)
        s[key] = torch.stack([out.sum() if key in stat.sums else out.amax(), out[0].sum()])
    try:
        value = torch.as_tensor(stat.value(s))
    except Exception as e:  # noqa: BLE001 - any failure is the declaration's
        raise ValueError(f"Statistic {stat.name!r}: `value` fails on a small tensor's fields ({e!r})") from e
    if value.shape != (2,):
        raise ValueError(
            f"Statistic {stat.name!r}: `value` must give one number per record (shape [2] for two records), "
            f"got shape {list(value.shape)}"
        )
    return stat


def _check_elementwise(name: str, what: str, fn: FieldFn) -> None:
    try:
        whole, part = torch.as_tensor(fn(_PROBE)), torch.as_tensor(fn(_PROBE[1:, 1:3]))
    except Exception as e:  # noqa: BLE001 - any failure is the declaration's
        raise ValueError(f"Statistic {name!r}: `{what}` fails on a small float32 tensor ({e!r})") from e
    if whole.shape != _PROBE.shape:
        raise ValueError(
            f"Statistic {name!r}: `{what}` must be elementwise (the same shape out): on a tensor of shape "
            f"{list(_PROBE.shape)} it gave {list(whole.shape)}"
        )
    if part.shape != (2, 2) or not torch.equal(part.double(), whole[1:, 1:3].double()):
        raise ValueError(
            f"Statistic {name!r}: `{what}` must be elementwise: applied to part of a tensor it must give that part "
            "of its result (it depends on other elements, e.g. a mean or a max)"
        )
