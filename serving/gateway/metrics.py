"""Prometheus metrics of one gateway (own registry, so several gateways can live in one process).

Where several gateway processes serve one port (:mod:`~sensai.serving.launch.fleet`), each is
started with ``PROMETHEUS_MULTIPROC_DIR`` set (prometheus_client's multiprocess mode): every
value lives in a file of that directory, and ``/metrics`` from any process renders the sums over
all of them - the whole server, whichever process answers.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from .statistics import InferenceStats

SHARED_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
FOLLOW_S = 0.5  # how often a followed value is copied into a shared gauge

# Latency buckets wide enough for a small subnet on a fast device at one end and a request near
# its deadline at the other.
BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
           0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# A full collection of a frozen heap against one of the whole heap of a process holding torch.
GC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch: int = 64) -> None:
        self.shared_dir = os.environ.get(SHARED_DIR_ENV)
        # Triton's statistics extension: its own counters, beside the same shared directory.
        self.stats = InferenceStats(max_batch, self.shared_dir)
        if self.shared_dir:
            # Before any metric is made: each makes its value with the class set now.
            values.ValueClass = values.MultiProcessValue()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "sensai_requests", "HTTP and gRPC requests by route, method (GRPC: a gRPC call) and "
            "status (an HTTP status, for gRPC calls too)", ["route", "method", "status"],
            registry=r)
        self.request_seconds = Histogram("sensai_request_seconds", "HTTP and gRPC request latency",
                                         ["route"], buckets=BUCKETS, registry=r)
        self.errors = Counter("sensai_request_errors", "requests answered with an error, by reason",
                              ["route", "status", "reason"], registry=r)
        self.inflight = Gauge("sensai_inflight_requests", "requests being served", registry=r,
                              multiprocess_mode="livesum")
        # Per model version: a gateway may serve several (:mod:`.served`).
        self.predict_seconds = Histogram("sensai_predict_seconds",
                                         "time in the predictor (fan-out + merge)",
                                         ["model", "version"], buckets=BUCKETS, registry=r)
        self.subnet_seconds = Histogram("sensai_subnet_seconds",
                                        "per-subnet latency as seen by the gateway",
                                        ["model", "version", "subnet"], buckets=BUCKETS,
                                        registry=r)
        self.subnet_errors = Counter("sensai_subnet_errors", "subnet failures and timeouts",
                                     ["model", "version", "subnet", "kind"], registry=r)
        self.images = Counter("sensai_images", "images (batch rows) predicted",
                              ["model", "version"], registry=r)
        self.ready = Gauge("sensai_model_ready", "1 while a model version takes requests",
                           ["model", "version"], registry=r, multiprocess_mode="livemax")
        self.rejected = Counter("sensai_rejected", "requests turned away before any work, by "
                                "reason (max_requests, waited, loop_lag, queue_full, "
                                "max_receiving, slow_body)", ["reason"], registry=r)
        self.rejected_connections = Counter(
            "sensai_rejected_connections", "connections refused before any request, by reason "
            "(max_connections, max_connections_per_client, evicted, evicted_idle, "
            "header_too_large, head_timeout, malformed_http)", ["reason"], registry=r)
        self.waiting = Gauge("sensai_waiting_requests", "requests queued for a prediction slot",
                             registry=r, multiprocess_mode="livesum")
        self.predictor_limit = Gauge("sensai_predictor_limit", "requests the predictor takes at "
                                     "once now (adaptive, at most max_predictions)", registry=r,
                                     multiprocess_mode="livesum")
        self.gc_full = Histogram("sensai_gc_full_collection_seconds",
                                 "the collector's full collections in the gateway's process "
                                 "(every request in flight waits for them)",
                                 buckets=GC_BUCKETS, registry=r)
        # Labelled children by (metric, labels): ``labels()`` checks its arguments and takes a
        # lock on every call, a few times what the observation itself costs.
        self._children: dict = {}

    def child(self, metric, *labels: str):
        """``metric.labels(*labels)``, looked up once."""
        key = (metric, labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def rejected_connection(self, reason: str) -> None:
        self.child(self.rejected_connections, reason).inc()

    def observe_request(self, route: str, method: str, status: str, seconds: float) -> None:
        self.child(self.requests, route, method, status).inc()
        self.child(self.request_seconds, route).observe(seconds)

    def observe_prediction(self, model: str, version: str, timings_ms: dict[str, float],
                           rows: int) -> None:
        self.child(self.images, model, version).inc(rows)
        for k, v in timings_ms.items():
            if k == "total":
                self.child(self.predict_seconds, model, version).observe(v / 1e3)
            elif k.startswith("subnet_"):
                self.child(self.subnet_seconds, model, version, k).observe(v / 1e3)

    def model_ready(self, model: str, version: str, ready: bool) -> None:
        self.child(self.ready, model, version).set(1 if ready else 0)

    def forget_model(self, model: str, version: str) -> None:
        """Drop an unloaded version's series (a version number may come back with new files);
        every per-version series is made through :meth:`child`, so it knows them all."""
        for key in [k for k in self._children if k[1][:2] == (model, version)]:
            metric, labels = key
            metric.remove(*labels)
            del self._children[key]
        self.stats.forget(model, version)

    def follow(self, gauge: Gauge, value: Callable[[], float]) -> None:
        """``gauge`` reads ``value()``: when scraped, or where the values are shared (read from
        files, not from this process) copied in every FOLLOW_S by a thread."""
        if not self.shared_dir:
            gauge.set_function(value)
            return

        def copy() -> None:
            while True:
                gauge.set(value())
                time.sleep(FOLLOW_S)

        threading.Thread(target=copy, daemon=True, name="sensai-metrics-follow").start()

    def render(self) -> bytes:
        if not self.shared_dir:
            return generate_latest(self.registry)
        every = CollectorRegistry()
        MultiProcessCollector(every, path=self.shared_dir)
        return generate_latest(every)
