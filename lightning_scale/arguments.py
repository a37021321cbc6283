"""Checks of user arguments: one function per kind of value, one wording for every error.

Every public entry point of the package (``ScaleMonitor``, ``Schedule``, ``Selection``,
the anomaly detector, ``coord_check``, ``analyse_module``) checks what it is given with
these functions, so an argument of one kind is refused the same way everywhere: a
``ValueError`` that names the argument in backticks, says what is allowed and shows what
was given (with its type when the type is what is wrong). ``True`` is not an integer here
although Python says it is, and ``"abc"`` is not a list of names although it iterates like one.

This module is its own layer, the lowest of docs/architecture.md: it imports nothing of the
package and knows nothing of capture, records or Lightning, so every layer above may use
it. It lives beside the package's top, not in ``record/`` or ``step/``, because argument
checking belongs to no stage of the data's way.

Example:
    >>> positive_int("max_tags", 10)
    10
    >>> positive_int("max_tags", True)
    Traceback (most recent call last):
    ...
    ValueError: `max_tags` must be a positive integer, got True (bool)
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any, Collection, List, NoReturn, Optional, Pattern

__all__ = [
    "boolean",
    "booleans",
    "choices",
    "int_list",
    "integer",
    "module_path",
    "module_paths",
    "non_negative_int",
    "number",
    "one_of",
    "positive_int",
    "regex",
    "string_list",
]


def _fail(name: str, allowed: str, value: Any, show_type: bool = False) -> NoReturn:
    given = f"{value!r} ({type(value).__name__})" if show_type else repr(value)
    raise ValueError(f"`{name}` must be {allowed}, got {given}")


def _or_none(allowed: str, allow_none: bool) -> str:
    return f"{allowed} or None" if allow_none else allowed


def _is_int(value: Any) -> bool:
    # numpy integers are Integral; bool is an int to Python but never a count here
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


_PATH = "a dotted module path (a str such as 'blocks.0.attn')"


def _is_path(value: str) -> bool:
    # module names may hold any character but "." (ModuleDict keys): refuse only empty parts and spaces
    return all(part and not re.search(r"\s", part) for part in value.split("."))


def _integers(minimum: Optional[int]) -> str:
    """``integers`` with the bound: ``positive integers``, ``integers >= 3``."""
    words = {None: "integers", 0: "non-negative integers", 1: "positive integers"}
    return words.get(minimum, f"integers >= {minimum}")


def integer(
    name: str, value: Any, *, minimum: Optional[int] = None, allow_none: bool = False, note: str = ""
) -> Optional[int]:
    """``value`` as an ``int`` (``None`` if allowed and given), or a ``ValueError`` naming ``name``.

    Args:
        name: the argument's name, as the user wrote it.
        value: what the user gave.
        minimum: the least value allowed (``None``: no bound).
        allow_none: whether ``None`` is a valid value.
        note: said after what is allowed, in brackets (e.g. what 0 means).

    Raises:
        ValueError: ``value`` is not an integer (bools are not) or is below ``minimum``.
    """
    if value is None and allow_none:
        return None
    kind = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(minimum)
    allowed = _or_none(kind or f"an integer >= {minimum}", allow_none) + (f" ({note})" if note else "")
    return _int(name, value, minimum, allowed)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int`` >= 1; see ``integer`` (with ``allow_none=True`` where ``None`` is valid)."""
    return _int(name, value, 1, "a positive integer")


def non_negative_int(name: str, value: Any, note: str = "") -> int:
    """``value`` as an ``int`` >= 0; ``note`` is said in brackets after what is allowed."""
    return _int(name, value, 0, "a non-negative integer" + (f" ({note})" if note else ""))


def _int(name: str, value: Any, minimum: Optional[int], allowed: str) -> int:
    if not _is_int(value):
        _fail(name, allowed, value, show_type=True)
    if minimum is not None and value < minimum:
        _fail(name, allowed, value)
    return int(value)


def int_list(name: str, value: Any, *, minimum: int = 0, allow_none: bool = False) -> Optional[List[int]]:
    """``value``, a list or tuple of integers >= ``minimum``, as a list of ``int``.

    Raises:
        ValueError: ``value`` is not a sequence (a str or a single int is not), or holds
            something else than such integers (the message lists the bad items).
    """
    if value is None and allow_none:
        return None
    kind = _integers(minimum)
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        _fail(name, _or_none(f"a list of {kind}", allow_none), value, show_type=True)
    bad = [v for v in value if not _is_int(v) or v < minimum]
    if bad:
        raise ValueError(f"`{name}` must hold {kind}, got {bad!r} in {value!r}")
    return [int(v) for v in value]


def number(name: str, value: Any, *, above: float) -> float:
    """``value`` as a finite ``float`` strictly above ``above``.

    Raises:
        ValueError: ``value`` is not a real number (bools and strings are not), is NaN or
            infinite, or is not above ``above``.
    """
    allowed = f"a finite number above {above:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(name, allowed, value, show_type=True)
    if not math.isfinite(value) or not value > above:
        _fail(name, allowed, value)
    return float(value)


def boolean(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0, 1 or ``"no"``).

    Raises:
        ValueError: ``value`` is not a bool.
    """
    if not isinstance(value, bool):
        _fail(name, "True or False", value, show_type=True)
    return value


def one_of(name: str, value: Any, choices: Collection[str]) -> str:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: it is not (the message lists the choices).
    """
    if not isinstance(value, str) or value not in choices:
        _fail(name, f"one of {list(choices)}", value)
    return value


def regex(name: str, value: Any, allow_none: bool = True) -> Optional[Pattern[str]]:
    """``value`` (a str, or a compiled str pattern) compiled; ``None`` stays ``None``.

    Raises:
        ValueError: ``value`` is not a str (a bytes pattern is not: labels are str), or
            does not compile (the message carries ``re``'s reason).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, re.Pattern) and isinstance(value.pattern, str):
        return value
    if not isinstance(value, str):
        _fail(name, _or_none("a regular expression (a str)", allow_none), value, show_type=True)
    try:
        return re.compile(value)
    except re.error as err:
        raise ValueError(f"`{name}` must be a valid regular expression, got {value!r} ({err})") from err


def string_list(
    name: str,
    value: Any,
    *,
    allowed: Optional[Collection[str]] = None,
    unique: bool = False,
    non_empty: bool = False,
    allow_none: bool = False,
) -> Optional[List[str]]:
    """``value``, a list or tuple of str, as a list.

    Args:
        name: the argument's name.
        value: what the user gave.
        allowed: the only strings allowed (``None``: any).
        unique: refuse repeats.
        non_empty: refuse an empty list.
        allow_none: whether ``None`` is a valid value.

    Raises:
        ValueError: ``value`` is a single str (not split into characters), not a list or
            tuple, holds a non-str, a string not in ``allowed``, a repeat, or nothing.
    """
    if value is None and allow_none:
        return None
    kind = "a non-empty list" if non_empty else "a list"
    kind += f" from {sorted(allowed)}" if allowed is not None else " of str"
    if not isinstance(value, (list, tuple)):
        _fail(name, _or_none(kind, allow_none), value, show_type=True)
    bad = [v for v in value if not isinstance(v, str) or (allowed is not None and v not in allowed)]
    if bad or (non_empty and not value):
        _fail(name, kind, value)
    repeated = sorted({v for v in value if value.count(v) > 1})
    if unique and repeated:
        raise ValueError(f"`{name}` must name each item once, got {value!r} (repeated: {repeated})")
    return list(value)


def choices(name: str, value: Any, allowed: Collection[str], allow_none: bool = False) -> Optional[List[str]]:
    """``value``, a non-empty list or tuple of distinct strings from ``allowed``, as a list;
    see ``string_list``."""
    return string_list(name, value, allowed=allowed, unique=True, non_empty=True, allow_none=allow_none)


def booleans(**values: Any) -> None:
    """``boolean(name, value)`` for each keyword: ``booleans(figure=figure, code=code)``."""
    for name, value in values.items():
        boolean(name, value)


def module_path(name: str, value: Any, allow_none: bool = True) -> Optional[str]:
    """``value`` if it is a dotted module path such as ``"blocks.0.attn"``.

    Whether the module exists is known only with the model: this checks the form.

    Raises:
        ValueError: ``value`` is not a str, or has an empty part or whitespace.
    """
    if value is None and allow_none:
        return None
    allowed = _or_none(_PATH, allow_none)
    if not isinstance(value, str):
        _fail(name, allowed, value, show_type=True)
    if not _is_path(value):
        _fail(name, allowed, value)
    return value


def module_paths(name: str, value: Any) -> List[str]:
    """``value``, a list or tuple of dotted module paths (see ``module_path``), as a list;
    ``None`` is the empty list.

    Raises:
        ValueError: ``value`` is a single str, not a list or tuple, or an item is no path.
    """
    paths = string_list(name, value, allow_none=True) or []
    bad = [p for p in paths if not _is_path(p)]
    if bad:
        raise ValueError(f"`{name}` must hold dotted module paths (such as 'blocks.0.attn'), got {bad!r} in {value!r}")
    return paths
