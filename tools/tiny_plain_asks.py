"""Asks that need no tool even when tools are offered: concepts, facts, arithmetic, greetings, naming,
and asks for a tool the chat does not offer. The assistant answers in text."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from tools.tiny_phrasing import Ask, either, pick, question

CONCEPTS: dict[str, str] = {
    "a list comprehension": "A compact way to build a list from an iterable: `[f(x) for x in xs if cond(x)]`.",
    "a decorator": "A function that takes a function and returns a new one; `@name` above a def applies it.",
    "a generator": "A function that uses `yield`; it produces values lazily, one per `next()` call.",
    "recursion": "A function calling itself on a smaller input until it reaches a base case.",
    "a closure": "A function that remembers variables from the scope where it was defined.",
    "the GIL": "CPython's global interpreter lock: one thread runs Python bytecode at a time.",
    "a race condition": "A bug where the result depends on the timing of threads or processes.",
    "a deadlock": "Two or more tasks each waiting for a lock the other holds, so none can proceed.",
    "big O notation": "A way to describe how running time or memory grows with the input size.",
    "a hash table": "A structure that maps keys to values by hashing the key into a bucket; lookups are O(1).",
    "a binary search": "Searching a sorted sequence by halving the range each step: O(log n).",
    "a linked list": "A chain of nodes, each holding a value and a reference to the next node.",
    "a context manager": "An object with `__enter__` and `__exit__`, used with `with` to set up and clean up.",
    "duck typing": "Using an object by what it can do, not by its type: if it has the method, call it.",
    "a virtual environment": "An isolated Python install with its own packages, made with `python -m venv`.",
    "a REST API": "An HTTP interface where URLs name resources and methods like GET and POST act on them.",
    "JSON": "A text format for data: objects, arrays, strings, numbers, booleans and null.",
    "a unit test": "A small automated test that checks one piece of code in isolation.",
    "a mutex": "A lock that lets only one thread at a time into a critical section.",
    "an iterator": "An object with `__next__` that returns items one by one and raises StopIteration at the end.",
    "a lambda": "A small anonymous function written in one expression: `lambda x: x + 1`.",
    "type hints": "Annotations like `def f(x: int) -> str` that document types; checkers such as mypy use them.",
    "async and await": "Syntax for coroutines: `await` pauses until a result is ready while other tasks run.",
    "a dataclass": "A class whose `__init__`, `__repr__` and `__eq__` are generated from its annotated fields.",
    "inheritance": "A class reusing and extending another class's attributes and methods.",
    "polymorphism": "Different types answering the same method call, each in its own way.",
    "a stack": "A last-in, first-out collection: push on top, pop from the top.",
    "a queue": "A first-in, first-out collection: add at the back, take from the front.",
    "garbage collection": "Automatic freeing of memory no longer referenced; CPython uses reference counts.",
    "a tuple": "An immutable sequence, written `(a, b)`; it can be a dict key when its items are hashable.",
    "a set": "An unordered collection of unique hashable items with fast membership tests.",
    "an exception": "An error object raised to stop normal flow; `try` and `except` handle it.",
    "version control": "Tracking changes to files over time, as git does, so you can compare and revert.",
    "a merge conflict": "Two branches changed the same lines; git asks you to choose the result.",
    "caching": "Keeping results you computed so the next request for them is fast.",
    "an API key": "A secret string that identifies a client to a service.",
    "a regular expression": "A pattern language for matching text, such as `\\d+` for digits.",
    "SQL": "The language for querying relational databases: SELECT, INSERT, UPDATE, DELETE.",
    "a docstring": "The string literal first in a module, class or function; `help()` shows it.",
    "the difference between a list and a tuple": "A list is mutable; a tuple is immutable and hashable.",
    "the difference between == and is": "`==` compares values; `is` checks that both names are one object.",
    "PEP 8": "Python's style guide: 4-space indents, snake_case names, lines under 80 characters.",
    "a shallow copy": "A new container holding the same inner objects; `copy.deepcopy` copies them too.",
    "memoization": "Caching a function's results by its arguments, as `functools.lru_cache` does.",
}
FACTS: dict[str, str] = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
    "Egypt": "Cairo", "Peru": "Lima", "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia",
    "India": "New Delhi", "China": "Beijing", "Russia": "Moscow", "Mexico": "Mexico City", "Kenya": "Nairobi",
    "Norway": "Oslo", "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Portugal": "Lisbon",
    "Ireland": "Dublin", "Austria": "Vienna", "Chile": "Santiago", "Argentina": "Buenos Aires",
    "Turkey": "Ankara", "Thailand": "Bangkok", "Vietnam": "Hanoi", "South Korea": "Seoul",
}
_GREETINGS = ("Hi", "Hello", "Hey there", "Good morning", "Good evening", "Hi, how are you", "Yo", "Hello again")
_THANKS = ("Thanks", "Thank you", "Great, thanks", "Perfect, thank you", "That's all for now", "Cool, thanks",
           "OK, got it", "Nice work")
_NAMES = (("the number of retries", "max_retries"), ("a user's email address", "user_email"),
          ("whether the cache is enabled", "cache_enabled"), ("the path to the config file", "config_path"),
          ("the list of open connections", "open_connections"), ("a timeout in seconds", "timeout_s"),
          ("the total price of an order", "order_total"), ("the current page number", "page_number"))


def concept(rng: random.Random, _tools: Sequence[str]) -> Ask:
    c, answer = rng.choice(list(CONCEPTS.items()))
    text = either(rng, ("Explain {c}", "Tell me about {c}", "Give me a short explanation of {c}",
                        "Describe {c} in one sentence", "Explain {c} like I'm new to programming"),
                  ("What is {c}?", "What does {c} mean?", "How does {c} work?", "Can you explain {c}?",
                   "What's {c}?", "Why would I use {c}?"), c=c)
    return Ask(text, answer)


def fact(rng: random.Random, _tools: Sequence[str]) -> Ask:
    country, capital = rng.choice(list(FACTS.items()))
    text = question(rng, ("What is the capital of {c}?", "What's the capital city of {c}?",
                          "Which city is the capital of {c}?", "Capital of {c}?"), c=country)
    return Ask(text, f"The capital of {country} is {capital}.")


def arithmetic(rng: random.Random, _tools: Sequence[str]) -> Ask:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op, value = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    text = question(rng, ("What is {a} {op} {b}?", "What's {a} {w} {b}?", "Compute {a} {op} {b}",
                          "How much is {a} {w} {b}?"), a=a, b=b, op=op, w=word)
    return Ask(text, f"{a} {op} {b} = {value}.")


def greeting(rng: random.Random, tools: Sequence[str]) -> Ask:
    text = rng.choice(_GREETINGS) + pick(rng, "!", "", ".", "!!")
    return Ask(text, pick(rng, "Hello! How can I help you today?", "Hi! What can I do for you?",
                          "Hello! What would you like to work on?"))


def thanks(rng: random.Random, tools: Sequence[str]) -> Ask:
    return Ask(rng.choice(_THANKS) + pick(rng, "!", ".", ""), pick(rng, "You're welcome.", "Glad I could help.",
                                                                  "Happy to help. Anything else?"))


def capabilities(rng: random.Random, tools: Sequence[str]) -> Ask:
    text = question(rng, ("What can you do?", "Which tools do you have?", "What tools can you use?",
                          "Who are you?", "How can you help me?"))
    if not tools:
        return Ask(text, "I am GLM, an assistant. I can answer questions and write code; I have no tools here.")
    return Ask(text, f"I am GLM, an assistant. Here I can use these tools: {', '.join(tools)}.")


def naming(rng: random.Random, _tools: Sequence[str]) -> Ask:
    what, name = rng.choice(_NAMES)
    text = either(rng, ("Suggest a variable name for {w}", "Give me a good name for {w}"),
                  ("What should I call a variable holding {w}?", "How would you name {w}?"), w=what)
    return Ask(text, f"`{name}` is a clear name for {what}.")


def missing_tool(ask: Ask) -> Ask:
    """The ask of a tool the chat does not offer: say so instead of calling anything."""
    return Ask(ask.text, pick(random.Random(ask.text), "I can't do that here: none of my tools can.",
                              "I don't have a tool for that in this conversation.",
                              "Sorry, I have no tool that can do this."))


GENERATORS: tuple[Callable[[random.Random, Sequence[str]], Ask], ...] = (
    concept, concept, concept, fact, arithmetic, greeting, thanks, capabilities, naming,
)
