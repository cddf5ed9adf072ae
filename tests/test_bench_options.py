"""The bench commands' flags and ``--set`` keys, made from the options dataclasses their run
functions take (sensai.bench.options): each option declared once, the decisions as flags, the
rest as ``--set`` keys, and the command a run records parses back to the same options."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from sensai.bench.options import (BenchOptions, LoadOptions, LoadPlan, PlanOptions,
                                  RobustOptions, SwapOptions)
from sensai.bench.plan_judge import Constraints
from sensai.bounds import Bound, bounded_fields, check_bounds
from sensai.cli import build_parser
from sensai.cli.bench import load_options
from sensai.cli.options_args import command_line, options_from
from sensai.errors import SensaiError

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


# --------------------------------------------------------------------------------------------
# Bounds: declared once in each option's field, checked by sensai.bounds.check_bounds


def bounded_classes() -> list[type]:
    from sensai.pruning.decompose import DecomposeConfig
    from sensai.pruning.retrain import RetrainSettings
    from sensai.training.options import TrainOptions

    return [BenchOptions, RobustOptions, LoadOptions, LoadPlan, SwapOptions, PlanOptions,
            TrainOptions, DecomposeConfig, RetrainSettings]


# The gateway's settings among the bench options, checked by their own declarations
# (sensai.serving.core.settings) when the gateway's settings are made.
GATEWAY_CHECKED = {"deadline_s", "restart_delay_s", "max_requests", "max_predictions"}


def numeric_fields(cls) -> list[str]:
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        kinds = {a for a in typing.get_args(hint) if a is not type(None)} or {hint}
        kinds = {typing.get_args(k)[0] if typing.get_origin(k) is tuple else k for k in kinds}
        if kinds & {int, float} and name in {f.name for f in dataclasses.fields(cls)}:
            out.append(name)
    return out


def bad_value(bound: Bound, integer: bool, many: bool):
    """A value just outside ``bound``: below its lower end, else above its upper end."""
    step = 1 if integer else 0.5
    if bound.low is not None:
        value = bound.low - step
    elif bound.above is not None:
        value = bound.above
    elif bound.high is not None:
        value = bound.high + step
    else:
        value = bound.below
    return (value,) if many else value


def expected_name(f: dataclasses.Field) -> str:
    if "flag" in f.metadata:
        return next((n for n in f.metadata["flag"] if n.startswith("--")),
                    "--" + f.name.replace("_", "-"))
    return f"--set {f.name}" if f.metadata.get("set") else f.metadata.get("name", f.name)


def test_every_numeric_option_declares_its_bound_and_its_defaults_are_within():
    for cls in bounded_classes():
        unbounded = [name for name in numeric_fields(cls)
                     if name not in GATEWAY_CHECKED and name not in
                     {f.name for f, *_ in bounded_fields(cls)}]
        assert not unbounded, (cls.__name__, unbounded)
        assert check_bounds(cls()) == cls()


@pytest.mark.parametrize("cls, f, bound, integer, many", [
    pytest.param(cls, f, bound, integer, many, id=f"{cls.__name__}.{f.name}")
    for cls in bounded_classes() for f, bound, integer, _, many in bounded_fields(cls)])
def test_a_value_outside_its_bound_is_refused_naming_the_option(cls, f, bound, integer, many):
    bad = bad_value(bound, integer, many)
    with pytest.raises(SensaiError) as e:
        check_bounds(dataclasses.replace(cls(), **{f.name: bad}))
    message = str(e.value)
    assert message.startswith(f"{expected_name(f)} must be {bound.describe(integer)}, got ")
    assert "\n" not in message
    wrong_kind = [True, float("nan")] + ([2.5] if integer else [])  # never a bool, nor nan
    for value in wrong_kind:
        with pytest.raises(SensaiError, match=f"^{re.escape(expected_name(f))} must be "):
            check_bounds(dataclasses.replace(cls(), **{f.name: (value,) if many else value}))


@pytest.mark.parametrize("options, message", [
    (BenchOptions(images=0), "--images must be an integer >= 1, got 0"),
    (BenchOptions(workers=0), "--stages must be an integer >= 1, got 0"),
    (BenchOptions(rounds=0), "--set rounds must be an integer >= 1, got 0"),
    (RobustOptions(hedges_ms=(1.0, -1.0)), "--hedge-ms must be a number >= 0, got -1.0"),
    (RobustOptions(kill_at=1.0), "--set kill_at must be in [0, 1), got 1.0"),
    (LoadPlan(levels=(1, 0)), "--levels must be an integer from 1 to 1000, got 0"),
    (LoadPlan(soak_seconds=0), "--set soak_seconds must be a number > 0, got 0"),
    (SwapOptions(concurrency=2.5), "--concurrency must be an integer from 1 to 1000, got 2.5"),
    (LoadOptions(overload_factor=float("inf")),
     "--set overload_factor must be a number > 0, got inf"),
])
def test_the_bench_options_bounds_read_as_before(options, message):
    with pytest.raises(SensaiError) as e:
        check_bounds(options)
    assert str(e.value) == message


def test_none_is_a_value_only_where_the_field_is_optional():
    assert check_bounds(BenchOptions(workers=None, requests=None, replicas=None))
    with pytest.raises(SensaiError, match="--images must be an integer >= 1, got None"):
        check_bounds(BenchOptions(images=None))


def test_the_checks_of_the_commands_use_the_declared_bounds():
    from sensai.bench.latency import check_bench_settings
    from sensai.bench.load_run import check_load_settings
    from sensai.bench.swap import check_swap_settings

    with pytest.raises(SensaiError, match=r"^--requests must be an integer >= 1, got 0$"):
        check_bench_settings(BenchOptions(requests=0))
    with pytest.raises(SensaiError, match=r"^--set load_timeout must be a number > 0, got 0$"):
        check_swap_settings(SwapOptions(load_timeout=0))
    with pytest.raises(SensaiError,
                       match=r"^--set burst_concurrency must be an integer from 1 to 1000"):
        check_load_settings(LoadOptions(), LoadPlan(burst_concurrency=0).resolved())
    with pytest.raises(SensaiError, match=r"^--set overload_connections must be an integer >= "
                                          r"--set clients \(2\), got 1$"):
        check_load_settings(LoadOptions(), LoadPlan(overload_connections=1).resolved())
    with pytest.raises(SensaiError, match=r"^--set overload_seconds must be a number > 0"):
        check_load_settings(LoadOptions(), LoadPlan(overload_seconds=0).resolved())
    sweep = LoadPlan(sweep=True, configs=("class-parallel",), levels=(1,), level_seconds=1.0,
                     warmup_seconds=0.0, overload_seconds=0.0)
    check_load_settings(LoadOptions(), sweep)  # 0: no overload
    with pytest.raises(SensaiError, match=r"^--set warmup_seconds must be a number >= 0"):
        check_load_settings(LoadOptions(), dataclasses.replace(sweep, warmup_seconds=-1.0))


@pytest.mark.parametrize("argv, message", [
    (["--configs", "single"], "--configs: --sweep's only"),
    (["--levels", "1", "4", "--set", "level_seconds=2"],
     "--levels, --set level_seconds: --sweep's"),
    (["--transport", "http-v2"], "--transport: --sweep's only"),
    (["--sweep", "-c", "4", "--set", "burst_seconds=1"],
     "--concurrency, --set burst_seconds: the soak's only"),
])
def test_bench_load_refuses_what_its_kind_of_run_does_not_read(tiny_artifact, tmp_path, capsys,
                                                               argv, message):
    """A sweep's flag given to the soak (or the reverse) would be silently ignored: refused in
    one line, before anything is made."""
    from sensai.cli import main

    out = tmp_path / "out"
    assert main(["bench-load", str(tiny_artifact), "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not out.exists()
