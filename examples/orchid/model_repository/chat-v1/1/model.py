"""Triton entry point: the Orchid capacity emulator (see examples/orchid/emulator)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "emulator"))

from orchid_emulator import BatchEmulator as TritonPythonModel  # noqa: F401
