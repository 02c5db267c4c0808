"""Surface variety for glm52-tiny's training asks: one template filled in, then politeness, casing and
punctuation varied, so no phrasing is tied to a single sentence shape."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_REQUEST_PREFIXES = ("", "", "", "Please ", "Can you ", "Could you ", "I'd like you to ", "Go ahead and ",
                     "Hey, ", "I need you to ", "Would you ")
_QUESTION_PREFIXES = ("", "", "", "", "Hey, ", "Quick question: ", "Hi! ", "Hello, ", "So, ")
_SUFFIXES = ("", "", "", "", " please", ", thanks", " thank you", " asap")


@dataclass(frozen=True)
class Ask:
    """A user turn with what the assistant does about it: call `tool` (a canonical spec name) with
    `args` (canonical keys), see `result`, then say `answer`; or, with no tool, just say `answer`."""

    text: str
    answer: str
    tool: str | None = None
    args: dict[str, Any] | None = None
    result: str = ""


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def request(rng: random.Random, templates: tuple[str, ...], **slots: Any) -> str:
    """An imperative template ("Read {path}") with an optional polite prefix and suffix."""
    text = rng.choice(templates)
    prefix = rng.choice(_REQUEST_PREFIXES)
    if prefix:
        text = prefix + _lower_first(text)
    text = text.rstrip(".?!") + rng.choice(_SUFFIXES)
    end = "?" if prefix.strip() in ("Can you", "Could you", "Would you") else rng.choice((".", "", "", "!"))
    return _vary_case(rng, text + end).format(**slots)


def question(rng: random.Random, templates: tuple[str, ...], **slots: Any) -> str:
    """A question template ("What's in {path}?") with an optional greeting."""
    text = rng.choice(templates)
    prefix = rng.choice(_QUESTION_PREFIXES)
    if prefix:
        text = prefix + _lower_first(text)
    if rng.random() < 0.15:
        text = text.rstrip("?")
    return _vary_case(rng, text).format(**slots)


def either(rng: random.Random, requests: tuple[str, ...], questions: tuple[str, ...], **slots: Any) -> str:
    """A request or a question, in proportion to how many templates each has."""
    if rng.random() < len(requests) / (len(requests) + len(questions)):
        return request(rng, requests, **slots)
    return question(rng, questions, **slots)


def _vary_case(rng: random.Random, text: str) -> str:
    """On the template, before its slots are filled: the names and paths in an ask keep their case."""
    r = rng.random()
    if r < 0.12:
        return text.lower()
    return text


def pick(rng: random.Random, *options: str) -> str:
    return rng.choice(options)
