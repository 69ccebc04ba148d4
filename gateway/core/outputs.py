"""Output contracts: what a valid answer of a model looks like, declared once.

This module owns the one definition of an output check (``OutputCheck``: datatype, shape,
value range; its file schema is ``gateway.settings.OutputCheckSchema``) and the pure
judgement of an answer's output facts against a set of them (``output_problems``). Both
users read it from here:

* a **route** may declare ``outputs`` (``routes/*.yaml``): every production answer of the
  route is checked before it is returned (``gateway.outputs``; an invalid answer is refused
  with INTERNAL, rule ``output.contract``, or answered from the warm fallback where the
  route says so and policy allows);
* a **rollout** declares ``warmup.outputs`` (``rollouts/*.yaml``): the candidate's warm-up
  answers and every canary and shadow answer are checked against them; an invalid canary
  answer is answered again by the current version and never leaves.

Nothing here decodes tensors: the runtime (``gateway.outputs``) turns a backend's answer
into ``OutputFacts`` (name, datatype, shape, value count, lowest and highest value) and
this module decides. No I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

# The symbols a declared shape may use: the request's own dimensions.
ShapeSymbol = Literal["items", "input_tokens", "output_tokens"]
# The rule a refusal for an invalid answer carries (trailing metadata ``orchid-rule``).
OUTPUT_CONTRACT_RULE = "output.contract"


@dataclass(frozen=True, slots=True)
class OutputCheck:
    """What a valid output looks like: datatype, shape (ints, or ``items``/``output_tokens``/
    ``input_tokens`` of the request) and optionally the range of its values."""

    datatype: str
    shape: tuple[int | ShapeSymbol, ...]
    min_value: float | None = None
    max_value: float | None = None


@dataclass(frozen=True, slots=True)
class OutputFacts:
    """One output tensor of an answer as the check reads it (no payload bytes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    count: int | None  # values decoded; None: its datatype is not decoded (range unchecked)
    low: float | None  # lowest value (None: no values, or not decoded)
    high: float | None


def output_problems(
    facts: Sequence[OutputFacts],
    checks: Mapping[str, OutputCheck],
    *,
    items: int,
    input_tokens: int,
    output_tokens: int,
    batched: bool,
) -> list[str]:
    """What is wrong with an answer's outputs against ``checks`` ([] = valid). ``batched``:
    the model's outputs carry a leading batch dimension (a declared leading ``items`` is
    dropped for a model without one). Messages name outputs and bounds, never values."""
    problems: list[str] = []
    by_name = {f.name: f for f in facts}
    symbols = {"items": items, "input_tokens": input_tokens, "output_tokens": output_tokens}
    for name, check in checks.items():
        fact = by_name.get(name)
        if fact is None:
            problems.append(f"output {name} missing")
            continue
        if fact.datatype != check.datatype:
            problems.append(f"output {name} is {fact.datatype}, expected {check.datatype}")
            continue
        want = [symbols[d] if isinstance(d, str) else d for d in check.shape]
        if not batched and want and check.shape[0] == "items":
            want = want[1:]
        if list(fact.shape) != want:
            problems.append(f"output {name} has shape {list(fact.shape)}, expected {want}")
            continue
        if fact.count is None:
            continue
        size = 1
        for d in want:
            size *= d
        if fact.count != size:
            problems.append(f"output {name} holds {fact.count} values for shape {want}")
        elif fact.low is not None and check.min_value is not None and fact.low < check.min_value:
            problems.append(f"output {name} has a value below {check.min_value:g}")
        elif fact.high is not None and check.max_value is not None and fact.high > check.max_value:
            problems.append(f"output {name} has a value above {check.max_value:g}")
    return problems
