"""The flags of the bench commands, made from their options dataclasses
(:mod:`sensai.bench.options`): a field made by ``flag`` becomes an argument whose ``dest`` is the
field's name, one made by ``knob`` a key of the command's one ``--set``; the meaning, default
and allowed values of each are written there once.  :func:`options_from` turns the parsed
arguments back into the dataclasses, :func:`command_line` into the command that reproduces the
run.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import typing
from typing import Any, Iterable

from .knobs import SetAction, add_set_flag, dataclass_knobs, value_type


def add_bench_options(p: argparse.ArgumentParser, classes: Iterable[type], *, what: str,
                      exclude: Iterable[str] = ()) -> None:
    """``--out``, then the flags of ``classes``' fields (a field shared by two classes once;
    ``exclude``: fields this command does not offer), then ``--set`` for their knobs (``what``:
    what the knobs tune)."""
    p.add_argument("--out", required=True, help="output directory")
    knobs, groups, seen = [], {}, set(exclude)
    for cls in classes:
        hints = typing.get_type_hints(cls)  # the types, where annotations are strings
        for f in own_first(cls):
            if f.name in seen or "help" not in f.metadata:
                continue
            seen.add(f.name)
            if "flag" not in f.metadata:
                knobs += dataclass_knobs(cls, [f.name])
                continue
            name = f.metadata["group"]
            if name is not None and name not in groups:
                groups[name] = p.add_argument_group(name)
            add_flag(groups.get(name, p), f, hints[f.name])
    add_set_flag(p, knobs, what)


def own_first(cls) -> list[dataclasses.Field]:
    """``cls``'s fields, those it declares first, then its bases' nearest first: a command's
    own decisions lead its ``--help``, what it shares with the others follows."""
    declared = [c.__dict__.get("__annotations__", {}) for c in cls.__mro__]
    return sorted(dataclasses.fields(cls),
                  key=lambda f: next(i for i, names in enumerate(declared) if f.name in names))


def add_flag(p, f: dataclasses.Field, annotation) -> None:
    """Field ``f``'s flag: store_true for a bool, else its type's values (one per argument of a
    tuple field, ``nargs`` given)."""
    # The bound is checked with the other options' (sensai.bounds), not by argparse.
    meta = {k: v for k, v in f.metadata.items() if k not in ("help", "flag", "group", "bound")}
    names = f.metadata.get("flag") or (f"--{f.name.replace('_', '-')}",)
    text = f.metadata["help"]
    if f.default not in (None, False, ()):
        text += f" (default: {default_text(f.default)})"
    text = text.replace("%", "%%")
    kind, _ = value_type(annotation)
    if kind is bool:
        p.add_argument(*names, dest=f.name, action="store_true", help=text)
        return
    if typing.get_origin(kind) in (tuple, list):
        kind = typing.get_args(kind)[0]
    p.add_argument(*names, dest=f.name, type=kind, default=f.default, help=text, **meta)


def default_text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(default_text, value))
    return value_text(value)


def value_text(value: Any) -> str:
    """A value as ``--set`` and the flags read it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return "none" if value is None else str(value)


def options_from(cls, args: argparse.Namespace, **given):
    """An instance of dataclass ``cls`` from the parsed ``args``: its flags' values, its
    ``--set`` keys, and ``given`` (what the command fills in itself) over both."""
    values = {}
    for f in dataclasses.fields(cls):
        if "flag" in f.metadata and hasattr(args, f.name):
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
        elif f.name in getattr(args, "knobs", {}):
            values[f.name] = args.knobs[f.name]
    return cls(**(values | given))


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run: the command's parser, and every argument given
    that differs from its default (``--set``: each key given)."""
    parser = args.parser
    parts = parser.prog.split()
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings:  # a positional argument
            parts += [str(v) for v in (value if isinstance(value, list) else [value])]
            continue
        if action.dest == "help" or value == action.default or value is None:
            continue
        flag = next(f for f in action.option_strings if f.startswith("--"))
        if isinstance(action, SetAction):
            parts += [x for k, v in value.items() for x in (flag, f"{k}={value_text(v)}")]
        elif value is True:
            parts.append(flag)
        elif isinstance(value, list) and action.nargs is None:  # a repeatable option
            parts += [x for item in value for x in (flag, str(item))]
        else:
            values = value if isinstance(value, (list, tuple)) else [value]
            parts += [flag, *(value_text(v) for v in values)]
    return shlex.join(parts)
