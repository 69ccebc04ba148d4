"""Build step: compile ``proto/`` into ``gateway/_proto/`` before the package is built.

Everything else about the package is declared in ``pyproject.toml``; this file only hooks
``build_py`` so that every build - a wheel, and ``pip install -e .`` as
``scripts/bootstrap.sh`` runs it - first generates the Python modules of the gateway's own
protos with grpcio-tools (a build requirement). The checked-in ``.proto`` stays the only
source of truth: the generated ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` are
ignored by git, ruff and mypy's file discovery, and are rewritten only when they change.

They are generated into the source tree, so an editable install imports them from there.
protoc names its modules after the proto's package path (``orchid.admin.v1``); the one
import the gRPC module makes of its messages is rewritten to ``gateway._proto``, while the
descriptors keep their proto file names (``orchid/admin/v1/admin.proto``) for reflection.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "gateway" / "_proto"
PROTOS = ("orchid/admin/v1/admin.proto", "orchid/jobs/v1/jobs.proto")


def generate_protos() -> list[Path]:
    """Generate every proto in ``PROTOS`` into ``OUT``; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).resolve().parent / "_proto"
    OUT.mkdir(exist_ok=True)
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        for proto in PROTOS:
            status = protoc.main(
                [
                    "grpc_tools.protoc",
                    f"-I{PROTO_ROOT}",
                    f"-I{well_known}",
                    f"--python_out={tmp}",
                    f"--pyi_out={tmp}",
                    f"--grpc_python_out={tmp}",
                    proto,
                ]
            )
            if status != 0:
                raise RuntimeError(f"protoc failed on {PROTO_ROOT / proto} (exit {status})")
            package = proto.rsplit("/", 1)[0].replace("/", ".")
            stem = Path(proto).stem
            for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
                source = Path(tmp) / Path(proto).parent / f"{stem}{suffix}"
                text = source.read_text(encoding="utf-8").replace(
                    f"from {package} import {stem}_pb2 as", f"from gateway._proto import {stem}_pb2 as"
                )
                target = OUT / f"{stem}{suffix}"
                if not target.exists() or target.read_text(encoding="utf-8") != text:
                    target.write_text(text, encoding="utf-8")
                    written.append(target)
    return written


class BuildWithProtos(build_py):
    """``build_py`` that generates ``gateway/_proto`` first."""

    def run(self) -> None:
        for path in generate_protos():
            print(f"generated {path.relative_to(ROOT)}")
        super().run()


setup(cmdclass={"build_py": BuildWithProtos})
