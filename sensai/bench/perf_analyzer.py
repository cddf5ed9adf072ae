"""NVIDIA's perf_analyzer (Triton's benchmarking client) against sensai's KServe v2 endpoints.

perf_analyzer's default input is random bits, which the gateway refuses (NaN or infinite
values), and zeros are no image the model was trained on; so :func:`write_perf_data` writes
its real-input-data file (``--input-data FILE.json``) of real test images, normalized as the
gateway expects its ``input`` tensor.  :class:`PerfAnalyzer` runs it at concurrency levels
against a server on 127.0.0.1 and reads its CSV report back, for ``sensai bench-load --sweep
--perf-analyzer``.  perf_analyzer is a tool of the machine (on PATH), never a dependency.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from sensai.artifact import load_artifact
from sensai.data import load_split, normalize, resolve_dataset
from sensai.errors import SensaiError
from sensai.fsutil import write_text_atomic
from sensai.manifest import MANIFEST, MODEL_RECORD, load_model_record
from sensai.serving.gateway.oip import INPUT_NAME
from sensai.spec import DatasetSpec

TOOL = "perf_analyzer"
DEFAULT_COUNT = 16
# perf_analyzer's CSV columns (-f, --verbose-csv) as load.json names them; latencies in us.
COLUMNS = {"Concurrency": "concurrency", "Inferences/Second": "throughput_infer_per_s",
           "p50 latency": "p50_us", "p90 latency": "p90_us", "p95 latency": "p95_us",
           "p99 latency": "p99_us", "Avg latency": "avg_us", "Client Send": "client_send_us",
           "Network+Server Send/Recv": "network_server_send_recv_us",
           "Server Queue": "server_queue_us", "Server Compute Input": "server_compute_input_us",
           "Server Compute Infer": "server_compute_infer_us",
           "Server Compute Output": "server_compute_output_us", "Client Recv": "client_recv_us"}

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The input data


def dataset_of(source: str | Path, data_dir: str | None = None) -> DatasetSpec:
    """The dataset an artifact (its manifest) or a trained model (its record) was made on,
    checked to be where it says (or at ``data_dir``)."""
    root = Path(source)
    if (root / MANIFEST).is_file():
        spec = load_artifact(root).spec
    elif (root / MODEL_RECORD).is_file():
        spec = load_model_record(root).dataset.to_spec()
    else:
        raise SensaiError(f"{root} is neither an artifact ({MANIFEST}, from 'sensai decompose') "
                          f"nor a trained model ({MODEL_RECORD}, from 'sensai train')")
    spec = spec.with_data_dir(data_dir)
    resolve_dataset(spec.name, spec.data_dir, spec.input_shape[1])
    return spec


def pick_test_images(spec: DatasetSpec, count: int, seed: int) -> list[np.ndarray]:
    """``count`` test images picked at random by ``seed`` (exactly that many: a stratified pick
    rounds small counts), each normalized ``[1, C, H, W]`` as the gateway normalizes an
    upload."""
    test = load_split(spec, "test")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(test):
        raise SensaiError(f"--count must be an integer from 1 to {len(test)} (the test split's "
                          f"images), got {count!r}")
    idx = np.sort(np.random.default_rng(seed).choice(len(test), size=count, replace=False))
    u8 = torch.stack([test[int(i)][0] for i in idx])
    return [normalize(u8[i:i + 1], spec).numpy() for i in range(count)]


def perf_data(xs: Sequence[np.ndarray]) -> dict[str, Any]:
    """perf_analyzer's real input data: one entry per image, sent in turn.  Its shape leaves out
    the batch dimension, as the model's configuration does (``max_batch_size`` > 0), so ``-b N``
    works too; float32 values as float64 decimals, which read back to the very same float32."""
    return {"data": [{INPUT_NAME: {"content": x.astype(np.float64).ravel().tolist(),
                                   "shape": list(x.shape[1:])}} for x in xs]}


def write_perf_data(path: str | Path, xs: Sequence[np.ndarray]) -> Path:
    path = Path(path)
    try:
        write_text_atomic(path, json.dumps(perf_data(xs), separators=(",", ":")) + "\n")
    except OSError as e:
        raise SensaiError(f"cannot write {path}: {e.strerror or e}") from None
    return path


# --------------------------------------------------------------------------------------------
# Running it


def find() -> str | None:
    """perf_analyzer on PATH, or beside this Python (where ``deploy/setup.sh`` puts it, in the
    environment's bin, which a user who runs ``.venv/bin/sensai`` need not have on PATH)."""
    return shutil.which(TOOL, path=os.pathsep.join(
        (os.environ.get("PATH", os.defpath), str(Path(sys.executable).parent))))


def missing() -> str | None:
    """Why perf_analyzer cannot run here (None: it can)."""
    if find() is None:
        return (f"{TOOL} is neither on PATH nor beside {sys.executable} (NVIDIA's Triton "
                "client tool, PyPI 'perf-analyzer' >= 2.50, which needs glibc 2.38; "
                "deploy/setup.sh unpacks it into .venv)")
    return None


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """perf_analyzer's ``-f`` report: one row per concurrency, numbers under load.json's names
    (the server-side columns when the server has the statistics extension)."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        rec: dict[str, Any] = {}
        for name, value in row.items():
            if name is None or value in (None, ""):
                continue
            key = COLUMNS.get(name.strip()) or re.sub(r"\W+", "_", name.strip().lower()).strip("_")
            try:
                rec[key] = int(value) if key == "concurrency" else float(value)
            except ValueError:
                rec[key] = value
        out.append(rec)
    return out


def failure(output: str, rc: int) -> str:
    """perf_analyzer's own reason for a failed run, in one line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    # "Thread [0] had error: <the server's message>" says more than the "Failed to ..." before it.
    said = ([ln for ln in lines if "error" in ln.lower()]
            or [ln for ln in lines if ln.startswith("Failed")])
    return (said or lines or [f"exit status {rc}"])[0][:300]


@dataclass(frozen=True)
class PerfAnalyzer:
    """perf_analyzer over HTTP KServe v2 with ``data`` as its input, three stabilizing windows
    of ``window_ms`` per level: ``--stability-percentage 100`` takes them whatever their spread,
    so a level lasts as long as bench-load's own (a busy 2-core machine often misses
    perf_analyzer's default 10 %, and it then reports nothing); its CSVs go to ``out``."""

    data: Path
    window_ms: int
    out: Path
    binary: str | None = None  # None: :func:`find`'s

    def command(self, url: str, model: str, concurrency: int, csv_path: Path) -> list[str]:
        return [self.binary or find() or TOOL, "-m", model, "-u", url.split("://", 1)[-1],
                "-i", "http", "--input-data", str(self.data), "--concurrency-range",
                f"{concurrency}:{concurrency}", "--measurement-mode", "time_windows",
                "--measurement-interval", str(self.window_ms), "--stability-percentage", "100",
                "-f", str(csv_path), "--verbose-csv"]

    def level(self, url: str, model: str, concurrency: int, name: str) -> dict[str, Any]:
        """One run at ``concurrency`` in flight: its CSV row, or the error it gave."""
        csv_path = self.out / f"perf_analyzer-{name}-c{concurrency}.csv"
        csv_path.unlink(missing_ok=True)
        cmd = self.command(url, model, concurrency, csv_path)
        row: dict[str, Any] = {"concurrency": concurrency, "command": shlex.join(cmd)}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=self.window_ms * 12 / 1e3 + 30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return row | {"error": f"{TOOL}: {e}"}
        rows = read_csv(csv_path) if proc.returncode == 0 and csv_path.is_file() else []
        if not rows:
            return row | {"error": failure(proc.stdout + proc.stderr, proc.returncode)}
        return row | rows[0] | {"csv": str(csv_path)}


def for_sweep(mode: str | None, xs: Sequence[np.ndarray], out: Path, level_s: float
              ) -> PerfAnalyzer | None:
    """perf_analyzer for ``sensai bench-load --sweep --perf-analyzer MODE`` (None when not asked
    for, or not on PATH: a warning, and the sweep runs without it): its input the sweep's own
    test images (``out/perf-data.json``), its three windows a level's time."""
    if mode is None:
        return None
    reason = missing()
    if reason:
        log.warning("--perf-analyzer: %s; the sweep runs without it", reason)
        return None
    data = write_perf_data(out / "perf-data.json", xs)
    return PerfAnalyzer(data, window_ms=max(100, round(level_s * 1e3 / 3)), out=out)


def sweep_settings(mode: str | None, perf: PerfAnalyzer | None) -> dict[str, Any] | None:
    """What load.json's settings say of perf_analyzer."""
    if mode is None:
        return None
    if perf is None:
        return {"mode": mode, "skipped": missing()}
    return {"mode": mode, "input_data": str(perf.data), "window_ms": perf.window_ms,
            "transport": "http-v2 (KServe v2 binary tensors)"}
