"""orchid-gateway: an admission gateway for model serving in front of NVIDIA Triton.

The package is split into a decision core that performs no I/O (``record``,
``profile``, ``shape``, ``admission``, ``policy``, ``capacity``) and two edges
that do: the gRPC protocol edge (``protocol``) and the Triton backend edge
(``backends``). ``server`` wires them together; ``cli`` is the command line.
"""

__version__ = "0.1.0"
