"""SentSoFar: what one request's stream has sent to the client, so it can go on elsewhere.

A stream whose decode worker dies (or that ends with an error after its first token) is resumed
on another decode worker: the new attempt's prompt is the original prompt plus every token sent
so far, ``max_tokens`` what is left, and ``SamplingParams.num_resumed`` says how many prompt ids
are output already, so the engine makes their text again without emitting it (stop strings and
characters across the seam come out as in one run) and penalties and the grammar count them.
It goes through prefill again (the original prompt's KV is usually in the prefix cache). Greedy
output is the uninterrupted run's; sampled output is a valid continuation, not the same one.

What the client sees stays the original request's: events pass unchanged except that
``num_cached_tokens`` stays the first attempt's (the resumed prompt would count its own
tokens as cached). ``limit`` caps the migrations of one request (0: none, the stream ends with
the error as before).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from glmserve.core.generation import SamplingParams, TokenEvent


@dataclass
class SentSoFar:
    prompt_ids: list[int]
    params: SamplingParams
    limit: int
    token_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # the first attempt's prompt tokens served from the cache
    migrations: int = 0
    resumed: bool = False  # an attempt's prompt holds tokens already sent

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"limit: must be >= 0, got {self.limit}")

    def seen(self, event: TokenEvent) -> TokenEvent:
        """Record ``event`` on its way to the client; returns what the client gets."""
        self.token_ids += event.token_ids
        if not self.resumed:
            self.num_cached = max(self.num_cached, event.num_cached_tokens)
            return event
        return replace(event, num_cached_tokens=self.num_cached)

    def may_resume(self) -> bool:
        """Another attempt is allowed: migrations left and tokens still to generate."""
        return self.migrations < self.limit and len(self.token_ids) < self.params.max_tokens

    def resume(self) -> None:
        self.migrations += 1
        self.resumed = self.resumed or bool(self.token_ids)

    def attempt(self) -> tuple[list[int], SamplingParams]:
        """The prompt and parameters of the next attempt."""
        if not self.token_ids:
            return self.prompt_ids, self.params
        n = len(self.token_ids)
        params = replace(self.params, max_tokens=self.params.max_tokens - n,
                         num_resumed=self.params.num_resumed + n)
        return self.prompt_ids + self.token_ids, params
