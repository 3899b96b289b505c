"""Mistral through mistral-common, without a model: a continued turn is the parent's prompt, its sampled ids and the
renderer's delta, which equals the full rendering where nothing moves (v13) and differs only by the documented moves
where the tools (v7) and the system prompt (v3) follow the last user message; the parser reads back the calls the
renderer writes (parallel calls, their ids, reasoning), and what does not parse comes back as text with an error."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.adapters.mistral_template import MistralTemplate, call_id, load
from proxy.adapters.tool_parsers import parser
from proxy.core.errors import UpstreamError
from proxy.core.values import JsonObject

_SPEC = importlib.util.find_spec("mistral_common")
assert _SPEC is not None and _SPEC.origin is not None
SHIPPED = Path(_SPEC.origin).parent / "data" / "tekken_240718.json"  # Mistral Nemo's tokenizer, v3, in the wheel
# in mistral-common's order; from v11 a tokenizer file must list its special tokens
SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
)
SYSTEM = "You are terse."
TOOLS: list[JsonObject] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def tekken(folder: Path, version: str, specials: bool) -> Path:
    """A tokenizer of another version made from the shipped vocabulary, as mistral-common reads tekken files: its
    first 20,000 ranks (a quicker load; every byte is among them), the version, and the special tokens listed."""
    data = json.loads(SHIPPED.read_text(encoding="utf-8"))
    data["vocab"] = data["vocab"][:20_000]
    data["config"].update(version=version, default_vocab_size=21_000, num_vocab_tokens=20_000)
    if specials:
        data["special_tokens"] = [{"rank": i, "token_str": t, "is_control": True} for i, t in enumerate(SPECIALS)]
    path = folder / version / "tekken.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data), encoding="utf-8")
    return path.parent


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MistralTemplate]:
    folder = tmp_path_factory.mktemp("tekken")
    return {
        "v3": load(str(SHIPPED)),
        "v7": load(str(tekken(folder, "v7", specials=False))),
        "v13": load(str(tekken(folder, "v13", specials=True))),
    }


def call(id_: str, command: str) -> JsonObject:
    return {"id": id_, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}


@dataclass(frozen=True)
class Step:
    reply: JsonObject  # as the agent gets it back (and hands it back)
    new: tuple[JsonObject, ...]  # the messages the agent adds after it
    ended: bool = True


# Reasoning is on every reply: a tokenizer without [THINK] leaves it out, v13 writes it in every turn.
STEPS = (
    Step(
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two looks at once.",
            "tool_calls": [call("a1b2c3d4e", "ls /tmp"), call("f5g6h7i8j", "cat /tmp/notes")],
        },
        (
            {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "notes\nlog"},
            {"role": "tool", "tool_call_id": "f5g6h7i8j", "content": '{"lines": 2}'},
        ),
    ),
    Step(
        {"role": "assistant", "content": "Two files: notes and log.", "reasoning_content": "Done."},
        ({"role": "user", "content": "Count the lines of log too."},),
    ),
    Step(
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "One call.",
            "tool_calls": [call("k1l2m3n4o", "wc -l log")],
        },
        ({"role": "tool", "tool_call_id": "k1l2m3n4o", "content": "7 log"},),
    ),
    Step(  # cut by max_tokens: the reply holds what was sampled, and no </s>
        {"role": "assistant", "content": "log has seven lines, and", "reasoning_content": "Counted."},
        ({"role": "user", "content": "Go on."},),
        ended=False,
    ),
)
FIRST: tuple[JsonObject, ...] = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is in /tmp?"})


def sampled(template: MistralTemplate, reply: JsonObject, ended: bool) -> list[int]:
    """The ids the model samples for `reply`: what the renderer writes for it after a user message."""
    question: list[JsonObject] = [{"role": "user", "content": "q"}]
    asked = template.prompt(question, None)
    after = template.prompt([*question, reply, {"role": "user", "content": "r"}], None)
    assert after[: len(asked)] == asked
    written = after[len(asked) : after.index(template.end_of_turn, len(asked)) + 1]
    return written if ended else written[:-1]


def episode(template: MistralTemplate) -> Iterator[tuple[list[int], list[JsonObject]]]:
    """Each call's ids as tokens mode builds them, with the call's messages: in full first, then continued."""
    messages = list(FIRST)
    ids = template.prompt(messages, TOOLS)
    yield ids, messages
    for step in STEPS:
        history = [*messages, step.reply]
        delta = template.delta(step.new, TOOLS, step.ended, history)
        assert delta is not None
        ids = [*ids, *sampled(template, step.reply, step.ended), *delta]
        messages = [*history, *step.new]
        yield ids, messages


def without(text: str, *pieces: str) -> str:
    for piece in pieces:
        text = re.sub(piece, "", text, flags=re.DOTALL)
    return text


def test_v13_continuation_is_the_full_rendering_at_every_call(templates: dict[str, MistralTemplate]) -> None:
    template = templates["v13"]
    assert template.thinks
    calls = list(episode(template))
    for ids, messages in calls:
        assert ids == template.prompt(messages, TOOLS)
    text = template.decode(calls[-1][0])
    assert text.count("[AVAILABLE_TOOLS]") == 1 and text.count("[SYSTEM_PROMPT]") == 1
    assert "[THINK]Two looks at once.[/THINK][TOOL_CALLS]bash[ARGS]" in text  # reasoning kept, calls without ids
    assert "log has seven lines, and</s>[INST]Go on.[/INST]" in text  # the cut reply closed where it was cut


@pytest.mark.parametrize("version", ["v3", "v7"])
def test_continuation_differs_from_the_full_rendering_only_where_the_last_user_message_moved(
    templates: dict[str, MistralTemplate], version: str
) -> None:
    template = templates[version]
    assert not template.thinks  # no [THINK]: reasoning has no place in these prompts
    tools_block = r"\[AVAILABLE_TOOLS\].*?\[/AVAILABLE_TOOLS\]"
    moved = (tools_block, re.escape(SYSTEM) + r"\n\n") if version == "v3" else (tools_block,)
    for ids, messages in episode(template):
        continued, full = template.decode(ids), template.decode(template.prompt(messages, TOOLS))
        users = sum(m["role"] == "user" for m in messages)
        assert continued.count("[AVAILABLE_TOOLS]") == users and full.count("[AVAILABLE_TOOLS]") == 1
        assert continued.count(SYSTEM) == (users if version == "v3" else 1)
        assert without(continued, *moved) == without(full, *moved)
        if users == 1:
            assert ids == template.prompt(messages, TOOLS)  # tool results only: nothing moved
    assert '"call_id": "f5g6h7i8j"' in continued or "f5g6h7i8j[TOOL_CONTENT]" in continued


@pytest.mark.parametrize("version", ["v3", "v7", "v13"])
def test_the_delta_does_not_depend_on_how_the_reply_was_written(
    templates: dict[str, MistralTemplate], version: str
) -> None:
    template = templates[version]
    new = STEPS[1].new
    kept = template.delta(new, TOOLS, True, [*FIRST, STEPS[1].reply])
    dropped = template.delta(new, TOOLS, True, [*FIRST, {"role": "assistant", "content": "Two files."}])
    assert kept == dropped is not None
    results = STEPS[0].new  # the calls answered are found from the results alone when the reply is not at hand
    assert template.delta(results, TOOLS, True, [*FIRST, STEPS[0].reply]) == template.delta(results, TOOLS, True)
    assert template.delta([{"role": "assistant", "content": "again"}], TOOLS, True) is None


@pytest.mark.parametrize("version", ["v3", "v7", "v13"])
def test_the_parser_reads_back_the_calls_the_renderer_writes(
    templates: dict[str, MistralTemplate], version: str
) -> None:
    template = templates[version]
    reply = STEPS[0].reply
    parsed = parser("mistral").parse(template.decode(sampled(template, reply, ended=True)), TOOLS)
    assert parsed.error is None and parsed.content is None
    assert parsed.reasoning == ("Two looks at once." if template.thinks else None)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("bash", {"command": "ls /tmp"}),
        ("bash", {"command": "cat /tmp/notes"}),
    ]
    ids = [c.id for c in parsed.tool_calls]
    assert ids == ([None, None] if version == "v13" else ["a1b2c3d4e", "f5g6h7i8j"])  # v13 writes no ids


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello.</s>", ("Hello.", None, [])),
        ('[TOOL_CALLS]bash[CALL_ID]abc123XYZ[ARGS]{"command": "ls"}</s>', (None, None, [("bash", "abc123XYZ")])),
        ("<think>plan</think>Fine.", ("Fine.", "plan", [])),  # Magistral's plain-text tags before [THINK]
        ("[THINK]still thinking", (None, "still thinking", [])),
        (
            'Checking.[TOOL_CALLS][{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}]',
            ("Checking.", None, [("bash", None)]),
        ),
    ],
)
def test_the_parser_reads_each_form(
    text: str, expected: tuple[str | None, str | None, list[tuple[str, str | None]]]
) -> None:
    parsed = parser("mistral").parse(text, TOOLS)
    assert parsed.error is None
    assert (parsed.content, parsed.reasoning, [(c.name, c.id) for c in parsed.tool_calls]) == expected


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[TOOL_CALLS][{"name": "bash", "arguments": {', "[TOOL_CALLS] 1 is not JSON"),
        ("[TOOL_CALLS]bash{}", "neither a JSON list of calls nor NAME[ARGS]"),
        ("[TOOL_CALLS]bash[ARGS][1]", "the arguments are not a JSON object"),
        ('[TOOL_CALLS][{"arguments": {}}]', 'is not an object with a string "name"'),
    ],
)
def test_what_does_not_parse_is_text_with_an_error(text: str, error: str) -> None:
    parsed = parser("mistral").parse(text + "</s>", TOOLS)
    assert parsed.content == text and parsed.tool_calls == ()
    assert parsed.error is not None and parsed.error.startswith("mistral: ") and error in parsed.error


def test_the_parser_takes_linear_time_on_a_long_reply() -> None:
    calls = "".join(f'[TOOL_CALLS]bash[ARGS]{{"command": "echo {n}"}}' for n in range(20_000))
    assert len(parser("mistral").parse(calls, TOOLS).tool_calls) == 20_000


def test_foreign_call_ids_become_nine_letters_the_same_each_time() -> None:
    assert call_id("a1b2c3d4e") == "a1b2c3d4e"
    derived = call_id("call_0193abcdef0123456789")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", derived) and derived == call_id("call_0193abcdef0123456789")
    assert derived != call_id("call_0193abcdef0123456788")


def test_what_mistral_common_refuses_is_one_clear_error(templates: dict[str, MistralTemplate], tmp_path: Path) -> None:
    with pytest.raises(UpstreamError, match="cannot render this conversation"):
        templates["v3"].prompt([{"role": "tool", "tool_call_id": "x", "content": "?"}], None)
    with pytest.raises(UpstreamError, match="no Mistral tokenizer could be loaded"):
        load(str(tmp_path))
