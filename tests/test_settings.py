"""One settings model: its fields, their environment variables and flags, and the operator's
reference (deploy/README.md) kept in step with them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from sensai.cli.serve import register, settings_from
from sensai.errors import SensaiError
from sensai.serving.core.settings import (ENV_PREFIX, GatewaySettings, described, load_settings,
                                          settings_table)

README = Path(__file__).resolve().parents[1] / "deploy" / "README.md"


def parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog="sensai")
    sub = top.add_subparsers()
    register(sub)
    return top, sub.choices["serve"]


def serve_flags() -> dict[str, str]:
    top, _ = parser()
    return top.parse_args(["serve", "ART"]).flags


def readme_rows() -> dict[str, str]:
    """Each SENSAI_* variable of the settings table -> its row."""
    rows = {}
    for line in README.read_text().splitlines():
        m = re.match(r"\| `(SENSAI_[A-Z0-9_]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    return rows


@pytest.mark.parametrize("field", list(GatewaySettings.model_fields))
def test_every_setting_is_documented_with_its_variable_and_flag(field):
    rows = readme_rows()
    env = f"{ENV_PREFIX}{field.upper()}"
    assert env in rows, f"deploy/README.md's settings table has no row for {env}"
    flag = serve_flags().get(field)
    if flag is not None:
        assert f"`{flag}`" in rows[env], f"the row of {env} does not name {flag}"


def test_every_serve_flag_is_documented():
    text = README.read_text()
    _, serve = parser()
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", serve.format_help())) - {"--help"}
    assert {"--keep-cores-awake", "--spread-cores", "--inject-delay"} <= flags
    missing = sorted(f for f in flags if f"`{f}" not in text)
    assert not missing, f"not in deploy/README.md: {missing}"


def test_the_readme_table_is_the_one_made_from_the_declarations():
    """deploy/README.md's settings table is exactly what the declarations make, so a setting's
    help, flag and default are written in one place."""
    text = README.read_text()
    assert settings_table() in text, ("deploy/README.md's settings table differs from the "
                                      "declarations: paste `python -m "
                                      "sensai.serving.core.settings` over it")


def test_every_flag_comes_from_the_declaration():
    """serve's flag of a setting is the one declared, with the declared help and default."""
    _, serve = parser()
    by_dest = {a.dest: a for a in serve._actions if a.option_strings}
    for field, info in GatewaySettings.model_fields.items():
        flag = described(field).get("flag")
        if flag is None:
            assert field not in by_dest, field
            continue
        action = by_dest[field]
        assert action.option_strings[0] == flag and action.default is None
        assert action.help.startswith(info.description.replace("%", "%%")[:40])
    assert "processes" not in by_dest  # no alias of --backend processes


def test_the_table_names_no_setting_that_does_not_exist():
    fields = {f"{ENV_PREFIX}{f.upper()}" for f in GatewaySettings.model_fields}
    assert set(readme_rows()) - fields == set()


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(monkeypatch):
    top, _ = parser()
    monkeypatch.setenv("SENSAI_REDUNDANCY", "1")
    monkeypatch.setenv("SENSAI_SPREAD_CORES", "true")
    s = settings_from(top.parse_args(["serve", "ART", "--deadline", "3"]))
    assert (s.redundancy, s.spread_cores, s.deadline_s, s.hedge_ms) == (1, True, 3.0, 0.0)
    s = settings_from(top.parse_args(["serve", "ART", "-r", "2", "--hedge-ms", "4",
                                      "--restart-delay", "1", "--ray-cpus", "0.5",
                                      "--workers", "3", "--log-level", "debug",
                                      "--keep-cores-awake", "auto"]))
    assert (s.redundancy, s.hedge_ms, s.restart_delay_s, s.ray_cpus, s.workers, s.log_level,
            s.keep_cores_awake) == (2, 4.0, 1.0, 0.5, 3, "debug", "auto")


def test_host_tunings_are_off_by_default(monkeypatch):
    for name in ("SENSAI_KEEP_CORES_AWAKE", "SENSAI_SPREAD_CORES"):
        monkeypatch.delenv(name, raising=False)
    top, _ = parser()
    s = settings_from(top.parse_args(["serve", "ART"]))
    assert s.keep_cores_awake == "off" and s.spread_cores is False


@pytest.mark.parametrize("argv,message", [
    (["--ray-cpus", "0"], "--ray-cpus must be > 0, got 0"),
    (["--hedge-ms", "-1"], "--hedge-ms must be >= 0, got -1"),
    (["--restart-delay", "-2"], "--restart-delay must be >= 0, got -2"),
    (["--port", "70000"], "--port must be <= 65535, got 70000"),
    (["--backend", "triton", "-r", "1"], "Triton runs one model per subnet"),
    (["--backend", "ray", "--gateway-replicas", "2"], "--gateway-replicas does not apply"),
])
def test_bad_values_are_refused_in_one_line_by_their_flag(argv, message):
    top, _ = parser()
    with pytest.raises(SensaiError) as e:
        settings_from(top.parse_args(["serve", "ART", *argv]))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_without_a_flag_an_error_names_the_setting():
    with pytest.raises(SensaiError, match="max_requests must be >= 1, got 0"):
        load_settings({"max_requests": 0})
    with pytest.raises(SensaiError, match="invalid setting keep_cores_awake"):
        load_settings({"keep_cores_awake": "always"})
    # YAML 1.1 reads an unquoted on/off as a boolean: taken to mean the same.
    assert load_settings({"keep_cores_awake": False}).keep_cores_awake == "off"


def test_the_settings_travel_whole():
    """No entry point restates a setting: every function and class the settings reach takes
    them whole, none has a keyword named after a setting (or after one of its old spellings),
    so no default can be written twice."""
    import inspect

    from sensai.bench.baselines import WorkerSet
    from sensai.serving.engine.plan import class_parallel_plan
    from sensai.serving.engine.predictor import ClassParallelPredictor
    from sensai.serving.gateway.admission import Admission
    from sensai.serving.launch.build import build_predictor
    from sensai.serving.launch.serve_app import worker_plan

    old = {"threads", "name", "trust_code", "keep_awake", "max_lag_s"}
    fields = set(GatewaySettings.model_fields) | old
    for entry in (build_predictor, class_parallel_plan, ClassParallelPredictor, Admission,
                  WorkerSet, worker_plan):
        params = set(inspect.signature(entry).parameters)
        assert "settings" in params or "plan" in params, entry
        assert not params & fields, (entry.__qualname__, sorted(params & fields))



def test_cpu_workers_share_as_many_device_processes_as_set():
    """One per worker by default, at most one per worker as set."""
    assert GatewaySettings().cpu_device_processes(5) == 5
    assert GatewaySettings(device_processes=2).cpu_device_processes(5) == 2
    assert GatewaySettings(device_processes=9).cpu_device_processes(3) == 3
