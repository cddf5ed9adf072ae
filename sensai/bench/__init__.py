"""The benchmark harness: ``sensai bench`` (:mod:`.latency`: class parallelism against single
device, model parallel and data parallel, and ``--peers``: the original model on Triton and Ray
Serve), ``sensai bench-robust`` (:mod:`.robust`: redundancy under faults), ``sensai
bench-load`` (:mod:`.load_run`: the soak and overload of a gateway process, or with ``--sweep``
a throughput-latency sweep), ``sensai bench-swap`` (:mod:`.swap`) and ``sensai plan``
(:mod:`.plan`).  :mod:`.options` declares their options, :mod:`.harness` holds what they share;
:mod:`.server` starts every server they measure, :mod:`.load`'s ``LoadRun`` drives every load
phase, :mod:`.client` is the HTTP/gRPC client, in its own process, :mod:`.render` renders every
report, and :mod:`.names` is the vocabulary.

Nothing is imported here: the client's spawned process imports this package, and must stay
light.  A script calling a benchmark needs the usual ``if __name__ == "__main__":`` guard.
"""
