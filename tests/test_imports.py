"""What each path loads: the command line and a local ONNX gateway never import the heavy
libraries they do not use (torch, Ray, tritonclient, matplotlib; the parser not even ONNX
Runtime).  Each check runs in a fresh interpreter, since this test process has loaded them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from tests.helpers import (free_port, png, sample_images, server_process, stop_server,
                           wait_for_server)

# Only the paths that use them import these (the torch runtime, GPUs and training; the ray
# backend; the triton backend; plots).
GATEWAY_NEVER = ("torch", "ray", "tritonclient", "matplotlib")
PARSER_NEVER = (*GATEWAY_NEVER, "onnxruntime")


def top_level(modules) -> set[str]:
    return {m.partition(".")[0] for m in modules}


def test_the_command_line_parser_imports_no_heavy_library():
    code = textwrap.dedent("""
        import json, sys
        import sensai.cli
        parser = sensai.cli.build_parser()
        parser.format_help()
        print(json.dumps(sorted(sys.modules)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    loaded = top_level(json.loads(out))
    assert "sensai" in loaded
    assert not loaded & set(PARSER_NEVER), sorted(loaded & set(PARSER_NEVER))


def test_torchvision_is_imported_only_to_build_its_own_architectures():
    """Importing torchvision's models takes seconds (torch._dynamo with it): every process that
    builds a registry model (training, decomposition, a torch worker) would pay for it."""
    code = textwrap.dedent("""
        import json, sys
        from sensai.models import create_model, list_models
        list_models()
        create_model("vgg16_bn", 10, 1)
        create_model("resnet20", 10, 1)
        before = "torchvision" in sys.modules
        net = create_model("resnet18", 10, 1)
        print(json.dumps([before, "torchvision" in sys.modules, type(net).__name__]))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out) == [False, True, "ResNet18Small"]


def test_a_deferred_command_still_parses_and_shows_its_help():
    """``sensai decompose`` adds its arguments when used: its help lists them and its errors are
    argparse's one line."""
    proc = subprocess.run([sys.executable, "-m", "sensai", "decompose", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--samples-per-subnet" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "sensai", "decompose", "--model-dir", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--groups" in proc.stderr
    assert "Traceback" not in proc.stderr


def mapped_libraries(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {os.path.basename(line.split()[-1]) for line in f
                if len(line.split()) >= 6 and ".so" in line.split()[-1]}


@pytest.mark.slow
def test_a_local_onnx_gateway_loads_neither_torch_nor_ray(tiny_artifact, fmnist_test, tmp_path):
    """``sensai serve --backend local`` (runtime auto: ONNX Runtime on the CPU) in its own
    process answers a real image, with no torch library mapped into it, and when it stops its
    interpreter has imported none of torch, Ray, tritonclient or matplotlib, nor the
    benchmark."""
    port = free_port()
    modules_file = tmp_path / "modules.json"
    # The real command, in an interpreter that writes what it imported when it exits.
    code = textwrap.dedent(f"""
        import atexit, json, sys
        atexit.register(lambda: open({str(modules_file)!r}, "w").write(
            json.dumps(sorted(sys.modules))))
        from sensai.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    with server_process([sys.executable, "-c", code, "serve", str(tiny_artifact), "--backend",
                         "local", "--port", str(port), "--set", "keep_cores_awake=off",
                         "--log-level", "warning"]) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(proc, url, timeout_s=120)
        _, images, _ = sample_images(fmnist_test, 1)
        r = httpx.post(f"{url}/v1/predict", content=png(images[0]), timeout=30)
        assert r.status_code == 200, r.text
        libs = mapped_libraries(proc.pid)
        assert any("onnxruntime" in lib for lib in libs)  # the check sees what is loaded
        assert not {lib for lib in libs if "torch" in lib or lib.startswith("libc10")}
        assert stop_server(proc) == 0, proc.stderr.read().decode()[-3000:]
    modules = json.loads(modules_file.read_text())
    loaded = top_level(modules)
    assert {"sensai", "onnxruntime", "fastapi"} <= loaded
    assert not loaded & set(GATEWAY_NEVER), sorted(loaded & set(GATEWAY_NEVER))
    # The benchmark is a package beside the product: serving never loads it.
    assert "sensai.serving.gateway.app" in modules
    assert not [m for m in modules if m.startswith("sensai.bench")]
