"""Located YAML: the one reader for the YAML files the gateway and its tools load.

This module owns reading a YAML file (UTF-8 text), composing it with PyYAML's
``SafeLoader`` into nodes that remember their line and column, syntax errors located at
``file:line:col``, the plain values constructed from those nodes (exactly what
``yaml.safe_load`` returns), and the way back from a key path - a pydantic error's
``loc`` such as ``("tenants", "orchid", "weight")`` - to the line and column where that
key is written.

Its users: ``gateway.config`` (``gateway.yaml``, the tenants file with its quota
settings, ``routes/*.yaml``), ``gateway.policy.source`` (policy, test-suite and request
files, which turn positions into ``Diagnostic``s) and ``orchid_tools.capacity`` (workload
files). Anchors and aliases compose as YAML defines them (route files share a ``shape``
block); a caller that must refuse them (policy files) asks ``first_alias``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

KeyPath = Sequence[str | int]


class YamlError(Exception):
    """A YAML file that cannot be read or parsed; ``line``/``column`` are 1-based when known."""

    def __init__(self, path: str, problem: str, line: int | None = None, column: int | None = None) -> None:
        self.path = path
        self.problem = problem
        self.line = line
        self.column = column
        super().__init__(f"{self.location}: {problem}")

    @property
    def location(self) -> str:
        return self.path if self.line is None else f"{self.path}:{self.line}:{self.column}"


def key_path(loc: KeyPath) -> str:
    """``("backends", 0, "labels")`` -> ``backends.0.labels`` (how errors name a key)."""
    return ".".join(str(part) for part in loc)


@dataclass(frozen=True, slots=True)
class YamlDocument:
    """One parsed file: its text and its node tree (``root`` is ``None`` for an empty file)."""

    path: str
    text: str
    root: Node | None

    def value(self) -> Any:
        """The document's plain Python value (``yaml.safe_load``'s answer)."""
        if self.root is None:
            return None
        return SafeConstructor().construct_document(self.root)

    def position(self, loc: KeyPath) -> tuple[int, int]:
        """1-based (line, column) of the key at ``loc``: of the deepest key on the path that the
        document has (a missing key is reported where its parent is written)."""
        return _walk(self.root, loc)[1]

    def location(self, loc: KeyPath = ()) -> str:
        """``path:line:col`` of the key at ``loc`` (see ``position``)."""
        line, column = self.position(loc)
        return f"{self.path}:{line}:{column}"

    def has(self, loc: KeyPath) -> bool:
        """Whether every key on ``loc`` is in the document."""
        return _walk(self.root, loc)[0] == len(loc)


def _children(node: MappingNode, key: str) -> Iterator[tuple[ScalarNode, Node]]:
    # The last of duplicate keys wins, as in the constructed value.
    for key_node, value_node in reversed(node.value):
        if isinstance(key_node, ScalarNode) and key_node.value == key:
            yield key_node, value_node


def _walk(root: Node | None, loc: KeyPath) -> tuple[int, tuple[int, int]]:
    """(how many parts of ``loc`` were found, 1-based position of the last one found)."""
    if root is None:
        return 0, (1, 1)
    node: Node = root
    mark = root.start_mark
    found = 0
    for part in loc:
        if isinstance(node, MappingNode):
            match = next(_children(node, str(part)), None)
            if match is None:
                break
            mark, node = match[0].start_mark, match[1]
        elif isinstance(node, SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
            node = node.value[part]
            mark = node.start_mark
        else:
            break
        found += 1
    return found, (mark.line + 1, mark.column + 1)


def parse_yaml(path: str, text: str) -> YamlDocument:
    """Compose ``text`` (named ``path`` in errors); raises ``YamlError`` located at the problem."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.problem and exc.context and exc.context_mark is not None:
            started = exc.context_mark
            problem += f" ({exc.context} at line {started.line + 1}, column {started.column + 1})"
        line, column = (mark.line + 1, mark.column + 1) if mark is not None else (1, 1)
        raise YamlError(path, f"YAML syntax error: {problem}", line, column) from exc
    except yaml.YAMLError as exc:  # reader errors: bad bytes, control characters
        raise YamlError(path, f"YAML error: {exc}", 1, 1) from exc
    return YamlDocument(path, text, root)


def read_yaml(path: str | Path) -> YamlDocument:
    """Read and compose one file; raises ``YamlError`` (unreadable, not UTF-8, bad syntax)."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise YamlError(name, f"cannot read file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise YamlError(name, f"not UTF-8 text: {exc.reason}") from exc
    return parse_yaml(name, text)


def first_alias(root: Node) -> Node | None:
    """The first node reached twice (an alias of an anchored node), or ``None``."""
    seen: set[int] = set()
    stack: list[Node] = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            return node
        seen.add(id(node))
        if isinstance(node, MappingNode):
            for key, value in node.value:
                stack.append(key)
                stack.append(value)
        elif isinstance(node, SequenceNode):
            stack.extend(node.value)
    return None


__all__ = ["KeyPath", "YamlDocument", "YamlError", "first_alias", "key_path", "parse_yaml", "read_yaml"]
