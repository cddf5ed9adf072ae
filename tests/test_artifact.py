"""An artifact is untrusted input: every file is checked against the manifest before use, and
nothing it names is imported without the operator's consent.  Each case is refused at load,
with one line, for every runtime and for ``export-triton`` (see test_serving_triton.py)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from sensai.artifact import load_artifact
from sensai.cli import main
from sensai.errors import CheckpointError, SensaiError, UnknownModelError
from sensai.export import export_onnx
from sensai.fsutil import sha256_file, write_json_atomic
from sensai.manifest import MANIFEST
from sensai.models import create_model
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.launch.build import build_predictor

PROBE = "sensai_untrusted_probe"


def tampered(tiny_artifact, tmp_path: Path, edit) -> Path:
    """A copy of the artifact whose manifest ``edit(root, manifest_dict)`` changed."""
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    m = load_artifact(art).manifest.model_dump(mode="json")
    edit(art, m)
    write_json_atomic(art / MANIFEST, m)
    return art


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A module that leaves a mark when imported, importable as PROBE:factory."""
    mark = tmp_path / "imported"
    (tmp_path / f"{PROBE}.py").write_text(
        f"from pathlib import Path\nPath({str(mark)!r}).write_text('yes')\n"
        "def factory(num_classes, in_channels):\n    raise RuntimeError('not a network')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, PROBE, raising=False)  # imported afresh: its mark is new
    return mark


def test_model_code_named_by_a_manifest_is_not_imported_without_consent(tiny_artifact, tmp_path,
                                                                        probe, capsys):
    art = tampered(tiny_artifact, tmp_path, lambda root, m: m.update(model=f"{PROBE}:factory"))
    with pytest.raises(CheckpointError, match="--trust-model-code"):
        build_predictor(art, GatewaySettings(device="cpu", runtime="torch"))
    assert main(["serve", str(art), "--runtime", "torch", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--trust-model-code" in err and len(err.strip().splitlines()) == 1
    assert not probe.exists()
    # ONNX files never import anything: the same artifact serves with ONNX Runtime.
    pred = build_predictor(art, GatewaySettings(device="cpu", runtime="onnx"))
    pred.shutdown()
    assert not probe.exists()
    # With consent the code is imported (and here fails, being no network).
    with pytest.raises(SensaiError):
        build_predictor(art, GatewaySettings(device="cpu", runtime="torch", trust_model_code=True))
    assert probe.exists()


def test_the_benches_import_model_code_only_with_consent_from_the_environment(
        tiny_artifact, trained_model_dir, tmp_path, probe, monkeypatch):
    """The bench commands take no --trust-model-code: their baselines import the original's
    code only with SENSAI_TRUST_MODEL_CODE=1, as the refusal says."""
    import json

    from sensai.bench.strategies import load_original

    model_dir = tmp_path / "model"
    shutil.copytree(trained_model_dir, model_dir)
    record = json.loads((model_dir / "model.json").read_text())
    write_json_atomic(model_dir / "model.json", record | {"model": f"{PROBE}:factory"})
    art = tampered(tiny_artifact, tmp_path,
                   lambda root, m: m["source"].update(model_dir=str(model_dir)))
    monkeypatch.delenv("SENSAI_TRUST_MODEL_CODE", raising=False)
    with pytest.raises(SensaiError, match="set SENSAI_TRUST_MODEL_CODE=1"):
        load_original(load_artifact(art))
    assert not probe.exists()
    monkeypatch.setenv("SENSAI_TRUST_MODEL_CODE", "1")
    with pytest.raises(Exception, match="not a network"):  # imported, and no network
        load_original(load_artifact(art))
    assert probe.exists()


def test_create_model_imports_a_factory_only_with_consent(probe):
    with pytest.raises(UnknownModelError, match="--trust-model-code"):
        create_model(f"{PROBE}:factory", 10, 1)
    assert not probe.exists()


@pytest.mark.parametrize("backend", ["local", "processes"])
def test_a_replaced_onnx_file_is_refused_at_load(backend, tiny_artifact, tmp_path):
    art = tampered(tiny_artifact, tmp_path, lambda root, m: shutil.copyfile(
        root / m["subnets"][0]["onnx"], root / m["subnets"][3]["onnx"]))
    with pytest.raises(SensaiError, match="does not match its sha256"):
        build_predictor(art, GatewaySettings(backend=backend, device="cpu"))


def test_a_replaced_weights_file_is_refused_by_the_torch_runtime(tiny_artifact, tmp_path):
    art = tampered(tiny_artifact, tmp_path, lambda root, m: shutil.copyfile(
        root / m["subnets"][0]["weights"], root / m["subnets"][2]["weights"]))
    with pytest.raises(SensaiError, match="does not match its sha256"):
        build_predictor(art, GatewaySettings(device="cpu", runtime="torch"))


@pytest.mark.parametrize("edit, fragment", [
    (lambda root, m: m["subnets"][1].update(onnx_sha256=""), "malformed"),
    (lambda root, m: m["subnets"][1].update(weights_sha256=""), "malformed"),
    (lambda root, m: m["subnets"][1].update(onnx_sha256=None), "no sha256"),
    (lambda root, m: m["subnets"][1].update(onnx="../../etc/passwd"), "outside the artifact"),
    (lambda root, m: m["dataset"].update(classes=m["dataset"]["classes"][:9]), "class names"),
])
def test_a_malformed_manifest_is_refused_in_one_line(edit, fragment, tiny_artifact, tmp_path,
                                                     capsys):
    art = tampered(tiny_artifact, tmp_path, edit)
    with pytest.raises(CheckpointError, match=fragment):
        build_predictor(art, GatewaySettings(device="cpu"))
    assert main(["serve", str(art)]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1


def test_an_onnx_file_of_another_width_is_refused_at_load(tiny_artifact, tmp_path):
    """A consistent manifest (hash matches) whose ONNX file answers 4 values where the subnet
    has 3: refused when the worker loads it, not on every request."""
    def edit(root, m):
        path = root / m["subnets"][1]["onnx"]
        export_onnx(create_model("fmnist_cnn", 4, 1), (1, 28, 28), path)
        m["subnets"][1]["onnx_sha256"] = sha256_file(path)

    art = tampered(tiny_artifact, tmp_path, edit)
    with pytest.raises(SensaiError, match="gives 4 outputs per image, the manifest says 3"):
        build_predictor(art, GatewaySettings(device="cpu"))


def test_an_old_manifest_says_how_to_upgrade(tiny_artifact, tmp_path):
    art = tampered(tiny_artifact, tmp_path, lambda root, m: m.update(schema_version=1))
    with pytest.raises(CheckpointError, match="re-run the same 'sensai decompose' command"):
        load_artifact(art)


@pytest.mark.parametrize("argv, fragment", [
    (["serve", "{model}"], "{model} is a trained model directory ('sensai train' or 'sensai "
                           "import'), not an artifact or a model repository; 'sensai decompose "
                           "--model-dir {model} --groups N --out ART' makes an artifact of it"),
    (["predict", "{model}", "{image}"], "{model} is a trained model directory ('sensai train' "
                                        "or 'sensai import'), not an artifact;"),
    (["export", "{model}", "--repository", "{tmp}/repo", "--model", "m"],
     "{model} is a trained model directory"),
    (["predict", "{art}", "{tmp}"], "image {tmp} is a directory; give one image file"),
    (["predict", "{art}", "{tmp}/empty.png"], "image {tmp}/empty.png is empty (0 bytes)"),
    (["evaluate", "{tmp}/one.png"], "artifact directory {tmp}/one.png is a file, not a "
                                    "directory"),
])
def test_what_a_directory_is_and_what_was_wanted_is_said_in_one_line(
        argv, fragment, tiny_artifact, trained_model_dir, tmp_path, capsys):
    """A trained model directory where an artifact is wanted (serve would take it for a model
    repository without models), a directory where an image is wanted."""
    (tmp_path / "one.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    if "{tmp}/empty.png" in argv:
        (tmp_path / "empty.png").touch()
    names = dict(model=trained_model_dir, art=tiny_artifact, tmp=tmp_path,
                 image=tmp_path / "one.png")
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment.format(**names) in err[0], err
    made = sorted(p.name for p in tmp_path.iterdir() if p.name != "empty.png")
    assert made == ["one.png"]  # nothing created
