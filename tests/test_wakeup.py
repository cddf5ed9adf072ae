"""Idle cores kept awake while serving: the PM QoS request, held and withdrawn."""

import logging
import os
import struct

import pytest

from sensai.errors import SensaiError
from sensai.serving.core.settings import GatewaySettings
from sensai.serving.core.wakeup import DEVICE, LATENCY_US, current_limit_us, keep_cores_awake

MAY_HOLD = os.access(DEVICE, os.R_OK | os.W_OK)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_request_is_written_held_open_and_withdrawn(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    before = open_fds()
    with keep_cores_awake("auto", str(device)) as awake:
        assert awake.held and awake.describe() == {
            "mode": "auto", "held": True, "latency_us": LATENCY_US,
            "detail": f"{device}: {LATENCY_US} us"}
        # The kernel reads one native int; the request lasts while the file stays open.
        assert device.read_bytes() == struct.pack("=i", LATENCY_US)
        assert len(open_fds() - before) == 1
    assert open_fds() == before and not awake.held
    awake.release()  # twice is harmless


def test_off_is_the_default_and_never_opens_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv("SENSAI_KEEP_CORES_AWAKE", raising=False)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: (opened.append(path),
                                                            real_open(path, *a, **k))[1])
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"x")
    awake = keep_cores_awake(device=str(device))
    assert awake.describe() == {"mode": "off", "held": False, "latency_us": None,
                                "detail": "not asked: keep_cores_awake off"}
    assert opened == [] and device.read_bytes() == b"x"
    assert GatewaySettings().keep_cores_awake == "off"


def test_auto_carries_on_on_refuses_off_never_asks(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    missing = str(tmp_path / "none")
    awake = keep_cores_awake("auto", missing)
    assert not awake.held and "No such file" in awake.detail
    assert any("idle cores may sleep deeply" in r.getMessage() for r in caplog.records)
    with pytest.raises(SensaiError) as e:
        keep_cores_awake("on", missing)
    assert "\n" not in str(e.value) and "cannot keep idle cores awake" in str(e.value)
    device = tmp_path / "untouched"
    device.write_bytes(b"x")
    awake = keep_cores_awake("off", str(device))
    assert not awake.held and device.read_bytes() == b"x"
    with pytest.raises(SensaiError, match="auto, on, off"):
        keep_cores_awake("always", str(device))


@pytest.mark.skipif(not MAY_HOLD, reason=f"{DEVICE} is root's (this process may not open it)")
def test_the_kernel_grants_the_request_and_forgets_it_on_release():
    before = current_limit_us()
    assert before is not None
    with keep_cores_awake("on") as awake:
        assert awake.held and current_limit_us() == LATENCY_US
    assert current_limit_us() == before
