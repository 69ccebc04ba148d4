"""Load-time diagnostics: ``file:line:col: message``, the source line and a caret.

Every problem the loader finds in a policy directory - YAML syntax, structure,
CEL syntax, types, unknown variables, limits - becomes one ``Diagnostic``
pointing into the file (for CEL errors: into the expression inside the YAML
scalar). ``PolicyLoadError`` carries all of them, so ``policy lint`` can show
every problem at once and the store can log them on a rejected reload.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gateway.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One problem at a 1-based line and column of a file."""

    path: str
    line: int
    column: int
    message: str
    source_line: str = ""  # the file's line, shown with a caret under ``column``

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"

    def headline(self) -> str:
        return f"{self.location}: {self.message}"

    def render(self) -> str:
        """The headline, then the source line and a caret (when the line is known)."""
        if not self.source_line:
            return self.headline()
        prefix = "".join(ch if ch == "\t" else " " for ch in self.source_line[: max(0, self.column - 1)])
        return f"{self.headline()}\n    {self.source_line}\n    {prefix}^"


def render_all(diagnostics: Iterable[Diagnostic]) -> str:
    return "\n".join(d.render() for d in diagnostics)


class PolicyLoadError(ConfigError):
    """A policy set did not compile. ``diagnostics`` holds every problem found, in file order."""

    def __init__(self, diagnostics: Iterable[Diagnostic]) -> None:
        self.diagnostics: tuple[Diagnostic, ...] = tuple(diagnostics)
        first = (
            self.diagnostics[0] if self.diagnostics else Diagnostic("<policy>", 0, 0, "invalid policy set")
        )
        more = len(self.diagnostics) - 1
        problem = first.message + (f" (and {more} more problem{'s' if more > 1 else ''})" if more > 0 else "")
        super().__init__(first.location, "", problem)
