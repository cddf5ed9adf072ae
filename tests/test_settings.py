"""One settings model: its fields, their environment variables and flags, and the operator's
reference (deploy/README.md) kept in step with them."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from sensai.cli.serve import register, settings_from
from sensai.errors import SensaiError
from sensai.serving.core.settings import (ENV_PREFIX, GatewaySettings, described, knob_fields,
                                          load_settings, settings_table)

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
    """Each row names how ``sensai serve`` sets it: its flag, else its ``--set KEY=...``, else
    "-" (a secret: its variable, or the token file)."""
    rows = readme_rows()
    env = f"{ENV_PREFIX}{field.upper()}"
    assert env in rows, f"deploy/README.md's settings table has no row for {env}"
    flag = serve_flags().get(field)
    if flag is not None:
        assert f"`{flag}`" in rows[env], f"the row of {env} does not name {flag}"
    elif field in knob_fields():
        assert f"| `--set {field}=" in rows[env], f"the row of {env} does not name --set {field}"
    else:
        assert f"| `{env}` | - |" in rows[env]


def test_serve_sets_every_setting_without_a_flag_by_set_but_no_secret():
    top, serve = parser()
    knobs = {a.dest: a for a in serve._actions}["knobs"].knobs
    flags = serve_flags()
    assert set(knobs) == set(knob_fields()) and not set(knobs) & set(flags)
    assert set(knobs) | set(flags) | {"repository_token"} == set(GatewaySettings.model_fields)
    with pytest.raises(SystemExit):
        top.parse_args(["serve", "ART", "--set", "repository_token=a-token-of-enough-length"])


def test_every_serve_flag_is_documented():
    text = README.read_text()
    _, serve = parser()
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", serve.format_help())) - {"--help"}
    assert {"--set", "--inject-delay", "--config", "--repository-token-file"} <= flags
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
    monkeypatch.setenv("SENSAI_HEDGE_MS", "7")
    s = settings_from(top.parse_args(["serve", "ART", "--deadline", "3"]))
    assert (s.redundancy, s.spread_cores, s.deadline_s, s.hedge_ms) == (1, True, 3.0, 7.0)
    s = settings_from(top.parse_args(["serve", "ART", "-r", "2", "--set", "hedge_ms=4",
                                      "--set", "restart_delay_s=1", "--set", "ray_cpus=0.5",
                                      "--workers", "3", "--log-level", "debug",
                                      "--set", "keep_cores_awake=auto", "--set",
                                      "spread_cores=false", "--set", "gateway_replicas=none",
                                      "--runtime", "sim:0.5", "--model-control", "poll:2"]))
    assert (s.redundancy, s.hedge_ms, s.restart_delay_s, s.ray_cpus, s.workers, s.log_level,
            s.keep_cores_awake, s.spread_cores, s.gateway_replicas) == (
        2, 4.0, 1.0, 0.5, 3, "debug", "auto", False, None)
    assert (s.runtime_kind, s.sim_launch_ms, s.model_control_kind, s.repository_poll_s) == (
        "sim", 0.5, "poll", 2.0)


def test_flags_win_over_set_which_wins_over_a_config_file(tmp_path, monkeypatch):
    """env < --config < --set < flags; an error names the setting as it was given."""
    import json

    monkeypatch.setenv("SENSAI_HEDGE_MS", "1")
    monkeypatch.setenv("SENSAI_MAX_REQUESTS", "100")
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"kind": "sensai-serve-config", "schema_version": 1,
                                "settings": {"hedge_ms": 2, "max_requests": 50, "deadline_s": 9,
                                             "batch_delay_us": 5}}))
    top, _ = parser()
    s = settings_from(top.parse_args(["serve", "ART", "--config", str(path), "--set",
                                      "hedge_ms=3", "--deadline", "4"]))
    assert (s.hedge_ms, s.max_requests, s.deadline_s, s.batch_delay_us) == (3.0, 50, 4.0, 5.0)
    path.write_text(path.read_text().replace('"max_requests": 50', '"max_requests": 0'))
    with pytest.raises(SensaiError, match=f"--config {path}: max_requests must be >= 1"):
        settings_from(top.parse_args(["serve", "ART", "--config", str(path)]))
    with pytest.raises(SensaiError, match="--set max_requests must be >= 1"):
        settings_from(top.parse_args(["serve", "ART", "--config", str(path), "--set",
                                      "max_requests=-1"]))


@pytest.mark.parametrize("runtime, kind, ms", [("auto", "auto", 0.3), ("sim", "sim", 0.3),
                                               ("sim:0", "sim", 0.0), ("sim:12.5", "sim", 12.5)])
def test_the_runtime_carries_the_simulated_launch_time(runtime, kind, ms):
    s = GatewaySettings(runtime=runtime)
    assert (s.runtime, s.runtime_kind, s.sim_launch_ms) == (runtime, kind, ms)


@pytest.mark.parametrize("control, kind, poll_s", [("none", "none", 15.0),
                                                   ("explicit", "explicit", 15.0),
                                                   ("poll", "poll", 15.0),
                                                   ("poll:0.2", "poll", 0.2)])
def test_model_control_carries_the_poll_interval(control, kind, poll_s):
    s = GatewaySettings(model_control=control)
    assert (s.model_control_kind, s.repository_poll_s) == (kind, poll_s)


def test_host_tunings_are_off_by_default(monkeypatch):
    for name in ("SENSAI_KEEP_CORES_AWAKE", "SENSAI_SPREAD_CORES"):
        monkeypatch.delenv(name, raising=False)
    top, _ = parser()
    s = settings_from(top.parse_args(["serve", "ART"]))
    assert s.keep_cores_awake == "off" and s.spread_cores is False


@pytest.mark.parametrize("argv,message", [
    (["--set", "ray_cpus=0"], "--set ray_cpus must be > 0, got 0"),
    (["--set", "hedge_ms=-1"], "--set hedge_ms must be >= 0, got -1"),
    (["--set", "restart_delay_s=-2"], "--set restart_delay_s must be >= 0, got -2"),
    (["--port", "70000"], "--port must be <= 65535, got 70000"),
    (["--backend", "triton", "-r", "1"], "Triton runs one model per subnet"),
    (["--backend", "ray", "--set", "gateway_replicas=2"],
     "--set gateway_replicas does not apply"),
    (["--runtime", "sim:abc"], "invalid setting --runtime: sim:MS wants a number >= 0"),
    (["--runtime", "sim:-1"], "invalid setting --runtime: sim:MS wants a number >= 0"),
    (["--runtime", "gpu"], "invalid setting --runtime: expected one of auto, onnx"),
    (["--model-control", "poll:0"], "invalid setting --model-control: poll:SECONDS wants"),
    (["--model-control", "explicit:3"], "invalid setting --model-control: expected one of"),
    (["--set", "version_policy=newest"], "invalid setting --set version_policy"),
])
def test_bad_values_are_refused_in_one_line_by_their_flag(argv, message):
    top, _ = parser()
    with pytest.raises(SensaiError) as e:
        settings_from(top.parse_args(["serve", "ART", *argv]))
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("command, variable, value, message", [
    ("serve", "SENSAI_PORT", "abc",
     "invalid setting SENSAI_PORT: expected an integer from 0 to 65535; got 'abc'"),
    ("serve", "SENSAI_DEADLINE_S", "-1", "SENSAI_DEADLINE_S must be > 0, got -1"),
    ("serve", "SENSAI_HEDGE_MS", "abc",
     "invalid setting SENSAI_HEDGE_MS: expected a number >= 0; got 'abc'"),
    ("serve", "SENSAI_BACKEND", "bogus", "invalid setting SENSAI_BACKEND: expected one of "
                                         "local, processes, ray, triton, ray-serve; got 'bogus'"),
    ("predict", "SENSAI_BACKEND", "bogus", "invalid setting SENSAI_BACKEND: expected one of "
                                           "local, processes, ray, triton, ray-serve; got 'bogus'"),
    ("serve", "SENSAI_VOTE", "maybe", "invalid setting SENSAI_VOTE: expected true or false; "
                                      "got 'maybe'"),
    ("serve", "SENSAI_RUNTIME", "gpu", "invalid setting SENSAI_RUNTIME: expected one of auto, "
                                       "onnx, torch, cuda-graph, sim, or sim:MS; got 'gpu'"),
    # A secret is not repeated.
    ("serve", "SENSAI_REPOSITORY_TOKEN", "short",
     "invalid setting SENSAI_REPOSITORY_TOKEN: expected at least 16 characters"),
])
def test_an_environment_variables_error_names_the_variable(monkeypatch, command, variable,
                                                           value, message):
    """A value from the environment is called by its variable, never by the flag that was not
    given, and what the setting takes is said in words."""
    from sensai.cli import build_parser

    top = build_parser()
    monkeypatch.setenv(variable, value)
    argv = [command, "ART"] + (["x.png"] if command == "predict" else [])
    with pytest.raises(SensaiError) as e:
        settings_from(top.parse_args(argv))
    assert str(e.value) == message
    if command == "serve" and variable == "SENSAI_PORT":  # the flag given wins, and is named
        assert settings_from(top.parse_args([command, "ART", "--port", "5"])).port == 5
        with pytest.raises(SensaiError, match="--port must be <= 65535, got 70000"):
            settings_from(top.parse_args([command, "ART", "--port", "70000"]))


def test_a_setting_with_a_flag_refused_by_the_backend_is_named_by_its_variable(monkeypatch):
    monkeypatch.setenv("SENSAI_GRPC_PORT", "1")
    top, _ = parser()
    with pytest.raises(SensaiError) as e:
        settings_from(top.parse_args(["serve", "ART", "--backend", "ray-serve"]))
    assert str(e.value) == ("SENSAI_GRPC_PORT does not apply to --backend ray-serve (the Serve "
                            "ingress has no gRPC server)")


def test_a_config_files_value_is_named_by_the_file_and_said_in_words(tmp_path):
    import json

    path = tmp_path / "d.json"
    path.write_text(json.dumps({"kind": "sensai-serve-config", "schema_version": 1,
                                "settings": {"hedge_ms": "abc"}}))
    top, _ = parser()
    with pytest.raises(SensaiError) as e:
        settings_from(top.parse_args(["serve", "ART", "--config", str(path)]))
    assert str(e.value) == (f"invalid setting --config {path}: hedge_ms: expected a number "
                            ">= 0; got 'abc'")


def test_without_a_flag_an_error_names_the_setting():
    with pytest.raises(SensaiError, match="max_requests must be >= 1, got 0"):
        load_settings({"max_requests": 0})
    with pytest.raises(SensaiError, match="invalid setting runtime: sim:MS"):
        load_settings({"runtime": "sim:x"})
    with pytest.raises(SensaiError, match="invalid setting keep_cores_awake"):
        load_settings({"keep_cores_awake": "always"})
    # YAML 1.1 reads an unquoted on/off as a boolean: taken to mean the same.
    assert load_settings({"keep_cores_awake": False}).keep_cores_awake == "off"


def test_a_retired_settings_variable_is_refused_with_its_replacement(monkeypatch):
    """An upgraded deployment's leftover variable is not dropped without a word."""
    monkeypatch.setenv("SENSAI_HEAD_TIMEOUT_S", "30")
    monkeypatch.setenv("SENSAI_SIM_LAUNCH_MS", "1")
    top, _ = parser()
    with pytest.raises(SensaiError) as e:
        settings_from(top.parse_args(["serve", "ART"]))
    message = str(e.value)
    assert "SENSAI_HEAD_TIMEOUT_S (now SENSAI_CLIENT_TIMEOUT_S)" in message
    assert "SENSAI_SIM_LAUNCH_MS (now SENSAI_RUNTIME=sim:MS)" in message
    assert "\n" not in message
    monkeypatch.delenv("SENSAI_HEAD_TIMEOUT_S")
    monkeypatch.delenv("SENSAI_SIM_LAUNCH_MS")
    assert settings_from(top.parse_args(["serve", "ART"])).client_timeout_s == 10.0


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

    old = {"threads", "name", "trust_code", "keep_awake", "max_lag_s", "sim_launch_ms",
           "repository_poll_s", "head_timeout_s", "body_timeout_s", "max_decoded_bytes"}
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
