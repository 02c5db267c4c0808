"""OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema`` (name, schema, strict),
and the `GrammarSpec` the engine enforces for it (chat and completions alike)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, Strict, model_validator

from glmserve.core.grammar_spec import GrammarSpec
from glmserve.services.router.body_types import Bool, OpenBody, Str


class JsonSchemaFormat(OpenBody):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: Annotated[str, Strict(), Field(min_length=1)]
    description: Str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(OpenBody):
    """``text`` (free), ``json_object`` (any JSON object) or ``json_schema`` (valid for its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is json_schema")
        return self

    def grammar(self) -> GrammarSpec | None:
        """The grammar the engine enforces (None for text); ``ValueError`` naming the field."""
        return GrammarSpec.from_response_format(self.model_dump(by_alias=True, exclude_none=True))
