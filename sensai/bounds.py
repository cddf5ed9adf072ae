"""The bounds of an option, declared once in the dataclass field that declares the option
(``metadata["bound"]``, a :class:`Bound`) and checked by one function, :func:`check_bounds`, for
every command and configuration alike: the bench options, training's, decomposition's and
retraining's.  Light on purpose (no torch): building a command's parser imports it.

A checked value is named as the user gives it: a flag's first ``--`` name (``metadata["flag"]``,
none: ``--`` and the field's name), ``--set KEY`` for a field marked ``metadata["set"]``, else
``metadata["name"]`` or the field's name.  The checks that relate two options (``clients`` at most
``concurrency``) stay with the command that has both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

from sensai.errors import SensaiError


@dataclass(frozen=True)
class Bound:
    """The values an option takes: ``>= low``, ``> above``, ``<= high``, ``< below`` (each
    optional; a field of ints takes integers only, one of floats any finite number)."""

    low: float | None = None
    above: float | None = None
    high: float | None = None
    below: float | None = None

    def admits(self, value: Any, integer: bool) -> bool:
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            return False
        return (math.isfinite(value)
                and (self.low is None or value >= self.low)
                and (self.above is None or value > self.above)
                and (self.high is None or value <= self.high)
                and (self.below is None or value < self.below))

    def describe(self, integer: bool) -> str:
        """What an admitted value is, in words: "an integer >= 1", "a number > 0", "in (0, 1]"."""
        def num(v: float | None) -> str:  # a large integer bound whole, not as 4.29497e+09
            return f"{int(v)}" if integer and v is not None and v == int(v) else f"{v:g}"

        lower = (">=", self.low) if self.low is not None else (">", self.above)
        upper = ("<=", self.high) if self.high is not None else ("<", self.below)
        kind = "an integer" if integer else "a number"
        if upper[1] is None:
            return kind if lower[1] is None else f"{kind} {lower[0]} {num(lower[1])}"
        if lower[1] is None:
            return f"{kind} {upper[0]} {num(upper[1])}"
        if integer and lower[0] == ">=" and upper[0] == "<=":
            return f"an integer from {num(lower[1])} to {num(upper[1])}"
        return (f"in {'[' if lower[0] == '>=' else '('}{num(lower[1])}, "
                f"{num(upper[1])}{']' if upper[0] == '<=' else ')'}")


BOUND_KEYS = ("low", "above", "high", "below")
# A seed seeds numpy's legacy generators and scikit-learn, which take 32 bits (torch's more).
SEED = Bound(low=0, high=2**32 - 1)


def check_seed(value: int, flag: str = "--seed") -> int:
    """A seed given on the command line, checked before anything is read."""
    if not SEED.admits(value, True):
        raise SensaiError(f"{flag} must be {SEED.describe(True)}, got {value}")
    return value


def bounded(**bound: float) -> dict[str, Bound]:
    """A field's metadata for ``Bound(**bound)``; none where no bound is given."""
    return {"bound": Bound(**bound)} if bound else {}


def option_name(f: dataclasses.Field) -> str:
    """Field ``f``'s option as the user gives it."""
    meta = f.metadata
    if "flag" in meta:
        return next((n for n in meta["flag"] if n.startswith("--")),
                    f"--{f.name.replace('_', '-')}")
    return f"--set {f.name}" if meta.get("set") else meta.get("name", f.name)


@functools.cache
def bounded_fields(cls: type) -> tuple[tuple[dataclasses.Field, Bound, bool, bool, bool], ...]:
    """(field, bound, integer, optional, a tuple of values) for each field of dataclass ``cls``
    that declares a bound, read from its annotation once."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if "bound" not in f.metadata:
            continue
        kind, optional, many = hints[f.name], False, False
        if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
            args = typing.get_args(kind)
            optional = type(None) in args
            kind = next(a for a in args if a is not type(None))
        if typing.get_origin(kind) in (tuple, list):
            kind, many = typing.get_args(kind)[0], True
        out.append((f, f.metadata["bound"], kind is int, optional, many))
    return tuple(out)


def check_bounds(options: Any) -> Any:
    """``options`` (a dataclass instance) when every field that declares a bound holds a value
    within it (each value of a tuple; None where the field is optional: its default applies);
    else SensaiError, one line naming the first option that does not."""
    for f, bound, integer, optional, many in bounded_fields(type(options)):
        value = getattr(options, f.name)
        if value is None and optional:
            continue
        for v in (value if many and isinstance(value, (tuple, list)) else (value,)):
            if not bound.admits(v, integer):
                raise SensaiError(f"{option_name(f)} must be {bound.describe(integer)}, "
                                  f"got {v!r}")
    return options
