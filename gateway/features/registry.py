"""The feature source's definitions, read from its registry: which definition version each
feature service and feature view carries.

Feast keeps its definitions in a registry file (a serialized ``feast.core.Registry``); the
definition version is the ``definition_version`` tag a feature repository puts on its feature
services and views (``examples/orchid/features/features.py``). The gateway reads the file
itself, through the subset of Feast's schema it needs, declared here with Feast's field
numbers (protobuf ignores the rest): importing Feast would cost a gateway 3 s of start-up and
pandas. Field numbers are Feast's wire contract (``feast/protos/feast/core/Registry.proto``,
``FeatureService.proto``, ``FeatureView.proto``; checked against Feast 0.67).

The data generation is a digest of the registry's bytes: ``feast apply`` and
``feast materialize`` both rewrite it, so cached values from before either are not reused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

TAG = "definition_version"

_F = descriptor_pb2.FieldDescriptorProto


def _schema() -> Any:
    """The message class of Feast's ``Registry``, reduced to services and views (names, tags,
    feature names)."""
    file = descriptor_pb2.FileDescriptorProto(
        name="orchid_feast_registry_subset.proto", package="orchid.feast"
    )

    def message(
        name: str, fields: list[tuple[str, int, int, str | None, bool]]
    ) -> descriptor_pb2.DescriptorProto:
        proto = file.message_type.add(name=name)
        for field_name, number, kind, type_name, repeated in fields:
            added = proto.field.add(
                name=field_name,
                number=number,
                type=kind,
                label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL,
            )
            if type_name is not None:
                added.type_name = type_name
        return proto

    def tags(owner: descriptor_pb2.DescriptorProto) -> None:
        entry = owner.nested_type.add(name="TagsEntry")
        entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
        entry.field.add(name="value", number=2, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
        entry.options.map_entry = True

    string, msg = _F.TYPE_STRING, _F.TYPE_MESSAGE
    message("FeatureSpec", [("name", 1, string, None, False)])
    view_spec = message(
        "ViewSpec",
        [
            ("name", 1, string, None, False),
            ("features", 4, msg, ".orchid.feast.FeatureSpec", True),
            ("tags", 5, msg, ".orchid.feast.ViewSpec.TagsEntry", True),
        ],
    )
    tags(view_spec)
    message("View", [("spec", 1, msg, ".orchid.feast.ViewSpec", False)])
    message(
        "Projection",
        [
            ("feature_view_name", 1, string, None, False),
            ("feature_columns", 2, msg, ".orchid.feast.FeatureSpec", True),
        ],
    )
    service_spec = message(
        "ServiceSpec",
        [
            ("name", 1, string, None, False),
            ("features", 3, msg, ".orchid.feast.Projection", True),
            ("tags", 4, msg, ".orchid.feast.ServiceSpec.TagsEntry", True),
        ],
    )
    tags(service_spec)
    message("Service", [("spec", 1, msg, ".orchid.feast.ServiceSpec", False)])
    message(
        "Registry",
        [
            ("feature_views", 6, msg, ".orchid.feast.View", True),
            ("feature_services", 7, msg, ".orchid.feast.Service", True),
        ],
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("orchid.feast.Registry"))


_REGISTRY = _schema()


@dataclass(frozen=True, slots=True)
class ServiceDefinition:
    name: str
    version: str  # its definition_version tag ("" when untagged)
    features: tuple[str, ...]  # view:feature, in the service's order


@dataclass(frozen=True, slots=True)
class Definitions:
    """What a registry file declares, and its generation."""

    services: dict[str, ServiceDefinition]
    view_versions: dict[str, str]
    generation: str

    def check(self, service: str, version: str, refs: tuple[str, ...]) -> str | None:
        """None when ``service`` carries definition ``version`` and serves every ref (each from
        a view of that version too); otherwise what is wrong, for the operator or the caller."""
        found = self.services.get(service)
        if found is None:
            return f"the feature source declares no feature service {service!r}"
        if found.version != version:
            return (
                f"feature service {service!r} is definition {found.version or 'untagged'}, "
                f"the model was trained on {version}"
            )
        for ref in refs:
            if ref not in found.features:
                return f"feature service {service!r} does not serve {ref}"
            view_version = self.view_versions.get(ref.partition(":")[0], "")
            if view_version != version:
                return f"{ref} is definition {view_version or 'untagged'}, the model was trained on {version}"
        return None


class RegistryError(Exception):
    """The registry file could not be read or parsed."""


def read_registry(path: Path) -> Definitions:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RegistryError(f"cannot read the feature registry {path}: {error.strerror}") from error
    registry = _REGISTRY()
    try:
        registry.ParseFromString(data)
    except Exception as error:  # DecodeError: a file that is not a Feast registry
        raise RegistryError(f"{path} is not a Feast registry: {error}") from error
    services = {}
    for service in registry.feature_services:
        spec = service.spec
        refs = tuple(
            f"{projection.feature_view_name}:{column.name}"
            for projection in spec.features
            for column in projection.feature_columns
        )
        services[spec.name] = ServiceDefinition(spec.name, dict(spec.tags).get(TAG, ""), refs)
    views = {view.spec.name: dict(view.spec.tags).get(TAG, "") for view in registry.feature_views}
    return Definitions(services, views, hashlib.sha256(data).hexdigest()[:16])
