"""Policy sources: policy, test-suite and request files as located nodes and diagnostics.

This module owns turning those files into ``Diagnostic``s that point at a line
and column. It composes them with the gateway's one located-YAML reader
(``gateway.yaml_source``: node marks, no object construction), holds the
structural helpers that turn a node into a mapping/list/scalar with a located
error, and the one tricky bit: mapping an offset *inside a CEL expression* (as
the engine reports it) back to the line and column *in the file*, through YAML
quoting, block scalars and folding.

The mapping aligns the expression's non-blank characters with the scalar's
source text, in order. Plain, literal (``|``) and folded (``>``) scalars only
change whitespace, so the alignment is exact; in quoted scalars escapes are
skipped over and the rare unmatched character falls back to the scalar's start.

Anchors and aliases are refused: a policy file is reviewed text, and aliases
are the YAML "billion laughs" vector.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.policy.diagnostics import Diagnostic
from gateway.yaml_source import YamlError, first_alias, parse_yaml

NULL_TAG = "tag:yaml.org,2002:null"
STR_TAG = "tag:yaml.org,2002:str"
INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"
BOOL_TAG = "tag:yaml.org,2002:bool"


class Located(Exception):
    """A structural problem at a node; collected into a ``Diagnostic`` by the caller."""

    def __init__(self, node: Node | None, message: str) -> None:
        super().__init__(message)
        self.node = node
        self.message = message


@dataclass
class SourceFile:
    """One file's text, with line lookup for diagnostics."""

    path: str
    text: str
    _line_starts: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        starts = [0]
        for index, ch in enumerate(self.text):
            if ch == "\n":
                starts.append(index + 1)
        self._line_starts = starts

    def line_text(self, line: int) -> str:
        """The 1-based ``line`` without its newline ("" when out of range)."""
        if line < 1 or line > len(self._line_starts):
            return ""
        start = self._line_starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start : end if end >= 0 else len(self.text)].rstrip("\r")

    def position(self, index: int) -> tuple[int, int]:
        """1-based (line, column) of a character index."""
        index = max(0, min(index, len(self.text)))
        line = bisect.bisect_right(self._line_starts, index)
        return line, index - self._line_starts[line - 1] + 1

    def diagnostic_at(self, line: int, column: int, message: str) -> Diagnostic:
        return Diagnostic(self.path, line, column, message, self.line_text(line))

    def diagnostic(self, node: Node | None, message: str) -> Diagnostic:
        if node is None:
            return Diagnostic(self.path, 1, 1, message, self.line_text(1))
        return self.diagnostic_at(node.start_mark.line + 1, node.start_mark.column + 1, message)

    def compose(self) -> Node | None:
        """Parse to a node tree (``gateway.yaml_source``); a syntax error raises
        ``YamlSyntaxError``, an anchor or alias ``Located``."""
        try:
            node = parse_yaml(self.path, self.text).root
        except YamlError as exc:
            line, column = exc.line or 1, exc.column or 1
            raise YamlSyntaxError(self.diagnostic_at(line, column, exc.problem)) from exc
        if node is not None:
            alias = first_alias(node)
            if alias is not None:
                raise Located(alias, "YAML anchors and aliases are not allowed in policy files")
        return node

    # -- expression positions ------------------------------------------------

    def expression_position(self, node: ScalarNode, line: int, column: int) -> tuple[int, int]:
        """File (line, column) of the 1-based (line, column) inside the scalar's value."""
        return self.position(self._expression_index(node, _offset_of(node.value, line, column)))

    def _expression_index(self, node: ScalarNode, offset: int) -> int:
        value = node.value
        start = node.start_mark.index
        end = node.end_mark.index
        style = node.style
        if style in ('"', "'"):
            start += 1
        elif style in ("|", ">"):
            newline = self.text.find("\n", start, end)
            start = newline + 1 if newline >= 0 else start
        offset = max(0, min(offset, len(value)))
        # Align non-blank characters of the value with the source, in order.
        cursor = start
        last_source = -1
        last_value = -1
        for position, ch in enumerate(value):
            if position > offset:
                break
            if ch.isspace():
                continue
            found = self.text.find(ch, cursor, end)
            if found < 0:
                return start if last_source < 0 else last_source
            if position == offset:
                return found
            last_source, last_value = found, position
            cursor = found + 1
        if last_source < 0:
            return start
        # ``offset`` is blank or past the end: step forward from the last aligned character.
        index = last_source
        for _ in range(offset - last_value):
            if index + 1 >= len(self.text) or self.text[index + 1] == "\n":
                break
            index += 1
        return index


class YamlSyntaxError(Exception):
    def __init__(self, diagnostic: Diagnostic) -> None:
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


def _offset_of(value: str, line: int, column: int) -> int:
    """Character offset of a 1-based (line, column) in ``value``."""
    offset = 0
    for _ in range(max(0, line - 1)):
        newline = value.find("\n", offset)
        if newline < 0:
            break
        offset = newline + 1
    return offset + max(0, column - 1)


# ---------------------------------------------------------------------------
# Structural helpers
# ---------------------------------------------------------------------------


def mapping_items(node: Node, what: str) -> Iterator[tuple[str, ScalarNode, Node]]:
    """(key, key node, value node) of a mapping with string keys; duplicate keys are errors."""
    if not isinstance(node, MappingNode):
        raise Located(node, f"{what} must be a mapping")
    seen: dict[str, ScalarNode] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, ScalarNode) or key_node.tag not in (STR_TAG, INT_TAG, BOOL_TAG):
            raise Located(key_node, f"{what} keys must be plain strings")
        key = key_node.value
        if key in seen:
            first = seen[key].start_mark
            raise Located(key_node, f"duplicate key '{key}' in {what} (first at line {first.line + 1})")
        seen[key] = key_node
        yield key, key_node, value_node


def sequence_items(node: Node, what: str) -> list[Node]:
    if not isinstance(node, SequenceNode):
        raise Located(node, f"{what} must be a list")
    return list(node.value)


def is_null(node: Node) -> bool:
    return isinstance(node, ScalarNode) and node.tag == NULL_TAG


def scalar_text(node: Node, what: str) -> str:
    """A scalar's text as written (numbers and booleans included, null refused)."""
    if not isinstance(node, ScalarNode) or node.tag == NULL_TAG:
        raise Located(node, f"{what} must be a non-empty scalar")
    return str(node.value)


def expression_node(node: Node, what: str) -> ScalarNode:
    """A scalar holding a CEL expression (``true`` and ``4096`` are valid CEL too)."""
    if not isinstance(node, ScalarNode) or node.tag == NULL_TAG or not str(node.value).strip():
        raise Located(node, f"{what} must be a CEL expression (a YAML string)")
    return node


def plain_value(node: Node) -> Any:
    """The Python value of a node (for test inputs and expectations)."""
    try:
        return SafeConstructor().construct_object(node, deep=True)
    except ConstructorError as exc:
        raise Located(node, f"cannot read value: {exc.problem}") from exc
