"""The benchmark harness: ``sensai bench`` (latency of class parallelism against single device,
model parallel and data parallel) and ``sensai bench-robust`` (redundancy under faults).

Written once, on the predictor ``sensai serve`` builds; one responsibility per module:

* :mod:`.latency` - ``sensai bench``: :func:`~.latency.run_bench`;
* :mod:`.robust` - ``sensai bench-robust``: :func:`~.robust.run_robust_bench`;
* :mod:`.harness` - what both share: test images, drivers (in process, HTTP), warm-up,
  interleaved rounds, throughput, the result envelope and the writers;
* :mod:`.strategies` - how ``sensai bench`` builds each strategy (and what it costs);
* :mod:`.baselines` - single device, model parallel and data parallel on thread workers;
* :mod:`.peers` - the systems a user would pick instead (``--peers``): the original model on
  Triton and on plain Ray Serve (:mod:`.ray_serve_peer`); :mod:`.comparison` - their table
  beside sensai's;
* :mod:`.targets` - the declarative targets, per model;
* :mod:`.accuracy` - the artifact's recorded accuracy and shrink, reported beside the latencies;
* :mod:`.latency_report`, :mod:`.robust_report`, :mod:`.render` - markdown, tables and plots;
* :mod:`.stats`, :mod:`.machine` - percentiles, latency split, machine and memory figures;
* :mod:`.client` - the HTTP client, in its own process;
* :mod:`.names` - the vocabulary (strategies, transports, backends, scenarios, labels).

Nothing is imported here: the client's spawned process imports this package, and must stay
light.  A script calling :func:`~.latency.run_bench` needs the usual
``if __name__ == "__main__":`` guard (the client is a spawned process).
"""
