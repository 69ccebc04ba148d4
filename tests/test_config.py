"""Configuration errors name the file, the key path and the problem; serve exits non-zero."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import load_gateway_config, load_routes, load_tenants
from gateway.core.errors import ConfigError
from orchid_tools.cli import main
from tests.conftest import EXAMPLE_CONFIG, ROOT

HEAD = "tenants_file: t.yaml\nroutes_dir: r\npolicies_dir: p\n"


def test_shipped_configuration_loads() -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    tenants = load_tenants(config.tenants_file)
    routes = load_routes(config.routes_dir)
    assert config.local_triton is not None and config.local_triton.model_repository.is_dir()
    assert set(tenants.tenants) == {"orchid", "lumen", "ops", "kestrel"}
    assert routes.models["full-v18"].fallback == "compact-v11"


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ("listen: 1\n", "listen", "valid string"),
        ("listen: 'a:1'\n", "tenants_file", "Field required"),
        (
            HEAD + "classes: {interactive: {default_deadline_ms: -1}}\nlocal_triton: {model_repository: m}\n",
            "classes.interactive.default_deadline_ms",
            "greater than 0",
        ),
        (
            HEAD + "classes: {interactive: {default_deadline_ms: 5}}\n"
            "backends: [{name: a, address: 'x:1', labels: {cell: c}, devices: 1}]\n",
            "backends.0.labels",
            "device_group",
        ),
        (
            HEAD + "classes: {interactive: {default_deadline_ms: 5}}\n",
            "",
            "configure at least one backend",
        ),
    ],
)
def test_bad_gateway_config_names_file_and_key(tmp_path: Path, text: str, key: str, problem: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_gateway_config(path)
    assert str(path) in str(error.value)
    assert error.value.key == key
    assert problem in error.value.problem


def test_serve_exits_2_with_readable_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(HEAD + "classes: {interactive: {default_deadline_ms: 0}}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: classes.interactive.default_deadline_ms" in err


def test_yaml_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError) as error:
        load_gateway_config(path)
    assert error.value.location.startswith(f"{path}:")


def test_tenant_key_must_be_a_digest(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "tenants:\n  t:\n    key_sha256: [my-clear-key]\n    models: []\n    classes: []\n    cells: [eu]\n"
    )
    with pytest.raises(ConfigError) as error:
        load_tenants(path)
    assert error.value.key == "tenants.t.key_sha256"


def test_route_with_unknown_fallback(tmp_path: Path) -> None:
    text = (ROOT / "routes" / "orchid.yaml").read_text().replace("fallback: compact-v11", "fallback: tiny-v1")
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ConfigError) as error:
        load_routes(tmp_path)
    assert error.value.key == "models.full-v18.fallback"


def test_dedicated_tenants_need_reserved_models(tmp_path: Path) -> None:
    import yaml

    from gateway.config import check_dedicated

    config = load_gateway_config(EXAMPLE_CONFIG)
    routes = load_routes(config.routes_dir)
    data = yaml.safe_load(config.tenants_file.read_text())
    check_dedicated(config, load_tenants(config.tenants_file), routes)  # the example is consistent
    data["tenants"]["lumen"]["dedicated"] = True
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as error:
        check_dedicated(config.model_copy(update={"tenants_file": path}), load_tenants(path), routes)
    assert error.value.key == "tenants.lumen.dedicated_models"
    data["tenants"]["lumen"]["dedicated_models"] = {"full-v18": "full-v18-kestrel"}  # kestrel's
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="already used by tenant 'kestrel'"):
        check_dedicated(config.model_copy(update={"tenants_file": path}), load_tenants(path), routes)
