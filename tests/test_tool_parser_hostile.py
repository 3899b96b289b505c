"""Tool-call parsers against hostile output: every parser's time grows linearly with the text whatever the text,
and output that breaks JSON (nesting too deep, a number too long to convert) is read back as text with an error,
never an exception. A model's output is anyone's text: a sampled turn can be any of these."""

from __future__ import annotations

import asyncio
import json
import math
import time
import timeit

import pytest

from proxy.adapters.parsed import Parsed
from proxy.adapters.parsers import PARSERS
from proxy.adapters.parsers import deepseek_v3 as deepseek
from tests.test_tool_parsers import TOOLS  # bash: command a string, timeout an integer, env an object

# Each a piece that repeats: formats' tags opened and never closed (one scan per tag opened would be quadratic),
# calls and markers by the thousand (a copy of what is left per one would be too), each family's own markers
# among them. Applied to every parser: a parser may meet any other's format.
REPEATED = {
    "unclosed <function=>": "<function=a>\n",
    "unclosed <parameter=>": "<parameter=x>\n",
    "closed parameters": "<parameter=command>\nls\n</parameter>\n",
    "closed functions": "<function=bash>\n<parameter=timeout>\n7\n</parameter>\n</function>\n",
    "<tool_call> opened": "<tool_call>",
    "hermes blocks": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n',
    "json calls": '{"name": "bash", "parameters": {"command": "ls"}}; ',
    "end markers": "<|im_end|>\n",
    "<think> opened": "<think>",
    "</think> closed": "a</think>",
    "nesting": "[{",
    "long word": "a",
    "DeepSeek calls begun": deepseek.CALLS_BEGIN,
    "DeepSeek call begun": deepseek.CALL_BEGIN,
    "DeepSeek calls": deepseek.CALL_BEGIN + "bash" + deepseek.SEP + '{"command": "ls"}' + deepseek.CALL_END,
    "GLM keys opened": "<arg_key>",
    "GLM values opened": "<arg_value>",
    "GLM pairs": "<arg_key>command</arg_key><arg_value>ls</arg_value>",
    "Kimi sections begun": "<|tool_calls_section_begin|>",
    "Kimi call begun": "<|tool_call_begin|>",
    "Kimi calls": "<|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "Mistral calls begun": "[TOOL_CALLS]",
    "Mistral calls": '[TOOL_CALLS]bash[ARGS]{"command": "ls"}',
    "Mistral ends": "</s>",
    "harmony channels": "<|channel|>",
    "harmony message starts": "<|message|>",
    "harmony starts": "<|start|>",
    "harmony calls": "<|start|>assistant<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{}<|call|>",
}
AROUND = {  # what the repeated piece is put in: (before, after)
    "bare": ("", ""),
    "an unclosed <tool_call>": ("<tool_call>\n", ""),
    "a closed <function=bash>": ("<tool_call>\n<function=bash>\n", "</function>\n</tool_call>"),
}
SMALL = 16_000  # characters; the large text is eight times as long
NAMES = sorted(PARSERS)  # every parser, by the name an episode gives


def text(piece: str, around: str, size: int) -> str:
    before, after = AROUND[around]
    return before + piece * (size // len(piece)) + after


def seconds_per_parse(name: str, sample: str, number: int, repeat: int = 3) -> float:
    """The fastest of `repeat` timings (garbage collection off, as timeit does), per parse, in this process's CPU
    time: other processes on a busy machine take turns on its cores, not CPU time from this one."""
    timer = timeit.Timer(lambda: PARSERS[name].parse(sample, TOOLS), timer=time.process_time)
    return min(timer.repeat(repeat=repeat, number=number)) / number


@pytest.mark.timeout(120)
@pytest.mark.parametrize("around", sorted(AROUND))
@pytest.mark.parametrize("piece", sorted(REPEATED))
@pytest.mark.parametrize("name", NAMES)
def test_parsing_time_grows_linearly_with_the_output(name: str, piece: str, around: str) -> None:
    small, large = (text(REPEATED[piece], around, size) for size in (SMALL, 8 * SMALL))
    once = seconds_per_parse(name, small, 1)
    number = max(1, math.ceil(0.005 / max(once, 1e-7)))  # enough parses of the small text to time it to ~5 ms
    floor = seconds_per_parse(name, small, number)
    took = seconds_per_parse(name, large, max(1, number // 8))
    if took >= 24 * floor:  # caches shared with other work can still slow a timing, never speed one: both again
        floor = seconds_per_parse(name, small, number, repeat=9)
        took = seconds_per_parse(name, large, max(1, number // 8), repeat=9)
    # Linear: about 8 times the small text's time. Quadratic: about 64 times.
    assert took < 24 * floor, f"{name} on {piece!r} in {around}: {took:.4f} s for 8x the text, against {floor:.5f} s"


DEEP = 100_000  # far past Python's recursion limit
LONG_NUMBER = "7" * 5_000  # past Python's 4,300 digits for converting text to an int
BREAKING = {
    "hermes": [
        '<tool_call>\n{"name": "bash", "arguments": ' + "[" * DEEP + "\n</tool_call>",
        '<tool_call>\n{"name": "bash", "arguments": ' + "[" * DEEP + "]" * DEEP + "}\n</tool_call>",
        '<tool_call>\n{"name": "bash", "arguments": {"timeout": ' + LONG_NUMBER + "}}\n</tool_call>",
        '<tool_call>\n{"name": "bash", "arguments": "{\\"timeout\\": ' + LONG_NUMBER + '}"}\n</tool_call>',
    ],
    "llama3_json": [
        '<|python_tag|>{"name": "bash", "parameters": ' + '{"a": ' * DEEP,
        '<|python_tag|>{"name": "bash", "parameters": {"timeout": ' + LONG_NUMBER + "}}",
        '<|python_tag|>{"name": "bash", "parameters": {}}; {"name": "bash", "parameters": {"t": ' + LONG_NUMBER + "}}",
    ],
    "deepseek_v3": [
        deepseek.CALLS_BEGIN + deepseek.CALL_BEGIN + "bash" + deepseek.SEP + "[" * DEEP,
        deepseek.CALLS_BEGIN + deepseek.CALL_BEGIN + "bash" + deepseek.SEP + '{"t": ' + LONG_NUMBER + "}",
    ],
    "kimi_k2": [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>" + "[" * DEEP,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>"
        '{"t": ' + LONG_NUMBER + "}<|tool_call_end|>",
    ],
    "mistral": [
        "[TOOL_CALLS]" + "[" * DEEP,
        '[TOOL_CALLS][{"name": "bash", "arguments": {"t": ' + LONG_NUMBER + "}}]",
        "[TOOL_CALLS]bash[ARGS]" + '{"a": ' * DEEP,
        '[TOOL_CALLS]bash[ARGS]{"t": ' + LONG_NUMBER + "}",
    ],
    "harmony": [
        "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>" + "[" * DEEP + "<|call|>",
        '<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{"t": ' + LONG_NUMBER + "}<|call|>",
    ],
}


@pytest.mark.parametrize("name", sorted(BREAKING))
def test_json_too_deep_or_a_number_too_long_is_text_with_an_error(name: str) -> None:
    for output in BREAKING[name]:
        parsed = PARSERS[name].parse(output, TOOLS)
        assert parsed.tool_calls == () and parsed.content == output.strip()
        assert parsed.error and parsed.error.startswith(f"{name}: ") and "\n" not in parsed.error


def test_qwen3_coder_keeps_as_text_a_parameter_its_type_cannot_hold() -> None:
    deep = "[" * DEEP + "]" * DEEP
    output = (
        "<tool_call>\n<function=bash>\n<parameter=timeout>\n" + LONG_NUMBER + "\n</parameter>\n"
        "<parameter=env>\n" + deep + "\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = PARSERS["qwen3_coder"].parse(output, TOOLS).tool_calls
    assert json.loads(call.arguments) == {"timeout": LONG_NUMBER, "env": deep}


def test_glm45_keeps_as_text_a_value_json_cannot_hold() -> None:
    deep = "[" * DEEP + "]" * DEEP
    output = (
        "<tool_call>bash\n<arg_key>t</arg_key><arg_value>" + LONG_NUMBER + "</arg_value>"
        "<arg_key>e</arg_key><arg_value>" + deep + "</arg_value></tool_call>"
    )
    (call,) = PARSERS["glm45"].parse(output, TOOLS).tool_calls
    assert json.loads(call.arguments) == {"t": LONG_NUMBER, "e": deep}


@pytest.mark.parametrize("name", NAMES)
def test_no_output_makes_a_parser_raise_even_on_a_thread(name: str) -> None:
    """Every parser, including ones whose format is not above, on every breaking output (read on a thread too,
    where the served path reads a long one)."""
    outputs = [output for outputs in BREAKING.values() for output in outputs]
    outputs += ["<tool_call>\n" + "[" * DEEP, "<tool_call>\n<function=bash>\n" + "<parameter=env>\n{" * DEEP]
    outputs += ["<tool_call>bash<arg_key>env</arg_key><arg_value>" + "[" * DEEP + "</arg_value></tool_call>"]
    for output in outputs:
        for parsed in (
            PARSERS[name].parse(output, TOOLS),
            asyncio.run(asyncio.to_thread(PARSERS[name].parse, output, TOOLS)),
        ):
            assert isinstance(parsed, Parsed)
            assert parsed.tool_calls or parsed.content, "the text is lost"
