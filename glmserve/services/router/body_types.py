"""The strict field types and the open base model every request body is built from (strict:
``"1.5"`` is not a number, ``1`` is not a boolean, numbers are finite; open: unknown fields are
accepted and ignored, as OpenAI-compatible servers do)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict

Bool = Annotated[bool, Strict()]
Int = Annotated[int, Strict()]
Str = Annotated[str, Strict()]
Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]


class OpenBody(BaseModel):
    """Unknown fields are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
