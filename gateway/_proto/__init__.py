"""Python modules generated from ``proto/`` at build time (``setup.py``); never edited by hand.

``pip install -e .`` (``scripts/bootstrap.sh``) writes ``admin_pb2.py``, ``admin_pb2.pyi`` and
``admin_pb2_grpc.py`` here from ``proto/orchid/admin/v1/admin.proto``. git, ruff and mypy's file
discovery ignore them; after editing a ``.proto``, run ``scripts/bootstrap.sh`` again.
"""
