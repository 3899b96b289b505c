"""gpt-oss through openai-harmony, without a model, offline (the o200k vocabulary litellm ships): a continued turn is
the parent's prompt, its sampled ids and the renderer's delta, which equals the full rendering through a tool loop
and differs, once a turn is answered, only where harmony rewrites history (that turn's reasoning dropped, its
`<|return|>` written `<|end|>`); the parser reads back the calls the renderer writes, in both header orders, and what
does not parse comes back as text with an error."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proxy.adapters.harmony_template import HARMONY, HarmonyTemplate, harmony
from proxy.adapters.tool_parsers import parser
from proxy.core.errors import UpstreamError
from proxy.core.values import JsonObject

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
FIRST: tuple[JsonObject, ...] = ({"role": "system", "content": "You are terse."}, {"role": "user", "content": "ls?"})


@pytest.fixture(scope="module")
def template() -> HarmonyTemplate:
    return HarmonyTemplate()


def call(id_: str, command: str) -> JsonObject:
    return {"id": id_, "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": command})}}


@dataclass(frozen=True)
class Step:
    reply: JsonObject  # as the agent gets it back
    sampled: tuple[tuple[str, str, str | None], ...]  # the reply's harmony messages: (channel, text, recipient)
    new: tuple[JsonObject, ...]
    ended: bool = True


STEPS = (
    Step(
        {"role": "assistant", "content": None, "reasoning_content": "List it.", "tool_calls": [call("c1", "ls")]},
        (("analysis", "List it.", None), ("commentary", '{"command": "ls"}', "functions.bash")),
        ({"role": "tool", "tool_call_id": "c1", "content": "a b"},),
    ),
    Step(
        {"role": "assistant", "content": "Two files.", "reasoning_content": "Two."},
        (("analysis", "Two.", None), ("final", "Two files.", None)),
        ({"role": "user", "content": "Sizes?"},),
    ),
    Step(
        {"role": "assistant", "content": None, "reasoning_content": "Use du.", "tool_calls": [call("c2", "du a b")]},
        (("analysis", "Use du.", None), ("commentary", '{"command": "du a b"}', "functions.bash")),
        ({"role": "tool", "tool_call_id": "c2", "content": "4 a\n8 b"},),
    ),
    Step(  # cut by max_tokens while thinking: the agent gets the reasoning alone
        {"role": "assistant", "content": None, "reasoning_content": "a is 4, b"},
        (("analysis", "a is 4, b", None),),
        ({"role": "user", "content": "Go on."},),
        ended=False,
    ),
)


def sampled(step: Step) -> list[int]:
    """The ids the model samples after `<|start|>assistant`, each message as harmony renders it, an answer closed by
    `<|return|>` and a cut reply by nothing."""
    h, encoding = harmony()
    ids: list[int] = []
    for channel, text, recipient in step.sampled:
        message = h.Message.from_role_and_content(h.Role.ASSISTANT, text).with_channel(channel)
        if recipient:
            message = message.with_recipient(recipient).with_content_type("<|constrain|>json")
        ids += encoding.render(message)
    start = encoding.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(start)] == start
    ids = ids[len(start) :]
    if not step.ended:
        return ids[:-1]
    end, answered = (encoding.encode(t, allowed_special="all")[0] for t in ("<|end|>", "<|return|>"))
    return [*ids[:-1], answered] if ids[-1] == end else ids


def episode(template: HarmonyTemplate) -> Iterator[tuple[list[int], list[JsonObject]]]:
    messages = list(FIRST)
    ids = template.prompt(messages, TOOLS)
    yield ids, messages
    for step in STEPS:
        history = [*messages, step.reply]
        assert sampled(step)[-1] in template.stops or not step.ended
        delta = template.delta(step.new, TOOLS, step.ended, history)
        assert delta is not None
        ids = [*ids, *sampled(step), *delta]
        messages = [*history, *step.new]
        yield ids, messages


def test_continuation_differs_from_the_full_rendering_only_where_harmony_rewrites_history(
    template: HarmonyTemplate,
) -> None:
    dropped = r"<\|start\|>assistant<\|channel\|>analysis<\|message\|>(List it\.|Two\.)<\|end\|>"
    seen = []
    for ids, messages in episode(template):
        continued, full = template.decode(ids), template.decode(template.prompt(messages, TOOLS))
        if "<|return|>" not in continued:
            assert ids == template.prompt(messages, TOOLS)  # a tool loop: nothing rewritten, the reasoning stays
            continue
        # harmony writes an answer's <|return|> as <|end|> in history, and while a conversation's last reply is a
        # final answer it drops the reasoning before it: the model saw both as it sampled them
        assert "<|channel|>final<|message|>Two files.<|return|>" in continued and "List it." in continued
        rewritten = continued.replace("<|return|>", "<|end|>")
        if "List it." not in full:
            rewritten = re.sub(dropped, "", rewritten)
        assert rewritten == full
        seen.append("List it." in full)
    assert seen == [False, True, True]  # dropped right after the answer, written again once a tool is called
    assert continued.endswith("a is 4, b<|end|><|start|>user<|message|>Go on.<|end|><|start|>assistant")


def test_the_prompt_holds_the_system_prompt_and_tools_once(template: HarmonyTemplate) -> None:
    text = template.decode(template.prompt(FIRST, TOOLS))
    assert text.startswith("<|start|>system<|message|>") and text.endswith(
        "<|start|>user<|message|>ls?<|end|><|start|>assistant"
    )
    assert "# Instructions\n\nYou are terse." in text and "type bash = (_: {" in text
    assert HarmonyTemplate("high").decode(HarmonyTemplate("high").prompt(FIRST, None)).count("Reasoning: high") == 1
    with pytest.raises(UpstreamError, match=r"^reasoning_effort 'extreme': one of low, medium, high$"):
        HarmonyTemplate("extreme")


def test_a_delta_needs_the_function_a_result_answers(template: HarmonyTemplate) -> None:
    result: JsonObject = {"role": "tool", "tool_call_id": "c9", "content": "ok"}
    assert template.delta([result], TOOLS, True) is None
    named = template.delta([{**result, "name": "bash"}], TOOLS, True)
    assert named is not None and template.decode(named).startswith("<|start|>functions.bash to=assistant")


@pytest.mark.parametrize("step", range(len(STEPS)))
def test_the_parser_reads_back_what_the_renderer_writes(template: HarmonyTemplate, step: int) -> None:
    reply = STEPS[step].reply
    for parsed in (
        parser("harmony").parse(template.decode(sampled(STEPS[step])), TOOLS),
        HARMONY.parse_ids(sampled(STEPS[step]), TOOLS),
    ):
        assert parsed.error is None
        assert (parsed.content, parsed.reasoning) == (reply["content"], reply["reasoning_content"])
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.get("tool_calls", ())]
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


def test_the_parser_reads_the_recipient_after_the_channel_as_models_write_it() -> None:
    text = (
        "<|channel|>analysis<|message|>Both.<|end|><|start|>assistant<|channel|>commentary to=functions.bash "
        '<|constrain|>json<|message|>{"command": "ls"}<|call|>'
    )
    parsed = parser("harmony").parse(text, TOOLS)
    assert (parsed.reasoning, [(c.name, c.arguments) for c in parsed.tool_calls]) == (
        "Both.",
        [("bash", '{"command": "ls"}')],
    )
    preamble = "<|channel|>commentary<|message|>Looking.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert (parser("harmony").parse(preamble, TOOLS).content) == "Looking.\nDone."


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("Just text.", "Unexpected EOS"),
        ("<|channel|>commentary to=functions.bash<|message|>{not json<|call|>", "bash: the arguments are not JSON"),
        ('<|channel|>commentary to=browser.search<|message|>{"q": 1}<|call|>', "not a function tool"),
        ("<|channel|>commentary to=functions.bash<|message|>[1]<|call|>", "not a JSON object"),
    ],
)
def test_what_does_not_parse_is_text_with_an_error(text: str, error: str) -> None:
    parsed = parser("harmony").parse(text, TOOLS)
    assert parsed.content == text and parsed.tool_calls == ()
    assert parsed.error is not None and parsed.error.startswith("harmony: ") and error in parsed.error


def test_the_parser_takes_linear_time_on_a_long_reply() -> None:
    calls = "<|start|>assistant".join(
        f'<|channel|>commentary to=functions.bash<|message|>{{"command": "echo {n}"}}<|call|>' for n in range(1_000)
    )
    assert len(parser("harmony").parse(calls, TOOLS).tool_calls) == 1_000


def test_the_vocabulary_loads_offline_from_the_copy_litellm_ships() -> None:
    _, encoding = harmony()
    assert encoding.name == "HarmonyGptOss"
    assert encoding.decode(encoding.encode("<|call|>", allowed_special="all")) == "<|call|>"
    if "TIKTOKEN_ENCODINGS_BASE" not in os.environ:  # else the vocabulary is the one named there
        cache = Path(os.environ["TIKTOKEN_RS_CACHE_DIR"])
        assert (cache / "fb374d419588a4632f3f557e76b4b70aebbca790").is_file()  # o200k_base, by its URL's SHA-1
