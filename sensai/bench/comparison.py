"""``sensai bench --peers``: sensai against the systems a user would pick instead, in one table
(``comparison`` in bench.json; "sensai vs Triton vs Ray Serve" in bench.md, by
:mod:`.latency_report`).

The rows come from one run, over :data:`~.names.PEER_TRANSPORT` (the KServe v2 binary tensor
over HTTP), from the same client process, on the same images, in the same interleaved rounds:
the sensai gateway serving the class-parallel subnets on each pool of the run, and serving the
original model (single device), then each peer serving the original model.  Per row: p50 and
p99, the bare request's p50, the compute of the same ONNX model(s) run alone in this process
(the original model; class parallel: the slowest subnet), and the overhead over compute: the
p50, request by request, of latency minus the same client's bare request to the same server
just before it, minus that compute.  Compute is measured the same way for every system (Triton
reports none per request), so the overheads compare.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .names import PEER_TRANSPORT
from .stats import rounded

TITLE = "sensai vs Triton vs Ray Serve"


def _row(key: str, system: str, serves: str, pool: str, rep: dict,
         compute: float | None) -> dict[str, Any]:
    lat, floors = np.asarray(rep["latencies_ms"]), np.asarray(rep.get("floors_ms") or [])
    above_bare = float(np.median(lat - floors)) if len(floors) == len(lat) > 0 else None
    return {"key": key, "system": system, "serves": serves, "pool": pool,
            "p50_ms": rep["latency_ms"]["p50"], "p99_ms": rep["latency_ms"]["p99"],
            "bare_p50_ms": (rep.get("floor_ms") or {}).get("p50"),
            "latency_minus_bare_p50_ms": rounded(above_bare),
            "compute_ms": compute,
            "overhead_ms": (rounded(above_bare - compute)
                            if above_bare is not None and compute is not None else None),
            "top1": rep["top1"], "images": rep["images"]}


def comparison(result: dict, *, original_compute_ms: float | None) -> dict[str, Any]:
    """bench.json's ``comparison``, from the strategies' and peers' reports in ``result`` and
    the original model's compute alone (the subnets' is the class-parallel strategy's)."""
    strategies, peers = result.get("strategies", {}), result.get("peers", {})
    subnet_ms = strategies.get("class-parallel", {}).get("isolated_compute_ms_p50_max")
    g = result["settings"]["subnets"]
    rows = []
    for key, s in strategies.items():
        rep = s["transports"].get(PEER_TRANSPORT)
        if rep is None or not (key == "single" or key.startswith("class-parallel")):
            continue
        single = key == "single"  # its backend is "local"
        rows.append(_row(key, "sensai gateway",
                         "original model" if single else f"{g} class-parallel subnets",
                         s["backend"], rep, original_compute_ms if single else subnet_ms))
    for key, p in peers.items():
        rep = p.get("transports", {}).get(PEER_TRANSPORT)
        if rep is not None:
            pool = (f"{p['triton_backend']} backend" if p.get("triton_backend")
                    else "1 replica")
            rows.append(_row(key, p["label"], "original model", pool, rep, original_compute_ms))
    triton = next((r["p50_ms"] for r in rows if r["key"] == "triton"), None)
    for r in rows:
        r["triton_p50_over_p50"] = (round(triton / r["p50_ms"], 3)
                                    if triton and r["p50_ms"] else None)
    return {"title": TITLE, "transport": PEER_TRANSPORT,
            "compute_alone_ms": {"original": original_compute_ms, "slowest_subnet": subnet_ms},
            "rows": rows,
            "skipped": {k: p["skipped"] for k, p in peers.items() if "skipped" in p}}
