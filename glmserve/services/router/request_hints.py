"""Reading a request's session id and tenant cache salt (``RequestHints``) from HTTP.

- Session: header ``x-session-id``, else the body's ``user`` field (the OpenAI API's end-user id,
  which agent frameworks commonly set per conversation).
- Cache salt: with API keys configured, every key is its own tenant: the salt starts with a digest
  of the key, so two keys never share cached KV. The header ``x-cache-salt`` subdivides further
  (e.g. per end customer of one key); without API keys it is the whole salt. A client can only
  ever narrow sharing, never join another key's cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from glmserve.services.router.backend import RequestHints
from glmserve.services.router.errors import invalid_request

MAX_HINT_CHARS = 256


def _checked(value: Any, param: str) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise invalid_request(f"{param}: must be a string", param)
    if len(value) > MAX_HINT_CHARS:
        raise invalid_request(f"{param}: at most {MAX_HINT_CHARS} characters", param)
    return value


def request_hints(headers: Mapping[str, str], user: str | None, api_key: str | None) -> RequestHints:
    """``user``: the body's ``user`` field; ``api_key``: the caller's key when the router requires
    keys (else None). 400 on bad values."""
    session = _checked(headers.get("x-session-id"), "x-session-id") or _checked(user, "user")
    header_salt = _checked(headers.get("x-cache-salt"), "x-cache-salt")
    salt = header_salt
    if api_key is not None:
        key_part = "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:32]
        salt = key_part if header_salt is None else f"{key_part}/{header_salt}"
    return RequestHints(session_id=session, cache_salt=salt)
