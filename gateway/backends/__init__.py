"""The backend edge: everything that talks to Triton Inference Server.

``triton`` is the gRPC client side (inference, metadata, readiness, statistics);
``local`` supervises an embedded Triton process from the nvidia-pytriton wheel.
Nothing outside this package opens a connection to a backend.
"""
