"""Tool-call parsing: template round trip, streaming == one-shot for every split, arguments streamed
in pieces that add up to the whole, lossless fallback."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from glmserve.text.chat import render_chat
from glmserve.text.special_tokens import ASSISTANT, OBSERVATION
from glmserve.text.tool_calls import (
    ParsedOutput,
    StreamDelta,
    ToolCallStreamParser,
    coerce_value,
    merge_call_deltas,
    parse_tool_calls,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit_file",
            "description": "Edit.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "old": {"type": "string"},
                    "new": {"type": "string"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "start_line": {"type": "integer"},
                    "opts": {"type": "object"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "list_dir", "parameters": {"type": "object", "properties": {}}},
    },
]

CALLS: list[dict[str, Any]] = [
    {
        "name": "read_file",
        "arguments": {"path": "json/decoder.py", "start_line": 12, "opts": {"a": [1, None]}},
    },
    {"name": "edit_file", "arguments": {"path": "5", "old": "x = 1\n    y = 'ü'\n", "new": "x = 2  # 😀\n"}},
    {"name": "list_dir", "arguments": {}},
]


def _ids(index: int) -> str:
    return f"call_{index}"  # deterministic, so streamed and one-shot results compare equal


def _assistant_output(text: str) -> str:
    """The generated part of the last assistant turn: after `<|assistant|>\\n`, up to the stop token."""
    start = text.rindex(ASSISTANT + "\n") + len(ASSISTANT) + 1
    return text[start : text.index(OBSERVATION, start)]


def _stream(text: str, cuts: list[int], tools: list[dict[str, Any]] | None = TOOLS, strip: bool = False) -> ParsedOutput:
    """Fed in pieces; checks the deltas' shape: a call's first delta has its id, type and name, the
    later ones only argument pieces, at most one delta per call per feed, calls in index order."""
    parser, content, deltas = ToolCallStreamParser(tools, call_id=_ids, strip_values=strip), "", []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    seen: set[int] = set()
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        indexes = [c["index"] for c in delta.tool_calls]
        assert indexes == sorted(set(indexes))
        for c in delta.tool_calls:
            if c["index"] in seen:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
            else:
                assert c["index"] == len(seen) and c["type"] == "function" and c["id"].startswith("call_")
                assert c["function"]["name"]
                seen.add(c["index"])
        deltas += delta.tool_calls
    return ParsedOutput(content, merge_call_deltas(deltas))


@pytest.mark.parametrize("content", [None, "I'll look at both files.", "Multi\nline ü content:"])
@pytest.mark.parametrize("string_args", [False, True])
def test_template_round_trip(content: str | None, string_args: bool) -> None:
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {
                "name": c["name"],
                "arguments": json.dumps(c["arguments"]) if string_args else c["arguments"],
            },
        }
        for i, c in enumerate(CALLS)
    ]
    messages = [
        {"role": "user", "content": "fix it"},
        {"role": "assistant", "content": content, "tool_calls": calls},
        {"role": "tool", "content": "ok"},
    ]
    out = parse_tool_calls(
        _assistant_output(render_chat(messages, TOOLS, add_generation_prompt=False)), TOOLS
    )
    assert out.content == (content or "")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == [
        (c["name"], c["arguments"]) for c in CALLS
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in out.tool_calls)


GLM_TEXT = (
    "Let me check.\n<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n"
    "<arg_key>start_line</arg_key><arg_value>7</arg_value>\n</tool_call>\n"
    "<tool_call>list_dir</tool_call>\n"
)

STREAM_CASES = [
    GLM_TEXT,
    "plain text with <tags> and a < b and <tool and </tool_call> and tail <tool_call",
    "<tool_call>edit_file<arg_key>path</arg_key><arg_value>x.py</arg_value><arg_key>old</arg_key>"
    "<arg_value>if a < b:</arg_value><arg_key>new</arg_key><arg_value>if a <= b:</arg_value></tool_call>",
    "a<tool_call>bad name</tool_call>b <tool_call>list_dir</tool_call> c <tool_call>read_file<arg_key>k",
    "<tool_call>x<tool_call>list_dir</tool_call>  \n",
    "ü😀<tool_call></tool_call><tool_cal",
    # committed, then broken: a repeated key, stray text, a new call; and a call the output cuts short
    "<tool_call>read_file<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>path</arg_key>"
    "<arg_value>b</arg_value></tool_call>",
    "<tool_call>read_file<arg_key>path</arg_key><arg_value>a</arg_value> junk</tool_call> after",
    "<tool_call>read_file <arg_key>path</arg_key> <arg_value>a</arg_value><tool_call>list_dir</tool_call>",
    "<tool_call>edit_file<arg_key>path</arg_key><arg_value>x</arg_value><arg_key>old</arg_key><arg_value>y",
]


@pytest.mark.parametrize("text", STREAM_CASES)
def test_streaming_matches_one_shot_for_every_split(text: str) -> None:
    want = parse_tool_calls(text, TOOLS, call_id=_ids)
    assert _stream(text, []) == want
    assert _stream(text, list(range(1, len(text)))) == want  # 1-char deltas
    for cut in range(1, len(text)):
        assert _stream(text, [cut]) == want
    rng = random.Random(0)
    for _ in range(50):
        assert (
            _stream(text, sorted(rng.sample(range(1, len(text)), rng.randint(1, min(8, len(text) - 1)))))
            == want
        )


def test_glm_format_with_newlines() -> None:
    out = parse_tool_calls(GLM_TEXT, TOOLS, call_id=_ids)
    assert out.content == "Let me check."  # whitespace around valid calls is not content
    assert out.tool_calls == [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "a.py", "start_line": 7}'},
        },
        {"id": "call_1", "type": "function", "function": {"name": "list_dir", "arguments": "{}"}},
    ]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>read_file<arg_key>path</arg_key><arg_value>a.py",  # unclosed, no complete pair
        "<tool_call><arg_key>path</arg_key><arg_value>a.py</arg_value></tool_call>",  # no name
        "<tool_call>   </tool_call>",
        "<tool_call>read file</tool_call>",  # name with a space
        "<tool_call>f<arg_key>k</arg_key>v</tool_call>",  # value without tags
        "<tool_call>f<arg_key> </arg_key><arg_value>1</arg_value></tool_call>",  # empty key
        "<tool_call>f<arg_value>1</arg_value></tool_call>",
        "stray </tool_call> and <arg_key>k</arg_key><arg_value>v</arg_value>\n",
        "text then <tool_ca",
        "<tool_call",
        "  \n<tool_call>f junk</tool_call>  \n",
    ],
)
def test_malformed_is_kept_as_content(text: str) -> None:
    for cuts in ([], list(range(1, len(text)))):
        out = _stream(text, cuts)
        assert out.tool_calls == [] and out.content == text


def test_malformed_next_to_valid_keeps_every_character() -> None:
    out = parse_tool_calls("<tool_call>x<arg_key>a<tool_call>list_dir</tool_call>tail", call_id=_ids)
    assert out.content == "<tool_call>x<arg_key>atail"
    assert [c["function"]["name"] for c in out.tool_calls] == ["list_dir"]


def test_partial_tag_is_held_back_then_flushed() -> None:
    p = ToolCallStreamParser()
    assert p.feed("Hello <tool_").content == "Hello"
    assert p.feed("ca").content == ""
    assert p.feed("t!").content == " <tool_cat!"
    p = ToolCallStreamParser()
    assert p.feed("x <tool_call").content == "x"
    assert p.finish().content == " <tool_call"


def test_arguments_stream_pair_by_pair() -> None:
    p = ToolCallStreamParser(TOOLS, call_id=_ids)
    assert p.feed("Sure. <tool_call>read_file<arg_key>path</arg_key><arg_value>a.p") == StreamDelta("Sure.")
    first = p.feed("y</arg_value>\n<arg_key>start_line")
    assert first.content == "" and first.tool_calls == [
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"'}}
    ]
    assert p.feed("</arg_key><arg_value>7</arg_value>").tool_calls == [
        {"index": 0, "function": {"arguments": ', "start_line": 7'}}
    ]
    assert p.feed("</tool_call>").tool_calls == [{"index": 0, "function": {"arguments": "}"}}]
    closing = p.feed("<tool_call>list_dir</tool_call>")  # a call without arguments: whole at once
    assert closing.tool_calls == [
        {"index": 1, "id": "call_1", "type": "function", "function": {"name": "list_dir", "arguments": "{}"}}
    ]
    assert p.finish() == StreamDelta()


def test_string_values_stream_as_their_characters_arrive() -> None:
    p = ToolCallStreamParser(TOOLS, call_id=_ids)
    d = p.feed('<tool_call>edit_file<arg_key>path</arg_key><arg_value>x.py</arg_value><arg_key>new</arg_key>'
               '<arg_value>say "hi"')
    assert d.tool_calls == [{"index": 0, "id": "call_0", "type": "function",
                             "function": {"name": "edit_file", "arguments": '{"path": "x.py", "new": "say \\"hi\\"'}}]
    assert p.feed("\nbye</arg").tool_calls == [{"index": 0, "function": {"arguments": "\\nbye"}}]  # the tag waits
    assert p.feed("_value></tool_call>").tool_calls == [{"index": 0, "function": {"arguments": '"}'}}]
    text = "<tool_call>edit_file<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>old</arg_key><arg_value>x "
    cut = parse_tool_calls(text + "</tool_call>tail", TOOLS, call_id=_ids)  # no </arg_value>: ends with the call
    assert json.loads(cut.tool_calls[0]["function"]["arguments"]) == {"path": "a", "old": "x "}
    assert cut.content == "tail"
    stripped = parse_tool_calls(text + " \n", TOOLS, call_id=_ids, strip_values=True)  # cut short, stripped
    assert json.loads(stripped.tool_calls[0]["function"]["arguments"]) == {"path": "a", "old": "x"}


def test_committed_call_cut_short_keeps_its_complete_pairs() -> None:
    text = "<tool_call>read_file<arg_key>path</arg_key><arg_value>a</arg_value><arg_key>start_line</arg_key><arg_v"
    out = parse_tool_calls(text, TOOLS, call_id=_ids)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls] == [
        ("read_file", {"path": "a"})
    ]
    assert out.content == "<arg_key>start_line</arg_key><arg_v"  # the partial pair, kept as text


@pytest.mark.parametrize(
    ("raw", "schema", "want"),
    [
        ("5", None, 5),
        ("5", {"type": "string"}, "5"),
        ("5", {"type": ["string", "null"]}, "5"),
        ("true", {"type": "boolean"}, True),
        ("null", None, None),
        ('{"a": [1]}', None, {"a": [1]}),
        ('"quoted"', None, '"quoted"'),
        ("NaN", None, "NaN"),
        ("{bad", None, "{bad"),
        ("a.py", None, "a.py"),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("x", {"enum": ["x", "y"]}, "x"),
        ("1.5", {"type": "number"}, 1.5),
    ],
)
def test_value_types(raw: str, schema: dict[str, Any] | None, want: Any) -> None:
    assert coerce_value(raw, schema) == want


def test_schema_string_keeps_numeric_looking_value() -> None:
    text = "<tool_call>edit_file<arg_key>path</arg_key><arg_value>123</arg_value></tool_call>"
    assert json.loads(parse_tool_calls(text, TOOLS).tool_calls[0]["function"]["arguments"]) == {"path": "123"}
    assert json.loads(parse_tool_calls(text).tool_calls[0]["function"]["arguments"]) == {"path": 123}


def test_default_ids_are_unique() -> None:
    text = "<tool_call>list_dir</tool_call>" * 3
    ids = [c["id"] for c in parse_tool_calls(text).tool_calls]
    assert len(set(ids)) == 3 and all(i.startswith("call_") for i in ids)


SOUP = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "read_file",
        "edit_file", "list_dir", "path", "start_line", "old", " ", "\n", "a.py", "7", "x<y", "{", "}", "<tool_",
        "</arg", "ü", '"']


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("strip", [False, True])
def test_random_markup_streams_as_it_parses_whole(seed: int, strip: bool) -> None:
    """Random markup soup (well formed calls mixed in): every split gives the one-shot answer, and
    every call's pieces add up to a JSON object."""
    rng = random.Random(seed)
    call = "<tool_call>read_file<arg_key>path</arg_key><arg_value>a.py</arg_value></tool_call>"
    opened = "<tool_call>edit_file<arg_key>path</arg_key><arg_value>b</arg_value><arg_key>old</arg_key><arg_value>"
    for _ in range(150):
        text = "".join(rng.choice(SOUP + [call, opened]) for _ in range(rng.randint(1, 14)))
        want = parse_tool_calls(text, TOOLS, call_id=_ids, strip_values=strip)
        for c in want.tool_calls:
            assert isinstance(json.loads(c["function"]["arguments"]), dict)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 10)))) if len(text) > 1 else []
        assert _stream(text, cuts, strip=strip) == want, text
        assert _stream(text, list(range(1, len(text))), strip=strip) == want, text
