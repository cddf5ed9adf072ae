"""The project's one way of starting Ray keeps Ray's start-up chatter out of the console."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

START_LOCAL_RAY = """
import logging, sys
import ray
logging.basicConfig(level=logging.DEBUG, filename=sys.argv[1])
from sensai.raycluster import connect
assert connect(num_cpus=1)
print(ray.get(ray.remote(lambda: "task ran").remote()))
ray.shutdown()
"""


def test_starting_a_local_ray_prints_no_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    log_file = tmp_path / "sensai.log"
    r = subprocess.run([sys.executable, "-c", START_LOCAL_RAY, str(log_file)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "task ran"
    assert "WARNING" not in r.stderr and "Token authentication" not in r.stderr, r.stderr
    # Not lost: the notice is in the debug log.
    assert "sensai.raycluster:ray: Token authentication is enabled" in log_file.read_text()
