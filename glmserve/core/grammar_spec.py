"""GrammarSpec: what a request's output must match, as plain data (no torch, no xgrammar).

The router builds it from `response_format` or from `tools` + `tool_choice`; it travels inside
`SamplingParams`; the engine compiles it (glmserve/engine/grammar_cache.py) and masks sampling with
it. Its `key` is the cache key: two requests with the same schema, tools and choice share one
compiled grammar, whatever their ``reasoning``. The JSON keeps its key order: a schema's property
order is the order the grammar generates them in.

``reasoning`` says where the grammar starts when the model thinks first (GLM's `<think>`...
`</think>`): "disabled" (it starts at the first output token), "enabled" (the prompt already opened
`<think>`: free reasoning up to `</think>`, then the grammar) or "auto" (an optional whole
`<think>...</think>` block first).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

GrammarKind = Literal["json_object", "json_schema", "tool_calls"]
ReasoningMode = Literal["disabled", "enabled", "auto"]
KINDS = ("json_object", "json_schema", "tool_calls")
REASONING_MODES = ("disabled", "enabled", "auto")


def canonical_json(value: Any) -> str:
    """Compact JSON, keys in their given order (property order is meaningful to a grammar)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True)
class GrammarSpec:
    """- ``kind``: "json_object" (any JSON object), "json_schema" (``schema``), "tool_calls"
      (GLM tool-call syntax for ``tools``, each call's arguments valid for its function's schema).
    - ``schema``: json_schema: the schema as compact JSON; ``strict``: no properties beyond the
      schema's (OpenAI ``strict``), else JSON Schema's defaults.
    - ``tools``: tool_calls: the OpenAI tool list as compact JSON; ``tool_choice``: "required"
      (one or more calls, nothing else) or a function name (exactly one call of it);
      ``parallel_tool_calls``: more than one call allowed ("required" only).
    - ``reasoning``: see the module docstring.
    """

    kind: GrammarKind
    schema: str = ""
    strict: bool = True
    tools: str = ""
    tool_choice: str = "required"
    parallel_tool_calls: bool = True
    reasoning: ReasoningMode = "disabled"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: unknown grammar kind {self.kind!r}")
        if self.kind == "json_schema" and not self.schema:
            raise ValueError("schema: json_schema needs a schema")
        if self.kind == "tool_calls" and not self.tools:
            raise ValueError("tools: tool_calls needs at least one tool")
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"reasoning: must be one of {REASONING_MODES}, got {self.reasoning!r}")

    @property
    def key(self) -> str:
        """The compiled grammar's cache key (``reasoning`` is left out: the matcher applies it)."""
        return canonical_json([self.kind, self.schema, self.strict, self.tools, self.tool_choice,
                               self.parallel_tool_calls])

    def with_reasoning(self, reasoning: ReasoningMode) -> GrammarSpec:
        return replace(self, reasoning=reasoning)

    @classmethod
    def from_response_format(cls, response_format: Any) -> GrammarSpec | None:
        """OpenAI `response_format`: text (None), json_object, or json_schema {name, schema, strict}."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ValueError("response_format: expected an object")
        kind = response_format.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls("json_object")
        if kind != "json_schema":
            raise ValueError(f"response_format.type: must be text, json_object or json_schema, not {kind!r}")
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema: expected an object with a schema")
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ValueError("response_format.json_schema.strict: expected a boolean")
        return cls("json_schema", schema=canonical_json(schema or {"type": "object"}), strict=strict is not False)

    @classmethod
    def from_tool_choice(
        cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool = True
    ) -> GrammarSpec | None:
        """`required` and a named function constrain the output to calls; `auto` and `none` leave it
        free (None): `none` is enforced by not offering the tools, `auto` leaves the choice to the
        model."""
        if tool_choice in (None, "auto", "none"):
            return None
        if not tools:
            raise ValueError("tool_choice: requires tools")
        names = [(t.get("function") or {}).get("name") for t in tools]
        if tool_choice == "required":
            return cls("tool_calls", tools=canonical_json(tools), tool_choice="required",
                       parallel_tool_calls=parallel_tool_calls)
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
        chosen = [t for t in tools if (t.get("function") or {}).get("name") == name]
        return cls("tool_calls", tools=canonical_json(chosen), tool_choice=name, parallel_tool_calls=False)
