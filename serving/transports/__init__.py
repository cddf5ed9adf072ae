"""Transports: how the predictor reaches its workers (threads, processes, Ray actors, Ray Serve
replicas, a Triton server).  They are interchangeable behind :class:`.base.Transport`."""
