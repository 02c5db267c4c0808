"""GrammarSpec: what a request's output must match, as plain data (no torch, no xgrammar).

The router builds it from `response_format` or from `tools` + `tool_choice`; the engine compiles it
(glmserve/engine/grammar_cache.py) and constrains sampling with it. Its `key` is the cache key: two
requests with the same schema, tools and choice share one compiled grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_object", "json_schema", "tool_calls"]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    schema: str = ""  # json_schema: the schema as canonical JSON
    tools: str = ""  # tool_calls: the OpenAI tool list as canonical JSON
    tool_choice: str = "required"  # tool_calls: "required", "auto" (calls constrained once started) or a name
    parallel_tool_calls: bool = True
    after_reasoning: bool = False  # the grammar starts after the model's `</think>`

    def __post_init__(self) -> None:
        if self.kind not in ("json_object", "json_schema", "tool_calls"):
            raise ValueError(f"kind: unknown grammar kind {self.kind!r}")
        if self.kind == "json_schema" and not self.schema:
            raise ValueError("schema: json_schema needs a schema")
        if self.kind == "tool_calls" and not self.tools:
            raise ValueError("tools: tool_calls needs at least one tool")

    @property
    def key(self) -> str:
        return _canonical([self.kind, self.schema, self.tools, self.tool_choice, self.parallel_tool_calls,
                           self.after_reasoning])

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any] | None) -> GrammarSpec | None:
        """OpenAI `response_format`: text (None), json_object, or json_schema {name, schema, strict}."""
        if not response_format or response_format.get("type", "text") == "text":
            return None
        kind = response_format.get("type")
        if kind == "json_object":
            return cls("json_object")
        if kind != "json_schema":
            raise ValueError(f"response_format.type: must be text, json_object or json_schema, not {kind!r}")
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError("response_format.json_schema.schema: must be a JSON schema object")
        return cls("json_schema", schema=_canonical(spec.get("schema") or {"type": "object"}))

    @classmethod
    def from_tool_choice(
        cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool = True
    ) -> GrammarSpec | None:
        """`required` and a named function constrain the output to calls; `auto` and `none` leave it
        free (None): `none` is enforced by not offering the tools, `auto` by the parser."""
        if tool_choice in (None, "auto", "none"):
            return None
        if not tools:
            raise ValueError("tool_choice: requires tools")
        names = [t.get("function", {}).get("name") for t in tools]
        if tool_choice == "required":
            return cls("tool_calls", tools=_canonical(tools), tool_choice="required",
                       parallel_tool_calls=parallel_tool_calls)
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        if name not in names:
            raise ValueError(f"tool_choice.function.name: {name!r} is not one of the tools")
        chosen = [t for t in tools if t.get("function", {}).get("name") == name]
        return cls("tool_calls", tools=_canonical(chosen), tool_choice=name, parallel_tool_calls=False)
