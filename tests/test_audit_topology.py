"""The audit's topology section for the example topology (examples/orchid/topology/gateway.yaml):
units per model, failure domains and what each loss takes; none for a config without a topology."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchid_tools.audit import audit_isolation, render_json, render_text
from tests.conftest import ROOT
from tests.test_capacity_topology import _loadable

PLAIN = ROOT / "examples" / "orchid" / "gateway.yaml"


def test_the_audit_shows_units_and_domain_losses(tmp_path: Path) -> None:
    audit = audit_isolation(_loadable(tmp_path), now=0.0)
    (local,) = audit.topology
    assert local.backend == "local" and local.devices == 4
    models = {m.model: m for m in local.models}
    assert [u.devices for u in models["full-v18-tp2"].units] == [(0, 1), (2, 3)]
    assert [u.name for u in models["full-v18-tp2"].units] == ["full-v18-tp2/u0", "full-v18-tp2/u1"]
    assert [u.devices for u in models["full-v18"].units] == [(0,), (1,), (2,), (3,)]
    assert models["full-v18-tp2"].width == 2 and models["full-v18-tp2"].capacity_devices == 4
    losses = {(d.kind, d.name): d for d in local.losses}
    host_b = losses[("host", "host-b")]
    assert host_b.devices == (2, 3)
    assert host_b.units_lost["full-v18-tp2"] == ("full-v18-tp2/u1",)
    assert host_b.units_lost["full-v18"] == ("full-v18/u2", "full-v18/u3")
    assert host_b.units_left["full-v18-tp2"] == 1 and host_b.units_left["full-v18"] == 2
    assert host_b.stranded == ()
    # 2 devices of capacity left per pool: x 1,000 x 0.70 = the worksheet's 1,400 accelerator-ms/s.
    assert host_b.capacity_left["full-v18-tp2"] == 2 and host_b.capacity_left["full-v18"] == 2
    assert losses[("rack", "rack-1")].capacity_left["full-v18-tp2"] == 0
    codes = {f.code: f for f in audit.findings}
    assert codes["domain-loss-leaves-no-unit"].severity == "info"  # rack-1 is the whole backend

    text = render_text(audit)
    assert "Topology of backend local (4 devices; lost now: none)" in text
    assert "u0 [0, 1]; u1 [2, 3]" in text
    assert "host host-b (devices 2, 3): stranded none" in text
    row = next(
        x for x in text.split("host host-b", 1)[1].splitlines() if x.strip().startswith("full-v18-tp2")
    )
    assert row.split()[1:] == ["u1", "1", "of", "2", "2", "of", "4", "devices"]

    data = json.loads(render_json(audit))
    (entry,) = data["topology"]
    host = next(d for d in entry["losses"] if d["name"] == "host-b")
    assert host["units_lost"]["full-v18-tp2"] == ["full-v18-tp2/u1"]
    assert host["capacity_left"]["full-v18"] == 2


@pytest.mark.parametrize("config", [PLAIN])
def test_a_config_without_a_topology_has_no_section(config: Path) -> None:
    audit = audit_isolation(config, now=0.0)
    assert audit.topology == ()
    assert "Topology of backend" not in render_text(audit)
    assert "topology" not in json.loads(render_json(audit))
    assert "domain-loss-leaves-no-unit" not in {f.code for f in audit.findings}
