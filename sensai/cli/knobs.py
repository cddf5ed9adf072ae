"""``--set KEY=VALUE``: the knobs of a command that are not among its decisions.

A command's ``--help`` lists the flags a user decides with; the rest of what it can tune (the
research knobs of a decomposition, the timing of a bench phase, a gateway setting without a
flag) is one repeatable ``--set KEY=VALUE``, made from the same declaration as the flags (a
dataclass field's ``metadata["help"]``, a gateway setting's declaration), so nothing is described
twice.  ``--set help`` prints every key with its default and meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterable

TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}
MAX_KEY_COLUMN = 32
LINE_WIDTH = 100


@dataclass(frozen=True)
class Knob:
    """One ``--set`` key: its value type (int, float, str or bool), default, meaning, whether
    ``none`` is a value (an optional field), its allowed values and bound (a
    :class:`sensai.bounds.Bound`, checked with the other options', shown by ``--set help``)."""
    name: str
    kind: type
    default: Any
    help: str
    optional: bool = False
    choices: tuple | None = None
    bound: Any = None

    def parse(self, text: str) -> Any:
        """``text`` as this knob's value; ValueError says why not."""
        if self.optional and text.lower() == "none":
            return None
        if self.kind is bool:
            if text.lower() in TRUE | FALSE:
                return text.lower() in TRUE
            raise ValueError("expected true or false")
        try:
            value = self.kind(text)
        except ValueError:
            raise ValueError(f"expected {'an integer' if self.kind is int else 'a number'}"
                             ) from None
        if self.choices and value not in self.choices:
            raise ValueError(f"expected one of {', '.join(map(str, self.choices))}")
        return value


def value_type(annotation) -> tuple[type, bool]:
    """(int, float, str or bool, optional) from a field's annotation (``X | None``: X, True)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = typing.get_args(annotation)
        return next(a for a in args if a is not type(None)), type(None) in args
    return annotation, False


def dataclass_knobs(cls, names: Iterable[str] | None = None) -> list[Knob]:
    """The knobs of dataclass ``cls``'s fields (``names``: only those, in that order), each
    described by its ``metadata["help"]`` and, where given, ``metadata["choices"]`` and
    ``metadata["bound"]``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)  # the types, where annotations are postponed strings
    out = []
    for name in (names if names is not None else fields):
        f = fields[name]
        kind, optional = value_type(hints[name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        out.append(Knob(name, kind, default, f.metadata.get("help", ""), optional,
                        f.metadata.get("choices"), f.metadata.get("bound")))
    return out


def describe(knobs: list[Knob]) -> str:
    """One line per knob: ``key=default  meaning``."""
    shown = {k.name: f"{k.name}={as_typed(k.default)}" for k in knobs}
    # A long default (a derived one, said in words) gets a line of its own, so the column of
    # meanings stays where the short ones put it.
    width = min(MAX_KEY_COLUMN, max(map(len, shown.values()))) + 2
    lines = []
    for k in knobs:
        choices = f" ({', '.join(map(str, k.choices))})" if k.choices else \
            f" ({k.bound.describe(k.kind is int)})" if k.bound else ""
        key = shown[k.name]
        if len(key) > MAX_KEY_COLUMN:
            lines.append(textwrap.fill(key, LINE_WIDTH, initial_indent="  ",
                                       subsequent_indent="      "))
            key = ""
        lines.append(textwrap.fill(f"{k.help}{choices}", LINE_WIDTH,
                                   initial_indent=f"  {key:<{width}}",
                                   subsequent_indent=" " * (width + 2)))
    return "\n".join(lines)


def as_typed(value: Any) -> str:
    """A default as ``--set`` reads it back (none, true, false)."""
    if value is None:
        return "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


class SetAction(argparse.Action):
    """Collects ``KEY=VALUE`` into a dict (converted and checked at once: an unknown key or a
    bad value is argparse's one-line error); ``--set help`` prints the keys and exits."""

    def __init__(self, option_strings, dest, knobs: list[Knob], **kw):
        self.knobs = {k.name: k for k in knobs}
        super().__init__(option_strings, dest, default={}, metavar="KEY=VALUE", **kw)

    def __call__(self, parser, namespace, value, option_string=None):
        if value == "help":
            sys.stdout.write(f"{parser.prog} --set KEY=VALUE (repeatable):\n"
                             f"{describe(list(self.knobs.values()))}\n")
            parser.exit(0)
        key, eq, text = value.partition("=")
        knob = self.knobs.get(key.strip().replace("-", "_"))
        if not eq or knob is None:
            parser.error(f"--set {value}: expected KEY=VALUE with KEY one of "
                         f"{', '.join(self.knobs)} ('--set help' says what each does)")
        try:
            parsed = knob.parse(text.strip())
        except ValueError as e:
            parser.error(f"--set {value}: {e}")
        setattr(namespace, self.dest, {**getattr(namespace, self.dest, {}), knob.name: parsed})


def add_set_flag(p, knobs: list[Knob], what: str) -> None:
    """Add ``--set`` for ``knobs`` to parser (or group) ``p``; ``what``: what they tune."""
    p.add_argument("--set", dest="knobs", action=SetAction, knobs=knobs,
                   help=f"{what}, repeatable: {', '.join(k.name for k in knobs)} ('--set help': "
                        "each with its default and meaning)")
