"""The bench commands' flags and ``--set`` keys, made from the options dataclasses their run
functions take (sensai.bench.options): each option declared once, the decisions as flags, the
rest as ``--set`` keys, and the command a run records parses back to the same options."""

from __future__ import annotations

import dataclasses

import pytest

from sensai.bench.options import (BenchOptions, LoadOptions, LoadPlan, PlanOptions,
                                  RobustOptions, SwapOptions)
from sensai.bench.plan_judge import Constraints
from sensai.cli import build_parser
from sensai.cli.bench import load_options
from sensai.cli.options_args import command_line, options_from

COMMANDS = {"bench": [BenchOptions], "bench-robust": [RobustOptions],
            "bench-load": [LoadPlan, LoadOptions], "bench-swap": [SwapOptions],
            "plan": [Constraints, PlanOptions, LoadOptions]}


def command_parser(name: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices[name]
    parser.complete()
    return parser


def test_the_bench_commands_offer_their_decisions_as_at_most_sixty_flags():
    flags = {name: [a for a in command_parser(name)._actions
                    if a.option_strings and a.dest != "help"] for name in COMMANDS}
    assert sum(map(len, flags.values())) <= 60
    for name, classes in COMMANDS.items():
        set_action = next(a for a in flags[name] if a.dest == "knobs")
        dests = {a.dest for a in flags[name]}
        for cls in classes:
            for f in dataclasses.fields(cls):
                if "flag" in f.metadata:
                    assert f.metadata["help"], (name, f.name)
                elif "help" in f.metadata:  # a --set key, never a flag too
                    assert f.metadata["help"] and f.name not in dests, (name, f.name)
                    if name != "plan" or f.name not in ("overload_factor", "retry_after"):
                        assert f.name in set_action.knobs, (name, f.name)


@pytest.mark.parametrize("argv, cls", [
    (["bench", "ART", "--out", "O", "-K", "3", "--strategies", "single", "class-parallel",
      "--backend", "local", "ray", "--set", "rounds=2", "--set", "keep_cores_awake=on",
      "--set", "spread_cores=true", "--images", "20"], BenchOptions),
    (["bench-robust", "ART", "--out", "O", "-r", "1", "--hedge-ms", "5", "--set",
      "delay=fixed:5ms", "--set", "kill_at=0.5", "--set", "deadline_s=none"], RobustOptions),
    (["bench-swap", "A", "B", "--out", "O", "--swaps", "2", "-c", "4", "--set",
      "steady_seconds=2.5", "--set", "keep_repo=true"], SwapOptions),
    (["plan", "M", "ART", "--out", "O", "--latency-budget-ms", "10", "--levels", "1", "8",
      "--set", "level_seconds=0.5", "--set", "clients=1"], PlanOptions),
])
def test_the_recorded_command_parses_back_to_the_same_options(argv, cls):
    args = build_parser().parse_args(argv)
    options = options_from(cls, args)
    again = build_parser().parse_args(command_line(args).split()[1:])
    assert options_from(cls, again) == options
    assert command_line(again) == command_line(args)


def test_plan_takes_the_load_options_it_measures_with_and_no_backend_or_overload():
    args = build_parser().parse_args(["plan", "M", "--out", "O", "--set", "client_cores=1",
                                      "--set", "startup_timeout=60", "--env",
                                      "SENSAI_RUNTIME=sim"])
    options = load_options(args)
    assert (options.client_cores, options.startup_timeout, options.env) == \
        (1, 60.0, {"SENSAI_RUNTIME": "sim"})
    assert options.backend is None and options.command.startswith("sensai plan M --out O ")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "M", "--out", "O", "--set", "retry_after=false"])


def test_progress_shows_only_on_a_terminal(monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert BenchOptions().progress is False
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert LoadOptions().progress is True and LoadOptions(progress=False).progress is False
