"""The strict field types and the open base model every request body is built from (strict:
``"1.5"`` is not a number, ``1`` is not a boolean, numbers are finite; open: unknown fields are
accepted and ignored, as OpenAI-compatible servers do)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict

Bool = Annotated[bool, Strict()]
Int = Annotated[int, Strict()]
Str = Annotated[str, Strict()]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


class OpenBody(BaseModel):
    """Unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")


def by_type(default: str | None = None) -> Discriminator:
    """A tagged union's discriminator: the member whose tag is the value's ``type`` (``default``
    when it has none); an unknown type is a 400 listing the known ones."""

    def tag(value: Any) -> str:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return kind if isinstance(kind, str) else "?"

    return Discriminator(tag)
