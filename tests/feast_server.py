"""A real Feast feature server for the feature-contract tests: the session fixture
``feast_server``, a started ``orchid_tools.featurestore.FeastServer`` over a copy of
``examples/orchid/features`` in a temporary directory (never the repository), stopped at the
end of the session. About 10 s to start (apply, materialize, serve).

``tests/conftest.py`` imports it, so every module shares the one server (a module importing the
fixture itself would get a server of its own: a fixture's scope is per definition).
Tests that need it skip, saying why, when Feast is not installed (the ``features`` extra:
``scripts/bootstrap.sh`` installs it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from orchid_tools.featurestore import FeastServer, feast_executable


@pytest.fixture(scope="session")
def feast_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FeastServer]:
    if not feast_executable().exists():
        pytest.skip("feast not installed (the features extra: scripts/bootstrap.sh installs it)")
    server = FeastServer(tmp_path_factory.mktemp("feast"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
