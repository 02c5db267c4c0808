"""The tools offered in glm52-tiny's training chats: specs with spelling variants, rendered per chat.

A spec names a tool's concept; each chat renders it with one of its names, descriptions and key
spellings, and drops some optional parameters, so the model learns to read the schema it is given
(the key to write, whether a parameter exists) instead of memorizing one schema per tool.
Arguments are produced under canonical keys (the first spelling) and mapped to the rendered ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class Param:
    keys: tuple[str, ...]  # spellings; the first is the canonical key the ask generators use
    type: str
    description: str
    required: bool = True
    enum: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolSpec:
    names: tuple[str, ...]
    descriptions: tuple[str, ...]
    params: tuple[Param, ...]

    @property
    def canonical(self) -> str:
        return self.names[0]


@dataclass(frozen=True)
class RenderedTool:
    spec: ToolSpec
    name: str
    keys: dict[str, str]  # canonical key -> rendered key, for the parameters the schema shows
    schema: Message  # OpenAI tool format

    def args(self, canonical_args: dict[str, Any]) -> dict[str, Any]:
        """The arguments under the rendered keys; parameters the schema does not show are dropped."""
        return {self.keys[k]: v for k, v in canonical_args.items() if k in self.keys}


def _p(keys: str, type_: str, description: str, required: bool = True, enum: tuple[str, ...] = ()) -> Param:
    return Param(tuple(keys.split("|")), type_, description, required, enum)


def _spec(names: str, descriptions: tuple[str, ...], *params: Param) -> ToolSpec:
    return ToolSpec(tuple(names.split("|")), descriptions, params)


SPECS: tuple[ToolSpec, ...] = (
    _spec(
        "read_file|view_file|open_file",
        ("Read a text file, optionally only a range of lines (1-based, inclusive).", "Return the contents of a file."),
        _p("path|file_path|filename", "string", "Path of the file."),
        _p("start_line|start", "integer", "First line.", False),
        _p("end_line|end", "integer", "Last line.", False),
    ),
    _spec(
        "list_dir|list_directory|ls",
        ("List the entries of a directory.", "List files and folders in a directory."),
        _p("path|directory|dir", "string", "Directory path."),
    ),
    _spec(
        "grep|search_code|search_files",
        ("Search files under a path for a regular expression.", "Find lines matching a pattern."),
        _p("pattern|query|regex", "string", "Regular expression."),
        _p("path|directory", "string", "File or directory.", False),
    ),
    _spec(
        "run_tests|pytest",
        ("Run pytest on a file or directory and return its output.", "Run the test suite."),
        _p("path|target", "string", "Test file or directory."),
        _p("verbose", "boolean", "Pass -v.", False),
    ),
    _spec(
        "edit_file|replace_in_file",
        ("Replace the exact text `old` with `new` in a file.", "Edit a file by replacing text."),
        _p("path|file_path", "string", "File to edit."),
        _p("old|old_text|search", "string", "Text to replace."),
        _p("new|new_text|replacement", "string", "Replacement text."),
    ),
    _spec(
        "run_command|bash|shell",
        ("Run a shell command in the repository root.", "Execute a command and return its output."),
        _p("command|cmd", "string", "The command line."),
    ),
    _spec(
        "write_file|create_file",
        ("Create or overwrite a file with the given content.", "Write text to a file."),
        _p("path|file_path", "string", "File to write."),
        _p("content|text", "string", "The full new content."),
    ),
    _spec(
        "get_weather|weather|current_weather",
        ("Get the current weather for a city.", "Current temperature and conditions at a location."),
        _p("city|location", "string", "City name."),
        _p("unit|units", "string", "Temperature unit.", False, ("celsius", "fahrenheit")),
    ),
    _spec(
        "search_web|web_search|google",
        ("Search the web and return the top results.", "Look something up on the internet."),
        _p("query|q", "string", "What to search for."),
        _p("max_results|limit|num_results", "integer", "How many results.", False),
    ),
    _spec(
        "send_email|email",
        ("Send an email.", "Send an email message to someone."),
        _p("to|recipient", "string", "Email address of the recipient."),
        _p("subject", "string", "Subject line."),
        _p("body|message|text", "string", "The message."),
    ),
    _spec(
        "set_timer|start_timer",
        ("Start a countdown timer.", "Set a timer that rings after some minutes."),
        _p("minutes|duration_minutes", "integer", "Length of the timer in minutes."),
        _p("label|name", "string", "What the timer is for.", False),
    ),
    _spec(
        "get_stock_price|stock_quote",
        ("Get the latest price of a stock.", "Current share price for a ticker symbol."),
        _p("symbol|ticker", "string", "Ticker symbol, e.g. IBM."),
    ),
    _spec(
        "translate|translate_text",
        ("Translate text into another language.", "Machine translation."),
        _p("text", "string", "Text to translate."),
        _p("target_language|to|language", "string", "Language to translate into."),
    ),
    _spec(
        "convert_currency|currency_convert",
        ("Convert an amount between currencies.", "Currency conversion at today's rate."),
        _p("amount", "number", "Amount of money."),
        _p("from_currency|source", "string", "Currency code to convert from."),
        _p("to_currency|target", "string", "Currency code to convert to."),
    ),
    _spec(
        "create_event|add_calendar_event|schedule_event",
        ("Add an event to the user's calendar.", "Create a calendar entry."),
        _p("title|summary", "string", "Title of the event."),
        _p("date|day", "string", "Date as YYYY-MM-DD."),
        _p("time|start_time", "string", "Start time as HH:MM.", False),
    ),
    _spec(
        "get_time|current_time|world_clock",
        ("Get the current local time in a city.", "What time it is somewhere."),
        _p("city|location", "string", "City name."),
    ),
    _spec(
        "install_package|pip_install",
        ("Install a Python package with pip.", "Install a package into the environment."),
        _p("package|name", "string", "Package name."),
        _p("version", "string", "Exact version to install.", False),
    ),
    _spec(
        "git_commit|commit",
        ("Commit the staged changes.", "Create a git commit of the current changes."),
        _p("message|msg", "string", "Commit message."),
    ),
    _spec(
        "fetch_url|http_get",
        ("Download a web page or API response.", "Fetch the content at a URL."),
        _p("url", "string", "The URL."),
    ),
    _spec(
        "query_database|run_sql|sql_query",
        ("Run a SQL query against the project database.", "Execute SQL and return the rows."),
        _p("query|sql", "string", "The SQL statement."),
    ),
)

SPECS_BY_NAME: dict[str, ToolSpec] = {s.canonical: s for s in SPECS}
CODING_TOOLS = ("read_file", "list_dir", "grep", "run_tests", "edit_file", "run_command", "write_file")


def _schema(name: str, description: str, params: list[tuple[str, Param]], described: bool = True) -> Message:
    props: Message = {}
    for key, p in params:
        props[key] = {"type": p.type, "description": p.description} if described else {"type": p.type}
        if p.enum:
            props[key]["enum"] = list(p.enum)
    required = [key for key, p in params if p.required]
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def render(spec: ToolSpec, rng: random.Random, variety: float = 0.35) -> RenderedTool:
    """One rendering of `spec`: canonical spellings with probability 1 - variety, each optional
    parameter shown with probability 0.7, parameter descriptions with probability 0.6."""

    def choose(options: tuple[str, ...]) -> str:
        return options[0] if rng.random() >= variety else rng.choice(options)

    params = [(choose(p.keys), p) for p in spec.params if p.required or rng.random() < 0.7]
    name, description = choose(spec.names), choose(spec.descriptions)
    keys = {p.keys[0]: key for key, p in params}
    return RenderedTool(spec, name, keys, _schema(name, description, params, rng.random() < 0.6))


def canonical_schema(name: str) -> Message:
    """A tool with every parameter, under its canonical spellings (what tests and docs show)."""
    spec = SPECS_BY_NAME[name]
    return _schema(spec.canonical, spec.descriptions[0], [(p.keys[0], p) for p in spec.params])
