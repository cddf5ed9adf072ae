"""The benchmark's vocabulary (no dependencies, so the CLI's ``--help`` stays fast)."""

STRATEGIES = ("single", "model-parallel", "class-parallel", "data-parallel")
TRANSPORTS = ("inprocess", "http")
LABELS = {"single": "single device", "model-parallel": "model parallel",
          "class-parallel": "class parallel (sensAI)", "data-parallel": "data parallel"}
# Where the class-parallel predictor's workers run (``build_predictor``'s backends; Triton needs
# a server of its own and cannot host redundant copies or be fault-injected).
BACKENDS = ("local", "processes", "ray")
SCENARIOS = ("none", "straggler", "failure")
