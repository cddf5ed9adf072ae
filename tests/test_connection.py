"""The worker socket of the Ray actor transport (``serving/transports/connection.py``): real TCP
on 127.0.0.1, a real subnet runner behind it.  Only a client holding the key is served, nothing
is unpickled before both ends have proved it, and a silent peer cannot hang the gateway."""

from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import Connection

import numpy as np
import pytest

from sensai.artifact import load_artifact
from sensai.data import normalize
from sensai.errors import SensaiError
from sensai.serving.core.messages import Output, Ping, Pong, Ready, Run, Shutdown
from sensai.serving.transports.connection import accept, dial, serve_connection
from sensai.serving.workers.loop import WorkerCore
from sensai.serving.workers.runners import runner_specs
from tests.helpers import sample_images

KEY = os.urandom(32)


class Planted:
    """Creates ``path`` if it is ever unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture()
def worker(tiny_artifact):
    """A worker socket on 127.0.0.1 serving subnet 0 of the tiny artifact once a client holding
    KEY connects; yields (address, runner, the serving thread)."""
    spec = runner_specs(load_artifact(tiny_artifact), device="cpu")[0]
    runner = spec.build()
    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()[:2]

    def main():
        try:
            conn = accept(server, KEY, 20.0)
        finally:
            server.close()
        if conn is not None:
            try:
                serve_connection(conn, conn, WorkerCore({0: runner}),
                                 Ready(os.getpid(), "cpu", spec.resolved_runtime()))
            finally:
                conn.close()

    t = threading.Thread(target=main, daemon=True)
    t.start()
    yield address, runner, t
    t.join(25)


def test_only_the_key_holder_is_served_and_nothing_is_unpickled_before(
        worker, tmp_path, fmnist_test, fmnist_spec):
    address, runner, serving = worker
    # 1. A client with another key is refused, on both sides of the handshake.
    with pytest.raises(SensaiError, match="authentication failed"):
        dial(address, os.urandom(32), 5.0)
    # 2. A client that skips the handshake and sends a pickle: it is read as the answer to the
    #    challenge (bytes, never unpickled) and refused.
    planted = tmp_path / "planted"
    raw = Connection(socket.create_connection(address).detach())
    raw.recv_bytes()  # the worker's challenge
    raw.send(Planted(str(planted)))
    with pytest.raises((EOFError, OSError)):
        raw.recv_bytes()  # the worker says "failure" then hangs up; nothing more comes
        raw.recv_bytes()
    raw.close()
    assert not planted.exists()
    # 3. The key holder is served: the same scores as the runner itself, and a ping answered.
    conn = dial(address, KEY, 5.0)
    ready = conn.recv()
    assert isinstance(ready, Ready) and ready.device == "cpu"
    _, images, _ = sample_images(fmnist_test, 3)
    x = normalize(images, fmnist_spec).numpy()
    for i in range(len(x)):
        conn.send(Run(i, x[i:i + 1], (0,), 1))
        out = conn.recv()
        assert isinstance(out, Output) and (out.req, out.group) == (i, 0)
        np.testing.assert_allclose(out.output, runner.run(x[i:i + 1]), atol=1e-6)
        assert conn.recv().req == i  # Done
    conn.send(Ping(7))
    assert conn.recv() == Pong(7)
    conn.send(Shutdown())
    serving.join(10)
    assert not serving.is_alive()
    conn.close()


def test_a_silent_client_does_not_keep_the_gateway_out(worker, monkeypatch):
    """Somebody connects to the worker's port first and says nothing: the worker hangs up on
    them after HANDSHAKE_S, and the gateway, connecting meanwhile, is served."""
    from sensai.serving.transports import connection

    monkeypatch.setattr(connection, "HANDSHAKE_S", 0.5)
    address, _, serving = worker
    squatter = socket.create_connection(address)
    try:
        conn = dial(address, KEY, 10.0)
        assert isinstance(conn.recv(), Ready)
        conn.send(Shutdown())
        serving.join(10)
        conn.close()
        squatter.settimeout(5)
        while squatter.recv(1024):  # the challenge it ignored, then the worker hung up
            pass
    finally:
        squatter.close()


def test_a_silent_peer_cannot_hang_the_gateway():
    """A port that accepts but never speaks (not a sensai worker): connect gives up within its
    timeout with one line, instead of blocking the restart thread for ever."""
    server = socket.create_server(("127.0.0.1", 0))
    try:
        t0 = time.monotonic()
        with pytest.raises(SensaiError, match="no authenticated handshake within 1 s"):
            dial(server.getsockname()[:2], KEY, 1.0)
        assert time.monotonic() - t0 < 10
    finally:
        server.close()


def test_nothing_listening_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = s.getsockname()[:2]
    with pytest.raises(SensaiError, match="cannot reach the worker at 127.0.0.1"):
        dial(address, KEY, 2.0)


def test_accept_waits_only_so_long():
    server = socket.create_server(("127.0.0.1", 0))
    try:
        assert accept(server, KEY, 0.3) is None
    finally:
        server.close()


def test_pickle_of_planted_object_would_be_seen(tmp_path):
    """The planted object above really creates its file when unpickled, so test 1 can fail."""
    path = tmp_path / "seen"
    pickle.loads(pickle.dumps(Planted(str(path)))).close()
    assert path.exists()
