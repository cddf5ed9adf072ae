"""The flags of the gateway settings, made from their one declaration
(:func:`sensai.serving.core.settings.setting`): name, type, default, choices and help are
written there once, and deploy/README.md's table is made from the same place.

Every flag has its field as ``dest`` and no default of its own (None: not given), so the
settings model keeps the one default and ``SENSAI_*`` variables still apply.
"""

from __future__ import annotations

import argparse

from sensai.serving.core.settings import GatewaySettings, default_text, described

from .knobs import Knob, value_type

GROUPS = {
    "runtime": "Where and how the subnets run.",
    "placement": "How the workers and gateway processes are placed, per backend.",
    "redundancy": "Host every group's subnet on several workers (cyclic placement) so an answer "
                  "does not wait for the slowest worker and survives a dead one.  Dead or hung "
                  "workers are restarted (on Ray, by Ray).",
    "model repository": "Serving a repository: every model's versions as its version policy "
                        "says; the control API loads, swaps and unloads them without a restart "
                        "(deploy/README.md, 'Model repository').",
}


def group_of(p: argparse.ArgumentParser, name: str, made: dict):
    """The argument group ``name`` of ``p`` (made once; "server": the parser itself)."""
    if name == "server":
        return p
    if name not in made:
        made[name] = p.add_argument_group(name, GROUPS.get(name))
    return made[name]


def add_setting_flags(p: argparse.ArgumentParser, fields=None, *, choices=None,
                      groups: dict | None = None) -> dict:
    """Add the flag of each settings field that has one (``fields``: only those), in its
    group; ``choices``: field -> the values this command accepts where fewer than the
    setting's.  Returns the groups made, by name, for a command's own flags to join."""
    made = groups if groups is not None else {}
    for field, info in GatewaySettings.model_fields.items():
        d = described(field)
        if not d.get("flag") or (fields is not None and field not in fields):
            continue
        names = [d["flag"], *([d["short"]] if d.get("short") else [])]
        help_text = f"{info.description} (default: {default_text(field)})".replace("%", "%%")
        kind, _ = value_type(info.annotation)
        target = group_of(p, d.get("group", "server"), made)
        if kind is bool:
            target.add_argument(*names, dest=field, action="store_true", default=None,
                                help=help_text)
            continue
        allowed = (choices or {}).get(field) or d.get("choices")
        target.add_argument(*names, dest=field, type=kind, default=None, metavar=d.get("metavar"),
                            choices=allowed, help=help_text)
    return made


def setting_flags(p: argparse.ArgumentParser) -> dict[str, str]:
    """Each settings field that ``p`` has a flag for -> that flag (argparse keeps its actions
    only in ``_actions``)."""
    return {a.dest: a.option_strings[0] for a in p._actions
            if a.option_strings and a.dest in GatewaySettings.model_fields}


def setting_knobs(fields=None) -> list[Knob]:
    """The ``--set`` keys of the gateway settings (``fields``: only those), each described by
    its declaration."""
    out = []
    for field, info in GatewaySettings.model_fields.items():
        if fields is not None and field not in fields:
            continue
        kind, optional = value_type(info.annotation)
        out.append(Knob(field, kind, default_text(field), info.description or "", optional,
                        described(field).get("choices")))
    return out
