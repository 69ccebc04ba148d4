"""Configuration errors name the file, the line and column of the offending key, the key path and
the problem (pydantic's validation errors and the cross-file checks alike); serve exits non-zero."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.config import check_references, load_gateway_config, load_routes, load_tenants
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
    # file:line:col of the offending key, then its key path: `default_deadline_ms` on line 4.
    assert f"{path}:4:25: classes.interactive.default_deadline_ms: " in err


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


# --------------------------------------------------------------------------- located errors

EXAMPLE_TENANTS = EXAMPLE_CONFIG.parent / "tenants.yaml"


def _position(text: str, needle: str, *, after: str = "") -> str:
    """``line:col`` (1-based) where ``needle`` starts, searching from ``after``'s position."""
    index = text.index(needle, text.index(after) if after else 0)
    line = text.count("\n", 0, index) + 1
    return f"{line}:{index - (text.rfind(chr(10), 0, index) + 1) + 1}"


def _edit(source: Path, target: Path, old: str, new: str, *, after: str = "") -> str:
    text = source.read_text()
    start = text.index(after) if after else 0
    index = text.index(old, start)
    edited = text[:index] + new + text[index + len(old) :]
    target.write_text(edited)
    return edited


@pytest.mark.parametrize(
    ("after", "old", "new", "key", "at"),
    [
        # A wrong type deep in a tenant: the position of `weight` under lumen, not orchid's.
        ("  lumen:", "weight: 1", "weight: heavy", "tenants.lumen.weight", "weight: heavy"),
        # A list element: the item itself.
        ("  lumen:", "models: [full-v18]", "models: [full-v18, 7]", "tenants.lumen.models.1", "7]"),
        # Quota settings (gateway.core.quota) inside a flow mapping.
        (
            "quotas:",
            "lumen:\n      interactive: {weight: 1, max_concurrent: 32,",
            "lumen:\n      interactive: {weight: 1, max_concurrent: many,",
            "quotas.tenants.lumen.interactive.max_concurrent",
            "max_concurrent: many",
        ),
        # An unknown key: where it is written.
        (
            "  kestrel:",
            "dedicated: true",
            "dedicated: true\n    colour: blue",
            "tenants.kestrel.colour",
            "colour",
        ),
    ],
)
def test_a_bad_value_deep_in_tenants_yaml_names_its_line_and_column(
    tmp_path: Path, after: str, old: str, new: str, key: str, at: str
) -> None:
    path = tmp_path / "tenants.yaml"
    text = _edit(EXAMPLE_TENANTS, path, old, new, after=after)
    with pytest.raises(ConfigError) as error:
        load_tenants(path)
    assert error.value.key == key
    assert error.value.location == f"{path}:{_position(text, at, after=after)}"
    assert str(error.value).startswith(f"{path}:{_position(text, at, after=after)}: {key}: ")


def test_a_missing_key_is_reported_where_its_parent_is_written(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    text = _edit(EXAMPLE_TENANTS, path, "    classes: [interactive]\n", "", after="  lumen:")
    with pytest.raises(ConfigError) as error:
        load_tenants(path)
    assert error.value.key == "tenants.lumen.classes"
    assert error.value.location == f"{path}:{_position(text, 'lumen:', after='tenants:')}"


def test_a_route_error_in_a_shared_block_points_into_the_block(tmp_path: Path) -> None:
    # full-v18 anchors its shape (&text_shape) and compact-v11 reuses it: the bad key is
    # written once, inside full-v18's block.
    path = tmp_path / "r.yaml"
    text = _edit(ROOT / "routes" / "orchid.yaml", path, "tokens_dim: -1", "tokens_dim: last")
    with pytest.raises(ConfigError) as error:
        load_routes(tmp_path)
    assert error.value.key == "models.full-v18.shape.tokens_dim"
    assert error.value.location == f"{path}:{_position(text, 'tokens_dim: last')}"


def test_cross_file_checks_are_located_too(tmp_path: Path) -> None:
    config = load_gateway_config(EXAMPLE_CONFIG)
    routes = load_routes(config.routes_dir)
    path = tmp_path / "tenants.yaml"
    text = _edit(EXAMPLE_TENANTS, path, "models: [full-v18]", "models: [full-v18, tiny-v1]", after="  lumen:")
    with pytest.raises(ConfigError) as error:
        check_references(config.model_copy(update={"tenants_file": path}), load_tenants(path), routes)
    assert error.value.key == "tenants.lumen.models"
    assert error.value.location == f"{path}:{_position(text, 'tiny-v1')}"
    assert "unknown model 'tiny-v1'" in error.value.problem

    # A route naming an unknown backend: located in the route file that declares it.
    routes_dir = tmp_path / "routes"
    routes_dir.mkdir()
    route_file = routes_dir / "orchid.yaml"
    text = _edit(
        ROOT / "routes" / "orchid.yaml",
        route_file,
        "    profile: compact-v11\n",
        "    profile: compact-v11\n    backends: [local, elsewhere]\n",
    )
    with pytest.raises(ConfigError) as error:
        check_references(
            config.model_copy(update={"routes_dir": routes_dir}),
            load_tenants(config.tenants_file),
            load_routes(routes_dir),
        )
    assert error.value.key == "models.compact-v11.backends"
    assert error.value.location == f"{route_file}:{_position(text, 'elsewhere')}"


def test_the_route_declared_twice_names_both_places(tmp_path: Path) -> None:
    text = (ROOT / "routes" / "orchid.yaml").read_text()
    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "b.yaml").write_text(
        "models:\n  full-v18:\n    backend_model: x\n    profile: full-v18\n"
        "    shape: {tokens_input: INPUT_IDS}\n"
    )
    with pytest.raises(ConfigError) as error:
        load_routes(tmp_path)
    assert error.value.location == f"{tmp_path / 'b.yaml'}:2:3"
    assert (
        f"first at {tmp_path / 'a.yaml'}:{_position(text, 'full-v18:', after='models:')}"
        in error.value.problem
    )


def test_yaml_is_parsed_in_one_module() -> None:
    """Config, policy and workload files all go through ``gateway.yaml_source``: a second
    parser would bring back errors without a line and column."""
    parsers = {
        "compose",
        "compose_all",
        "load",
        "load_all",
        "safe_load",
        "safe_load_all",
        "parse",
        "full_load",
    }
    offenders: list[str] = []
    for package in ("gateway", "orchid_tools"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT)
            if relative == Path("gateway/yaml_source.py") or "_proto" in relative.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "yaml"
                    and node.func.attr in parsers
                ):
                    offenders.append(f"{relative}:{node.lineno}: yaml.{node.func.attr}")
    assert offenders == []
