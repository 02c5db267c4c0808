"""The scripted load of the observability run, with the unmodified `openai` client: streaming and
non-streaming chat and completions sharing a system prompt (prefix-cache hits), streams the client
abandons after their first chunk (499, aborts), bad requests (400) and long prompts to kill a
worker under. Every outcome is tallied by kind."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import openai

SYSTEM = ("You are a careful coding assistant. Answer with short, correct Python. " * 12).strip()
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega vector tensor block cache".split()


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)  # the error answers' messages, in order

    def add(self, kind: str) -> None:
        self.outcomes[kind] += 1

    def error(self, e: openai.APIError) -> None:
        self.add(f"error:{type(e).__name__}")
        self.errors.append(f"{type(e).__name__}: {e}"[:200])


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def long_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _chat(client: openai.AsyncOpenAI, model: str, content: str, max_tokens: int, stream: bool,
                tally: Tally) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    try:
        if not stream:
            reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                         temperature=0)
            tally.add(f"chat:{reply.choices[0].finish_reason}")
            return
        finish = None
        async for chunk in await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        tally.add(f"chat-stream:{finish}")
    except openai.APIError as e:
        tally.error(e)


async def _completion(client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int, stream: bool,
                      tally: Tally) -> None:
    try:
        if not stream:
            reply = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
            tally.add(f"completion:{reply.choices[0].finish_reason}")
            return
        async for _ in await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, stream=True):
            pass
        tally.add("completion-stream:done")
    except openai.APIError as e:
        tally.error(e)


async def abandoned_stream(client: openai.AsyncOpenAI, model: str, content: str, tally: Tally) -> None:
    """A stream the client closes after its first chunk: the router answers 499 and aborts it (its
    2000 tokens outlast any delay in noticing that the client left)."""
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=2000, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()
        tally.add("abandoned")
    except openai.APIError as e:
        tally.error(e)


async def bad_request(client: openai.AsyncOpenAI, model: str, tally: Tally) -> None:
    try:
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
        tally.add("bad-request-accepted")
    except openai.BadRequestError:
        tally.add("bad-request")


async def mixed_load(url: str, model: str, rounds: int, tally: Tally, seed: int = 0) -> None:
    """``rounds`` rounds of: two streamed and one plain chat, a streamed and a plain completion, two
    abandoned streams and a bad request, all at once."""
    async with client_for(url) as client:
        for r in range(rounds):
            topic = f"task {seed}-{r}: " + long_prompt(seed * 100 + r, 24)
            await asyncio.gather(
                _chat(client, model, topic + " stream one", 24, True, tally),
                _chat(client, model, topic + " stream two", 48, True, tally),
                _chat(client, model, topic + " plain", 16, False, tally),
                _completion(client, model, SYSTEM + " def fibonacci(n):", 16, True, tally),
                _completion(client, model, SYSTEM + " def quicksort(xs):", 16, False, tally),
                abandoned_stream(client, model, topic + " long answer", tally),
                abandoned_stream(client, model, topic + " longer answer", tally),
                bad_request(client, model, tally),
            )


async def long_requests(url: str, model: str, count: int, words: int, tally: Tally) -> None:
    """``count`` long unique prompts at once (a prefill worker is busy with them for a while)."""
    async with client_for(url) as client:
        await asyncio.gather(*(_chat(client, model, long_prompt(1000 + i, words), 8, i % 2 == 0, tally)
                               for i in range(count)))


async def until_served(url: str, model: str, tally: Tally, timeout_s: float) -> None:
    """One-token completions until one is answered (a router reaches a restarted worker only after
    its channel's reconnect backoff); fails after ``timeout_s``."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with client_for(url) as client:
        while True:
            try:
                await client.completions.create(model=model, prompt="ping", max_tokens=1)
                tally.add("probe")
                return
            except openai.APIError as e:
                tally.error(e)
            assert asyncio.get_running_loop().time() < deadline, f"not served within {timeout_s} s: {tally.errors[-1]}"
            await asyncio.sleep(0.5)
