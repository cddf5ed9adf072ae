"""The benchmark's vocabulary (no dependencies, so the CLI's ``--help`` stays fast)."""

STRATEGIES = ("single", "model-parallel", "class-parallel", "data-parallel")
# inprocess: the predictor called directly; http: a PNG upload to /v1/predict; http-v2: a KServe
# v2 binary tensor over HTTP; grpc: KServe v2 over gRPC (raw tensor contents).
TRANSPORTS = ("inprocess", "http", "http-v2", "grpc")
TRANSPORT_LABELS = {"inprocess": "in process", "http": "HTTP, PNG upload",
                    "http-v2": "HTTP, KServe v2 binary tensor", "grpc": "gRPC, KServe v2"}
# The bare request each remote transport's client also times on the same server: its floor.
BARE_REQUESTS = {"http": "GET /v2/health/live", "http-v2": "GET /v2/health/live",
                 "grpc": "ServerLive"}
LABELS = {"single": "single device", "model-parallel": "model parallel",
          "class-parallel": "class parallel (sensAI)", "data-parallel": "data parallel"}
# Where the class-parallel predictor's workers run (``build_predictor``'s backends; Triton needs
# a server of its own and cannot host redundant copies or be fault-injected).
BACKENDS = ("local", "processes", "ray")
# ``sensai bench`` may also run class parallel on a tritonserver it starts (one Triton model per
# subnet), as the Ray Serve application (``sensai serve --backend ray-serve``, started by the
# run), and on several backends in one run: the first backend's strategy is "class-parallel",
# each other one's "class-parallel@<backend>".
BENCH_BACKENDS = (*BACKENDS, "triton", "ray-serve")
# ``sensai bench-robust`` may also run each configuration as the Ray Serve application.
ROBUST_BACKENDS = (*BACKENDS, "ray-serve")
# The backends whose class parallel is `sensai serve ART --backend B` itself, a server of its
# own (not a predictor the benchmark could build in its process), and the transports it cannot
# be timed over, with why (bench.json says so).
UNTIMED_TRANSPORTS = {"ray-serve": {
    "inprocess": "the predictor lives in the Serve ingress replica, not in the benchmark's "
                 "process",
    "grpc": "the Serve application's ingress serves HTTP only; it has no gRPC server"},
    "processes": {
    "inprocess": "the predictor lives in the gateway process of 'sensai serve --backend "
                 "processes' (over its device processes), not in the benchmark's process",
    "grpc": "the run starts that server without a gRPC port"}}
# The systems a user would pick instead, serving the original model, each started by the run
# and measured over PEER_TRANSPORT (the one request all of them take) beside the strategies.
PEERS = ("triton", "ray-serve")
PEER_LABELS = {"triton": "Triton Inference Server", "ray-serve": "Ray Serve"}
PEER_TRANSPORT = "http-v2"
# Untimed requests (per strategy and transport, per configuration; `sensai predict --repeat`'s
# first) before the timed ones: after a start the kernel can keep the workers of a request on one
# core for the first tens of requests before their placement settles.
WARMUP = 50
# node-loss: the victim worker's whole Ray node is killed (Ray backend, a node of this machine).
SCENARIOS = ("none", "straggler", "failure", "node-loss")
OUTAGES = ("failure", "node-loss")  # scenarios that end something, one configuration at a time
DEFAULT_SCENARIOS = ("none", "straggler", "failure")


def strategy_key(backend: str, first: bool) -> str:
    """The key of class parallel on ``backend``: the first backend's is "class-parallel"."""
    return "class-parallel" if first else f"class-parallel@{backend}"


def label(key: str) -> str:
    """A strategy's label; class parallel on a further backend names its pool."""
    base, _, backend = key.partition("@")
    return f"class parallel (sensAI, {backend} pool)" if backend else LABELS[base]

# ``sensai bench-load --sweep``: the configurations it compares (the artifact with and without
# the workers' batching, the original model behind the same gateway, the original on Triton),
# the requests in flight of its closed loops, its transports, and its per-configuration warm-up
# and overload seconds.
SWEEP_DEFAULT_CONFIGS = ("class-parallel", "class-parallel-unbatched", "single", "triton")
SWEEP_CONFIGS = SWEEP_DEFAULT_CONFIGS
SWEEP_LEVELS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_TRANSPORTS = ("http", "http-v2")
SWEEP_WARMUP_S = 3.0
SWEEP_OVERLOAD_S = 10.0
