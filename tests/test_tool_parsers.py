"""Tool-call parsers: each format's calls, content and reasoning, typed XML parameters, the errors that keep the
text, and a random round trip through the hermes format."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from proxy.adapters.tool_parsers import PARSERS, FormatParser, Parsed, ToolCall, parser
from proxy.core.values import JsonObject

TOOLS: list[JsonObject] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "background": {"type": "boolean"},
                    "env": {"type": "object"},
                    "args": {"type": "array"},
                    "cwd": {"type": ["null", "string"]},
                    "label": {"type": "string"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}},
]


def hermes(text: str) -> Parsed:
    return parser("hermes").parse(text, TOOLS)


def qwen3_coder(text: str) -> Parsed:
    return parser("qwen3_coder").parse(text, TOOLS)


def llama3(text: str) -> Parsed:
    return parser("llama3_json").parse(text, TOOLS)


def arguments(call: ToolCall) -> Any:
    return json.loads(call.arguments)


def hermes_block(name: str, args: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + "\n</tool_call>"


# Shared by every parser of the think-tag families (Mistral's and harmony's have their own tests)

TAGGED = sorted(name for name, p in PARSERS.items() if isinstance(p, FormatParser))


@pytest.mark.parametrize("name", TAGGED)
def test_plain_text_is_content_with_no_calls(name: str) -> None:
    assert PARSERS[name].parse("  Hello there.\n", TOOLS) == Parsed("Hello there.", None, ())


@pytest.mark.parametrize("name", TAGGED)
def test_reasoning_before_think_end_is_split_off(name: str) -> None:
    assert PARSERS[name].parse("<think>\nhmm\n</think>\n\nDone.", TOOLS) == Parsed("Done.", "hmm", ())
    # The chat template opened the <think>, so only its close is in the sampled text.
    assert PARSERS[name].parse("plan it\n</think>\nDone.", TOOLS) == Parsed("Done.", "plan it", ())
    assert PARSERS[name].parse("<think>\n\n</think>\n\nDone.", TOOLS) == Parsed("Done.", None, ())


@pytest.mark.parametrize("name", TAGGED)
def test_output_cut_off_while_thinking_is_all_reasoning(name: str) -> None:
    assert PARSERS[name].parse("<think>\nfirst, I will", TOOLS) == Parsed(None, "first, I will", ())


@pytest.mark.parametrize("name", TAGGED)
def test_trailing_end_of_turn_markers_are_dropped(name: str) -> None:
    parsed = PARSERS[name].parse("All done.<|im_end|>\n<|endoftext|>", TOOLS)
    assert parsed == Parsed("All done.", None, ())
    assert PARSERS[name].parse("x <|eot_id|> y<|eom_id|>", TOOLS).content == "x <|eot_id|> y"


def test_an_unknown_parser_name_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"^unknown tool_parser 'x': one of harmony, hermes, llama3_json, mistral, qwen3_coder$"
    ):
        parser("x")
    names = ("hermes", "qwen3_coder", "llama3_json", "mistral", "harmony")
    assert {name: p.name for name, p in PARSERS.items()} == {n: n for n in names}


# hermes


def test_hermes_one_call() -> None:
    parsed = hermes('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')
    assert parsed == Parsed(None, None, (ToolCall("bash", '{"command": "ls"}'),))


def test_hermes_two_calls_with_text_before_and_after() -> None:
    text = f"Let me look.\n{hermes_block('bash', {'command': 'ls'})}\n{hermes_block('read', {})}\nThen I decide."
    parsed = hermes(text)
    assert parsed.content == "Let me look.\nThen I decide."
    assert [(c.name, arguments(c)) for c in parsed.tool_calls] == [("bash", {"command": "ls"}), ("read", {})]
    assert parsed.error is None


def test_hermes_reasoning_and_calls() -> None:
    parsed = hermes("<think>\nList the files.\n</think>\n\n" + hermes_block("bash", {"command": "ls"}) + "<|im_end|>")
    assert parsed == Parsed(None, "List the files.", (ToolCall("bash", '{"command": "ls"}'),))


def test_hermes_arguments_written_as_a_json_string_become_the_object() -> None:
    parsed = hermes('<tool_call>\n{"name": "bash", "arguments": "{\\"command\\": \\"héllo\\"}"}\n</tool_call>')
    assert parsed.tool_calls == (ToolCall("bash", '{"command": "héllo"}'),)


def test_hermes_final_block_closed_by_a_stop_token_is_a_call() -> None:
    parsed = hermes('Running it.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n')
    assert parsed == Parsed("Running it.", None, (ToolCall("bash", '{"command": "ls"}'),))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>\n{"name": "bash", "arguments": {"command": ls}}\n</tool_call>', "block 2 is not JSON"),
        (
            '<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call>',
            'block 2 is not an object with a string "name"',
        ),
        ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', 'block 2 is not an object with a string "name"'),
        ('<tool_call>\n{"name": "bash", "arguments": [1]}\n</tool_call>', '"arguments" is not a JSON object'),
        ('<tool_call>\n{"name": "bash", "arguments": {"command": "l', "block 2 (not closed) is not JSON"),
    ],
    ids=["invalid-json", "missing-name", "name-not-a-string", "arguments-not-an-object", "unclosed"],
)
def test_hermes_errors_keep_the_whole_text_as_content(text: str, error: str) -> None:
    parsed = hermes("<think>why</think>\nTrying.\n" + hermes_block("read", {}) + "\n" + text)
    assert parsed.error is not None
    assert parsed.error.startswith("hermes: <tool_call> ")
    assert error in parsed.error
    assert "\n" not in parsed.error
    assert parsed.content == "Trying.\n" + hermes_block("read", {}) + "\n" + text
    assert parsed.reasoning == "why"
    assert parsed.tool_calls == ()


def test_hermes_round_trip_of_random_calls() -> None:
    rng = random.Random(0)
    alphabet = "abcxyz _-/.'\"\\\n\téüß中文字🙂🚀ÅΩ{}[]:,<>"

    def text() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))

    def value(depth: int) -> Any:
        kind = rng.randrange(7 if depth < 3 else 5)
        if kind == 0:
            return text()
        if kind == 1:
            return rng.randint(-(10**12), 10**12)
        if kind == 2:
            return rng.random() * 1000
        if kind == 3:
            return rng.choice([True, False, None])
        if kind == 4:
            return text()
        if kind == 5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {text(): value(depth + 1) for _ in range(rng.randint(0, 3))}

    for _ in range(200):
        calls = [
            ("".join(rng.choice("abcdefgh_") for _ in range(rng.randint(1, 10))), {text(): value(0) for _ in range(3)})
            for _ in range(rng.randint(1, 3))
        ]
        parsed = hermes("\n".join(hermes_block(name, args) for name, args in calls))
        assert parsed.error is None
        assert [(c.name, arguments(c)) for c in parsed.tool_calls] == calls


# qwen3_coder

QWEN_LS = """<tool_call>
<function=bash>
<parameter=command>
ls -la
</parameter>
<parameter=timeout>
30
</parameter>
</function>
</tool_call>"""


def test_qwen3_coder_one_call() -> None:
    assert qwen3_coder(QWEN_LS) == Parsed(None, None, (ToolCall("bash", '{"command": "ls -la", "timeout": 30}'),))


def test_qwen3_coder_two_blocks_and_two_functions_in_one_block() -> None:
    two_functions = (
        "<tool_call>\n<function=read>\n</function>\n"
        "<function=bash>\n<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>"
    )
    parsed = qwen3_coder(f"{QWEN_LS}\n{two_functions}")
    assert [(c.name, arguments(c)) for c in parsed.tool_calls] == [
        ("bash", {"command": "ls -la", "timeout": 30}),
        ("read", {}),
        ("bash", {"command": "pwd"}),
    ]
    assert parsed.content is None


def test_qwen3_coder_text_reasoning_and_a_call_closed_by_a_stop_token() -> None:
    parsed = qwen3_coder(f"<think>\nlook first\n</think>\nI will list.\n\n{QWEN_LS.removesuffix('</tool_call>')}")
    assert parsed == Parsed("I will list.", "look first", (ToolCall("bash", '{"command": "ls -la", "timeout": 30}'),))


def test_qwen3_coder_parameters_take_the_types_of_the_tool_schema() -> None:
    values = {
        "command": "echo 'a'\n  b\n",
        "timeout": "30",
        "ratio": "0.5",
        "background": "True",
        "env": '{"A": "1"}',
        "args": '["-l", 2]',
        "cwd": "null",
        "label": "42",
        "unknown": "7",
    }
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    [call] = qwen3_coder(f"<tool_call>\n<function=bash>\n{body}</function>\n</tool_call>").tool_calls
    assert arguments(call) == {
        "command": "echo 'a'\n  b\n",  # only one newline comes off each end
        "timeout": 30,
        "ratio": 0.5,
        "background": True,
        "env": {"A": "1"},
        "args": ["-l", 2],
        "cwd": None,
        "label": "42",  # a string in the schema stays text, even when it reads as a number
        "unknown": "7",  # no schema, no conversion
    }


def test_qwen3_coder_a_value_that_does_not_fit_its_type_stays_text() -> None:
    body = "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n"
        for k, v in {"timeout": "30s", "ratio": "[1]", "background": "yes", "env": "{not json", "cwd": "/tmp"}.items()
    )
    [call] = qwen3_coder(f"<tool_call>\n<function=bash>\n{body}</function>\n</tool_call>").tool_calls
    assert arguments(call) == {"timeout": "30s", "ratio": "[1]", "background": "yes", "env": "{not json", "cwd": "/tmp"}


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (QWEN_LS.replace("</function>\n", ""), "block 1 is not a sequence of <function=NAME>"),
        (QWEN_LS.removesuffix("</function>\n</tool_call>"), "block 1 (not closed) is not a sequence"),
        (
            QWEN_LS.replace("</parameter>\n<parameter=timeout>", "<parameter=timeout>"),
            "<function=bash>: a <parameter=...> is not closed",
        ),
        ("<tool_call>\nbash ls\n</tool_call>", "block 1 is not a sequence"),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "<function=> needs a name"),
    ],
    ids=["no-function-end", "unclosed", "no-parameter-end", "not-xml", "no-name"],
)
def test_qwen3_coder_errors_keep_the_whole_text_as_content(text: str, error: str) -> None:
    parsed = qwen3_coder("Before.\n" + text)
    assert parsed.error is not None
    assert parsed.error.startswith("qwen3_coder: <tool_call> ")
    assert error in parsed.error
    assert (parsed.content, parsed.tool_calls) == (("Before.\n" + text).strip(), ())


# llama3_json


def test_llama3_one_call_with_or_without_the_python_tag() -> None:
    expected = Parsed(None, None, (ToolCall("bash", '{"command": "ls"}'),))
    assert llama3('{"name": "bash", "parameters": {"command": "ls"}}') == expected
    assert llama3('<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}<|eom_id|>') == expected
    assert llama3('  {"name": "bash", "arguments": {"command": "ls"}}\n<|eot_id|>') == expected


def test_llama3_calls_separated_by_semicolons() -> None:
    parsed = llama3('{"name": "bash", "parameters": {"command": "a; b"}}; {"name": "read", "parameters": {}};')
    assert [(c.name, arguments(c)) for c in parsed.tool_calls] == [("bash", {"command": "a; b"}), ("read", {})]
    assert (parsed.content, parsed.error) == (None, None)


def test_llama3_reasoning_and_a_call() -> None:
    parsed = llama3('<think>need files</think>\n{"name": "bash", "parameters": {"command": "ls"}}')
    assert parsed == Parsed(None, "need files", (ToolCall("bash", '{"command": "ls"}'),))


@pytest.mark.parametrize(
    "text",
    [
        'The answer is {"a": 1}.',
        '{"answer": 42}',
        '{"name": "Ada", "age": 36}',
        '{"name": "bash", "parameters": {"command": "ls"}} and then more',
        '{"name": "bash", "parameters": {',
    ],
)
def test_llama3_untagged_json_that_is_not_a_call_is_plain_content(text: str) -> None:
    assert llama3(text) == Parsed(text, None, ())


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<|python_tag|>{"name": "bash", "parameters": {', "call 1 is not JSON"),
        ('<|python_tag|>{"name": "bash"}', 'call 1 is not an object with "name" and "parameters"'),
        ('<|python_tag|>{"parameters": {}}', 'call 1 is not an object with a string "name"'),
        ('<|python_tag|>{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}', "text after call 1"),
        ('<|python_tag|>{"name": "a", "parameters": {}}; [2]', 'call 2 is not an object with "name"'),
    ],
)
def test_llama3_tagged_output_that_does_not_parse_is_an_error(text: str, error: str) -> None:
    parsed = llama3(text)
    assert parsed.error is not None
    assert parsed.error.startswith("llama3_json: ")
    assert error in parsed.error
    assert (parsed.content, parsed.tool_calls) == (text, ())


def test_llama3_python_tag_before_code_is_plain_content() -> None:
    assert llama3("<|python_tag|>print(1)") == Parsed("<|python_tag|>print(1)", None, ())
