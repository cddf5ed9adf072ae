"""The options of the bench commands (``sensai bench``, ``bench-robust``, ``bench-load``,
``bench-swap`` and ``plan``), each declared once, as a field of the frozen dataclass its run
function takes; ``sensai.cli`` builds the commands' flags from the same fields.

A field made by :func:`flag` is a flag of its command's ``--help``: a decision (what to run,
against what, how hard).  One made by :func:`knob` is a key of the command's ``--set KEY=VALUE``
(phase timings, scenario details).  A plain field is the command's own to fill in (the command
line that reproduces the run, the gateway's environment).  Light on purpose: building a
command's parser imports this module, and nothing heavy.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any

from sensai.bounds import BOUND_KEYS, SEED, bounded
from sensai.serving.core.settings import BACKENDS as SERVE_BACKENDS
from sensai.serving.core.settings import MODEL_RUNTIMES, GatewaySettings
from sensai.serving.core.wakeup import MODES

from .names import (BENCH_BACKENDS, DEFAULT_SCENARIOS, PEER_TRANSPORT, PEERS, ROBUST_BACKENDS,
                    SCENARIOS, STRATEGIES, SWEEP_CONFIGS, SWEEP_DEFAULT_CONFIGS, SWEEP_LEVELS,
                    SWEEP_OVERLOAD_S, SWEEP_TRANSPORTS, SWEEP_WARMUP_S, TRANSPORTS, WARMUP)

SOAK_WARMUP_S = 30.0
SOAK_OVERLOAD_S = 60.0
SEARCHES = ("quick", "full")
PLAN_LEVELS = (1, 4, 16)
PLAN_LEVEL_S = 2.0
PLAN_WARMUP_S = 1.0
# The most requests a benchmark keeps in flight: each holds a connection, as many as the
# gateway holds by default, and a mistyped count must not become a billion callers.
MAX_IN_FLIGHT = GatewaySettings.model_fields["max_connections"].default


def flag(*names: str, default: Any = None, help: str, group: str | None = None,
         **argparse: Any) -> Any:
    """A field that is a flag: its option strings ``names`` (none: ``--`` and the field's name),
    its meaning ``help`` (the default is added to it unless None or False, so a help whose
    default is None says what None does), the argument group it is listed in, its values'
    bound (``low``, ``above``, ``high``, ``below``: a :class:`~sensai.bounds.Bound`; each value
    of a tuple), and what argparse needs beyond the field's type (``nargs``, ``const``,
    ``choices``, ``metavar``)."""
    bound = {k: argparse.pop(k) for k in BOUND_KEYS if k in argparse}
    return field(default=default, metadata={"help": help, "flag": names, "group": group,
                                            **argparse, **bounded(**bound)})


def knob(default: Any, help: str, choices: tuple | None = None, **bound: float) -> Any:
    """A field that is a ``--set`` key (its name), with its meaning and allowed values: one of
    ``choices``, or within ``bound`` (as for :func:`flag`)."""
    return field(default=default, metadata={"help": help, "choices": choices, "set": True,
                                            **bounded(**bound)})


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


@dataclass(frozen=True)
class BenchData:
    """What every bench command shares: the real test images it sends, the command line that
    reproduces the run (recorded in its JSON), and whether a progress bar and the phases' lines
    show (by default when stderr is a terminal, so a log or a test gets neither)."""

    images: int = flag(default=200, group="test images", low=1,
                       help="real test images, sent in turn (a stratified sample: at least "
                            "one of each class)")
    data_dir: str | None = flag(default=None, group="test images",
                                help="where the dataset is (default: as the artifact records)")
    seed: int = knob(0, "which test images", low=SEED.low, high=SEED.high)
    command: str | None = None
    progress: bool = field(default_factory=stderr_is_terminal)


@dataclass(frozen=True)
class Workers:
    """Where and how the class-parallel workers run, as for ``sensai serve``."""

    ray_address: str | None = flag(
        help="with --backend ray (or ray-serve): the Ray cluster to run the workers on "
             "(default: RAY_ADDRESS, else a local instance); each worker's node is reported")
    device: str = flag(default="auto",
                       help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    runtime: str = flag(default="auto", choices=MODEL_RUNTIMES,
                        help="auto: ONNX Runtime on CPUs, CUDA graphs on GPUs (torch eager where "
                             "a network cannot be captured); torch: eager")
    threads: int = knob(1, "intra-op threads of every worker's runner", low=1)


@dataclass(frozen=True)
class BenchOptions(Workers, BenchData):
    """``sensai bench``: the strategies, transports, class-parallel backends and peers, how hard
    each is driven, and the host switches held for the whole run."""

    workers: int | None = flag(
        "--stages", "-K", metavar="K", low=1,
        help="model-parallel stages, one worker each (default: G, as many as subnets)")
    concurrency: int = flag("--concurrency", "-c", default=8, low=1, high=MAX_IN_FLIGHT,
                            help="requests in flight for the throughput run")
    requests: int | None = flag(
        low=1, help="requests in the throughput run (default: max(images, 4 x concurrency))")
    strategies: tuple[str, ...] = flag(
        default=STRATEGIES, nargs="+", choices=STRATEGIES, metavar="STRATEGY",
        help=f"which to run, of {', '.join(STRATEGIES)}")
    transports: tuple[str, ...] = flag(
        default=TRANSPORTS, nargs="+", choices=TRANSPORTS, metavar="TRANSPORT",
        help=f"how to call each strategy, of {', '.join(TRANSPORTS)}: in process, PNG upload to "
             "/v1/predict, KServe v2 binary tensor over HTTP, KServe v2 over gRPC")
    backends: tuple[str, ...] = flag(
        "--backend", default=("local",), nargs="+", choices=BENCH_BACKENDS, metavar="BACKEND",
        help=f"where class parallel's workers run, as for 'sensai serve', of "
             f"{', '.join(BENCH_BACKENDS)} (triton: a tritonserver the run starts; ray-serve and "
             "processes: 'sensai serve --backend B' the run starts, timed over http and http-v2 "
             "on its own port); several: class parallel on each, in the same run (local: worker "
             "threads; the baselines always run on threads)")
    peers: tuple[str, ...] = flag(
        default=(), nargs="+", choices=PEERS, metavar="PEER",
        help=f"also serve the original model with {' and '.join(PEERS)} (Triton Inference "
             "Server, plain Ray Serve), started and stopped by the run, and time them over "
             f"{PEER_TRANSPORT} beside the strategies: bench.md's 'sensai vs Triton vs Ray "
             "Serve' table; a peer that cannot run here is skipped with its reason (default: "
             "none)")
    replicas: int | None = knob(None, "data-parallel replicas (none: the number of stages)",
                                low=1)
    warmup: int = knob(WARMUP, "untimed requests per strategy and transport first, while the "
                               "workers' placement on the cores settles", low=0)
    rounds: int = knob(10, "the images are timed in this many rounds, strategies taking turns, "
                           "so load changes hit them alike", low=1)
    isolated_images: int = knob(20, "images on which each subnet (and, with peers, the original) "
                                    "is also timed alone", low=0)
    keep_cores_awake: str | None = knob(
        None, "as for 'sensai serve', held for the whole run so every strategy and peer is "
              "timed alike (none: the gateway's setting, off unless SENSAI_KEEP_CORES_AWAKE)",
        choices=MODES)
    spread_cores: bool = knob(False, "as for 'sensai serve': class parallel's local worker "
                                     "threads are moved apart when two share a core")

    @property
    def n_requests(self) -> int:
        """The throughput run's requests."""
        return self.requests or max(self.images, 4 * self.concurrency)

    @property
    def needs_original(self) -> bool:
        return any(s != "class-parallel" for s in self.strategies) or bool(self.peers)

    def canonical(self) -> BenchOptions:
        """The strategies, transports and peers in canonical order, each once."""
        return replace(self, strategies=tuple(s for s in STRATEGIES if s in self.strategies),
                       transports=tuple(t for t in TRANSPORTS if t in self.transports),
                       backends=tuple(self.backends), peers=tuple(p for p in PEERS
                                                                  if p in self.peers))


@dataclass(frozen=True)
class RobustOptions(Workers, BenchData):
    """``sensai bench-robust``: the configurations (redundancy x hedge), the scenarios, how each
    configuration is served, and how the faults are run."""

    # A failure needs a request before the kill and one after it.
    images: int = flag(default=200, group="test images", low=2,
                       help="real test images, sent in turn (at least 2)")
    redundancies: tuple[int, ...] = flag("--redundancy", "-r", default=(0, 1), nargs="+",
                                         metavar="R", low=0, help="redundancies to compare")
    hedges_ms: tuple[float, ...] = flag(
        "--hedge-ms", default=(0.0,), nargs="+", metavar="MS", low=0,
        help="for r >= 1, also one configuration per hedge delay")
    scenarios: tuple[str, ...] | None = flag(
        nargs="+", choices=SCENARIOS, metavar="SCENARIO",
        help=f"of {', '.join(SCENARIOS)} (default: {' '.join(DEFAULT_SCENARIOS)}, those the "
             "backend takes; node-loss kills the victim's node (its raylet and the processes it "
             "started): --backend ray on a cluster of this machine's nodes, one configuration)")
    backend: str = flag(
        default="local", choices=ROBUST_BACKENDS,
        help="where the workers run: local (threads, the default serving path), processes, "
             "ray, or ray-serve (each configuration the Ray Serve application the run starts in "
             "turn, called over HTTP with requests always in flight; scenarios none and "
             "failure)")
    vote: bool = knob(False, "vote mode: 2r+1 copies, the majority answers")
    deadline_s: float | None = knob(None, "per-request deadline in seconds (none: the "
                                          "gateway's, 5, or $SENSAI_DEADLINE_S)")
    restart_delay_s: float = knob(0.0, "seconds before the dead worker is restarted")
    warmup: int = knob(WARMUP, "untimed requests per configuration", low=0)
    rounds: int = knob(5, "none/straggler runs interleave the configurations in this many "
                          "rounds", low=1)
    delay: str = knob("exp:50ms", "the straggler's delay before each request: fixed:50ms, "
                                  "exp:20ms (mean), uniform:10ms-80ms, optionally @p for a "
                                  "fraction")
    straggler: int = knob(0, "worker to delay", low=0)
    victim: int = knob(1, "worker to kill", low=0)
    kill_at: float = knob(0.3, "kill during this fraction of the run", low=0,
                          below=1)
    interval_ms: float = knob(10.0, "failure scenario: one request every this many ms", low=0)
    rejoin_timeout_s: float = knob(120.0, "seconds the killed worker's rejoin is waited for",
                                   above=0)


@dataclass(frozen=True)
class Served(BenchData):
    """What a command that starts ``sensai serve`` in a process of its own shares."""

    backend: str | None = flag(
        choices=SERVE_BACKENDS,
        help="the gateway's backend, as for 'sensai serve' (default: local, or $SENSAI_BACKEND)")
    startup_timeout: float = knob(180.0, "seconds the gateway may take to become ready",
                                  above=0)


@dataclass(frozen=True)
class LoadOptions(Served):
    """What ``sensai bench-load``'s soak, its sweep and ``sensai plan`` share: the gateway's
    settings (``backend``, ``deadline_s`` and ``env``, ``SENSAI_*``; unset ones from this
    environment as for ``sensai serve``), the client processes sharing the load and where they
    run, and how the overload is offered."""

    deadline_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    clients: int = knob(2, "client processes sharing the load", low=1)
    client_cores: int = knob(0, "the client processes on the last this many usable cores, the "
                                "gateway and every process it starts on the others (taskset); "
                                "0: both anywhere", low=0)
    overload_factor: float = knob(4.0, "the overload's arrival rate in multiples of the soak's "
                                       "throughput (with --sweep: of the best closed loop's)",
                                  above=0)
    retry_after: bool = knob(True, "the overload's clients honour a 503's Retry-After, as polite "
                                   "clients do: each waits that long before it sends again on "
                                   "that connection, and the rate then offered is reported "
                                   "beside the rate asked (false: they send again at once)")


@dataclass(frozen=True)
class LoadPlan:
    """``sensai bench-load``'s phases: the soak's (a closed loop, the overload, the burst of
    the largest legal image) or, with ``sweep``, the sweep's (configurations at levels in
    flight).  The warm-up and overload seconds default to the soak's or the sweep's
    (:meth:`resolved`)."""

    sweep: bool = flag(
        group="sweep",
        help="instead of the soak, a throughput-latency sweep of several configurations, each "
             "started in turn: closed loops at each of --levels in flight, the server's bare "
             "GET /v2/health/live at 16 in flight, then an overload; the same client processes "
             "for all (their own CPU reported per level). load.png: p99 latency against "
             "throughput, one line per configuration")
    configs: tuple[str, ...] = flag(
        default=SWEEP_DEFAULT_CONFIGS, nargs="+", choices=SWEEP_CONFIGS, metavar="CONFIG",
        group="sweep",
        help=f"of {', '.join(SWEEP_CONFIGS)}: the artifact with batching, without "
             "(SENSAI_BATCH_MAX_ROWS=1), the original model behind the same gateway, the "
             "original on Triton with its dynamic batcher (skipped with the reason where it "
             "cannot run)")
    levels: tuple[int, ...] = flag(default=SWEEP_LEVELS, nargs="+", metavar="N", group="sweep",
                                   low=1, high=MAX_IN_FLIGHT,
                                   help="requests in flight of each closed loop")
    transport: str | None = flag(
        choices=SWEEP_TRANSPORTS, group="sweep",
        help="http: PNG uploads to /v1/predict; http-v2: KServe v2 binary tensors; one for "
             "every configuration (default: http-v2 when triton runs, which takes only "
             "tensors, else http)")
    perf_analyzer: str | None = flag(
        nargs="?", const="also", choices=("also", "only"), group="sweep",
        help="also (the default when given alone) or only: drive every configuration with "
             "NVIDIA's perf_analyzer (where it is on PATH) at each of --levels, KServe v2 over "
             "HTTP with --input-data of the same test images (perf-data.json in --out), three "
             "level_seconds/3 windows a level; its CSV's rows (p50/p90/p99, infer/s, the "
             "server's queue and compute) beside bench-load's own, labelled perf_analyzer. Not "
             "on PATH: also: a warning and the rest runs; only: refused")
    concurrency: int = flag("--concurrency", "-c", default=16, low=1, high=MAX_IN_FLIGHT,
                            help="the soak (and its warm-up): requests always in flight")
    warmup_seconds: float | None = knob(
        None, f"warm-up, not counted (none: {SOAK_WARMUP_S:g} at the soak's concurrency; with "
              f"--sweep {SWEEP_WARMUP_S:g} per configuration, at 16 in flight)", low=0)
    soak_seconds: float = knob(600.0, "the soak's duration", above=0)
    overload_seconds: float | None = knob(
        None, f"the overload's duration (none: {SOAK_OVERLOAD_S:g}; with --sweep "
              f"{SWEEP_OVERLOAD_S:g} per configuration, 0 to skip it)", low=0)
    overload_rate: float | None = knob(None, "the overload's arrival rate in requests/s (none: "
                                             "overload_factor x the soak's throughput, or the "
                                             "best closed loop's)", above=0)
    overload_connections: int | None = knob(
        None, "connections the overload may use (none: the gateway's max_requests + "
              "concurrency; with retry_after=false, enough for every request to wait its "
              "deadline)", low=1)
    burst_seconds: float = knob(20.0, "after the overload, uploads of one large legal image (as "
                                      "large as the gateway's pixel and decoded-bytes limits "
                                      "allow) for this long, to report the gateway's peak "
                                      "memory; 0: skip", low=0)
    burst_concurrency: int = knob(32, "large uploads in flight during the burst", low=1,
                                  high=MAX_IN_FLIGHT)
    sample_seconds: float = knob(5.0, "RSS sampling period, and the bins of the timelines",
                                 above=0)
    level_seconds: float = knob(5.0, "--sweep: seconds of each closed loop", above=0)
    bare_route: bool = True  # the sweep's bare GET /v2/health/live (sensai plan: none)

    def resolved(self) -> LoadPlan:
        """The warm-up and overload seconds where not given: the sweep's or the soak's."""
        sweep = (SWEEP_WARMUP_S, SWEEP_OVERLOAD_S) if self.sweep else (SOAK_WARMUP_S,
                                                                       SOAK_OVERLOAD_S)
        return replace(self, warmup_seconds=sweep[0] if self.warmup_seconds is None
                       else self.warmup_seconds, overload_seconds=sweep[1]
                       if self.overload_seconds is None else self.overload_seconds)


@dataclass(frozen=True)
class SwapOptions(Served):
    """``sensai bench-swap``: the model's name in the repository, the swaps, the closed loop and
    its phases, and the timeouts."""

    model: str | None = flag(
        help="the model's name in the repository (default: ARTIFACT_A's model)")
    swaps: int = flag(default=5, low=1, high=1000, help="versions swapped in")
    concurrency: int = flag("--concurrency", "-c", default=8, low=1, high=MAX_IN_FLIGHT,
                            help="requests always in flight")
    warmup_seconds: float = knob(5.0, "load before the steady state, not counted", low=0)
    steady_seconds: float = knob(10.0, "steady state before the first swap: the latency to "
                                       "compare with", above=0)
    after_seconds: float = knob(10.0, "wait after each swap's load call returned", low=0)
    sample_seconds: float = knob(0.5, "RSS sampling period", above=0)
    load_timeout: float = knob(600.0, "seconds a load call may take", above=0)
    keep_repo: bool = knob(False, "keep the model repository written in the output directory "
                                  "(false: removed at the end)")

    def longest_s(self) -> float:
        """The closed loop is stopped when the last swap's wait is over; until then, it runs
        as long as the longest run the settings allow."""
        return (self.warmup_seconds + self.steady_seconds
                + self.swaps * (self.after_seconds + self.load_timeout + 60.0) + 60.0)


@dataclass(frozen=True)
class PlanOptions:
    """``sensai plan``'s search and how each candidate is measured."""

    search: str = flag(default="quick", choices=SEARCHES,
                       help="quick: defaults, climb, confirm (minutes); full: every "
                            "combination, then confirm")
    levels: tuple[int, ...] = flag(default=PLAN_LEVELS, nargs="+", metavar="N", low=1,
                                   high=MAX_IN_FLIGHT,
                                   help="requests in flight of each closed loop, the first the "
                                        "one-image latency")
    transport: str = flag(default="http-v2", choices=SWEEP_TRANSPORTS,
                          help="http: PNG uploads; http-v2: KServe v2 binary tensors")
    level_seconds: float = knob(PLAN_LEVEL_S, "seconds of each level while searching; "
                                              "confirming runs three times as long",
                                  above=0)
    warmup_seconds: float = knob(PLAN_WARMUP_S, "warm-up of each deployment, not counted",
                                 low=0)
