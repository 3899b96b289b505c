"""Each model family's entry, checked on the CPU with no model: a tokenizer made on the spot and a template written
to the family's documented rules (`testkit/family_checks.py`). Over a multi-turn episode with a tool call, parallel
tool calls, reasoning kept and dropped, a user turn in the middle and a reply cut by `max_tokens`, every turn
continues its parent append-only (its ids are the parent's prompt and sampled ids, then what the template writes
for the new messages), and the family's parser reads back what its template writes for tool calls."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from proxy.adapters.chat_templates import ChatTemplate, first_difference, template_text
from proxy.adapters.chat_templates import renderer as renderer_of
from proxy.adapters.parsers import parser
from proxy.adapters.served_tokens import FIRST_CALL, _prompt, _reply_message
from proxy.core.errors import UpstreamError
from proxy.core.values import Reply, Turn, TurnStatus
from proxy.families import FAMILIES, detect, named
from testkit.family_checks import tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    },
]
OPTIONS: dict[str, dict[str, Any]] = {"deepseek-v3": {"thinking": True}}


def renderer(name: str) -> ChatTemplate:
    family = named(name)
    return ChatTemplate(tokenizer(name), None, {**family.template_kwargs, **OPTIONS.get(name, {})}, family)


def call(name: str, arguments: dict[str, Any], index: int) -> dict[str, Any]:
    # Kimi K2's ids say the function and its place; the others' are opaque
    return {"id": f"functions.{name}:{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


def sampled_text(t: ChatTemplate, messages: list[Any], reply: dict[str, Any], stops_on: str) -> str:
    """What a model trained on the template samples for `reply`: what the template writes for it as the last turn,
    after the generation prompt, to its end-of-turn (GLM: then the role token it stops on)."""
    prompt = t.render(messages, TOOLS, True)
    whole = t.render([*messages, reply], TOOLS, False)
    assert whole.startswith(prompt), (prompt[-80:], whole[len(prompt) - 80 :])
    text = whole[len(prompt) :]
    if t.family.ends_with_next_header:
        return text + stops_on
    end = t.family.end_of_turn[0]
    return text[: text.index(end) + len(end)]


class Episode:
    """An agent's history and the turns token in, token out made of it."""

    def __init__(self, t: ChatTemplate) -> None:
        self.t = t
        self.history: list[Any] = [{"role": "system", "content": "Run commands."}, {"role": "user", "content": "go"}]
        self.turns: list[Turn] = []

    def call(self) -> tuple[list[int], str | None, str | None]:
        parent = self.turns[-1] if self.turns else None
        ids, continued, why = _prompt(self.t, [dict(m) for m in self.history], TOOLS, parent)
        return list(ids), continued, why

    def answer(self, ids: list[int], text: str, cut: int | None = None) -> dict[str, Any]:
        """The model's reply (its sampled ids, `cut` to a few), as the agent gets it, which the agent hands back
        without its reasoning and with its arguments re-serialised."""
        sampled = self.t.encode(text)[:cut]
        message, error = asyncio.run(_reply_message(self.t.decode(sampled), TOOLS, self.t.family.tool_parser))
        assert error is None, error
        reply = Reply(message=message, prompt_token_ids=tuple(ids), completion_token_ids=tuple(sampled))
        seq = len(self.turns)
        request = {"messages": list(self.history)}
        self.turns.append(Turn(f"t{seq}", "e", seq, "chat", request, b"", False, TurnStatus.ANSWERED, 0.0, reply=reply))
        handed = {"role": "assistant", "content": message["content"]}
        if message.get("tool_calls"):
            handed["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.dumps(json.loads(c["function"]["arguments"]))}}
                for c in message["tool_calls"]
            ]
        self.history.append(handed)
        return message


def continues(episode: Episode, ids: list[int], continued: str | None, truth: str, cut: bool = False) -> str:
    """Checks that a call continued its parent append-only and that what it adds is what the template writes after
    the reply; returns the text of the whole prompt."""
    t, parent = episode.t, episode.turns[-1]
    assert parent.reply is not None and continued == parent.id
    before = [*(parent.reply.prompt_token_ids or ()), *(parent.reply.completion_token_ids or ())]
    assert ids[: len(before)] == before  # the parent's prompt and sampled ids, untouched
    added = ids[len(before) :]
    if cut and not t.family.ends_with_next_header:  # a reply cut short is closed as the template closes one
        assert added[0] == t.end_of_turn
        added = added[1:]
    tail = t.decode(added)
    assert tail and truth.endswith(tail), (tail, truth[-200:])
    if t.family.ends_with_next_header:
        assert tail.startswith("\n") or cut
    else:
        assert truth[: -len(tail)].endswith(t.family.end_of_turn[0])  # cut right after a reply's end
    return t.decode(ids)


JINJA = [family.name for family in FAMILIES if family.renderer == "jinja"]  # the others: test_*_template.py


@pytest.mark.parametrize("name", JINJA)
def test_the_family_is_found_from_its_tokenizer(name: str) -> None:
    made = tokenizer(name)
    options = named(name).template_kwargs
    assert detect(template_text(made, None), set(made.get_added_vocab()), options).name == name


@pytest.mark.parametrize("name", JINJA)
def test_the_template_encodes_text_as_its_tokenizer_does(name: str) -> None:
    t, made = renderer(name), tokenizer(name)  # encoded through the Rust tokenizer's batch without offsets
    specials = "".join(made.all_special_tokens)
    for text in ("", " ", "ls -la\n\n  tests: 3 ok\r\n", f"{specials}caf\u00e9 \u2063x\u2063 {specials[::-1]}\n"):
        assert t.encode(text) == made.encode(text, add_special_tokens=False)
        ids = made.encode(text, add_special_tokens=False)
        assert t.decode(tuple(ids)) == made.decode(ids, skip_special_tokens=False)  # the Rust decode, directly


def test_where_two_texts_first_differ_is_found_a_block_at_a_time_as_a_character_at_a_time() -> None:
    def naive(a: str, b: str) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))

    base = "".join(chr(97 + (i * 7) % 26) for i in range(10_000))
    cases = [("", ""), ("", "a"), ("a", ""), (base, base), (base, base[:-1]), (base[:4096], base), ("x" + base, base)]
    for at in (0, 1, 4095, 4096, 4097, 8191, 8192, 9999):
        changed = base[:at] + "\u00e9" + base[at + 1 :]
        cases += [(base, changed), (changed, base), (changed[: at + 1], base)]
    for a, b in cases:
        assert first_difference(a, b) == naive(a, b), (len(a), len(b))


@pytest.mark.parametrize("name", JINJA)
def test_every_call_of_a_multi_turn_episode_continues_its_parent(name: str) -> None:
    t = renderer(name)
    thinks = t.family.reasoning is not None and name != "qwen3-no-thinking"
    thought = {"reasoning_content": "I look first."} if thinks else {}
    episode = Episode(t)

    ids, continued, why = episode.call()
    assert (continued, why) == (None, FIRST_CALL)
    assert ids == t.prompt(episode.history, TOOLS)
    one = {"role": "assistant", "content": "", **thought, "tool_calls": [call("bash", {"command": "ls"}, 0)]}
    got = episode.answer(ids, sampled_text(t, episode.history, one, "<|observation|>"))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == [
        ("bash", {"command": "ls"})
    ]
    if thinks:
        assert got["reasoning_content"] == "I look first."
    calls = got["tool_calls"]
    episode.history.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.txt"})

    # a tool result: the reply keeps its reasoning, so a whole rendering is the same text (reasoning kept)
    ids, continued, _ = episode.call()
    truth = t.render([*episode.history[:2], one, episode.history[-1]], TOOLS, True)
    text = continues(episode, ids, continued, truth)
    if name != "qwen3-no-thinking":  # its empty <think> block is written only while the reply is last
        assert text == truth

    two = {
        "role": "assistant",
        "content": "",
        **thought,
        "tool_calls": [call("bash", {"command": "pwd"}, 0), call("add", {"a": 2, "b": 3}, 1)],
    }
    got = episode.answer(ids, sampled_text(t, episode.history, two, "<|observation|>"))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got["tool_calls"]] == [
        ("bash", {"command": "pwd"}),
        ("add", {"a": 2, "b": 3}),
    ]
    for each, result in zip(got["tool_calls"], ("/work", "5"), strict=True):
        episode.history.append({"role": "tool", "tool_call_id": each["id"], "content": result})

    # parallel tool results, grouped into one turn where the template groups them
    ids, continued, _ = episode.call()
    truth = t.render(episode.history, TOOLS, True)
    continues(episode, ids, continued, truth)

    three = {"role": "assistant", "content": "All done.", **thought}
    got = episode.answer(ids, sampled_text(t, episode.history, three, "<|user|>"))
    assert got["content"] == "All done."
    episode.history.append({"role": "user", "content": "Now add more."})

    # a user turn in the middle: templates that drop earlier reasoning write the history otherwise now
    ids, continued, _ = episode.call()
    truth = t.render(episode.history, TOOLS, True)
    text = continues(episode, ids, continued, truth)
    if thinks:
        assert text != truth  # what re-rendering would have cost: the reasoning sampled is gone from its history

    four = {"role": "assistant", "content": "The sum of two and three is five, and more.", **thought}
    episode.answer(ids, sampled_text(t, episode.history, four, "<|user|>"), cut=6)
    episode.history.append({"role": "user", "content": "Go on."})

    # a reply cut by max_tokens: the template's end of turn first (none for a model that stops on a role token)
    ids, continued, _ = episode.call()
    truth = t.render(episode.history, TOOLS, True)
    continues(episode, ids, continued, truth, cut=True)


def test_a_llama_reply_ended_by_eom_id_continues_with_no_end_of_turn_added() -> None:
    t = renderer("llama3")
    episode = Episode(t)
    ids, _, _ = episode.call()
    eom = t.encode("<|eom_id|>")
    assert len(eom) == 1 and eom[0] in t.stops and eom[0] != t.end_of_turn
    episode.answer(ids, '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}<|eom_id|>')
    calls = episode.history[-1]["tool_calls"]
    episode.history.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.txt"})
    ids, continued, _ = episode.call()
    parent = episode.turns[-1].reply
    assert parent is not None and continued == "t0"
    after = ids[len(parent.prompt_token_ids or ()) + len(parent.completion_token_ids or ()) :]
    assert t.decode(after).startswith("<|start_header_id|>ipython")  # no <|eot_id|> added after the <|eom_id|>


@pytest.mark.parametrize("then", ["branch", "rerender", "fail"])
def test_a_glm_reply_that_stopped_on_another_role_than_the_next_is_a_discontinuity(then: str) -> None:
    t = renderer("glm4.5")
    episode = Episode(t)
    ids, _, _ = episode.call()
    one = {"role": "assistant", "content": "", "tool_calls": [call("bash", {"command": "ls"}, 0)]}
    episode.answer(ids, sampled_text(t, episode.history, one, "<|user|>"))  # stopped on <|user|>, not <|observation|>
    calls = episode.history[-1]["tool_calls"]
    episode.history.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.txt"})
    messages = [dict(m) for m in episode.history]
    if then == "fail":
        with pytest.raises(UpstreamError, match="on_discontinuity is fail") as refused:
            _prompt(t, messages, TOOLS, episode.turns[-1], then)
        assert "\n" not in refused.value.message
        return
    prompt, continued, why = _prompt(t, messages, TOOLS, episode.turns[-1], then)
    assert continued is None and why is not None and why.startswith("discontinuity: the reply stopped on '<|user|>'")
    assert list(prompt) == t.prompt(messages, TOOLS)  # rendered in full


@pytest.mark.parametrize(
    ("parser_name", "text", "said"),
    [
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>bash<｜tool▁sep｜>{nope<｜tool▁call▁end｜>",
            "not JSON",
        ),
        ("deepseek_v3", "<｜tool▁calls▁begin｜>bash{}<｜tool▁call▁end｜>", "is not"),
        ("glm45", "<tool_call>bash\n<arg_key>command</arg_key>\nls\n</tool_call>", "is not NAME"),
        ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0{}<|tool_call_end|>", "is not"),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>[",
            "not JSON",
        ),
    ],
)
def test_output_a_new_parser_cannot_read_reaches_the_agent_as_text_with_why(
    parser_name: str, text: str, said: str
) -> None:
    parsed = parser(parser_name).parse(text, TOOLS)
    assert parsed.tool_calls == () and parsed.content == text
    assert parsed.error is not None and parsed.error.startswith(f"{parser_name}: ") and said in parsed.error


def test_the_v3_fenced_form_and_glm_values_by_their_schema() -> None:
    fenced = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
        '{"a": 2, "b": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    (found,) = parser("deepseek_v3").parse(fenced, TOOLS).tool_calls
    assert (found.name, json.loads(found.arguments)) == ("add", {"a": 2, "b": 3})
    glm = "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>42</arg_value>\n</tool_call>"
    (found,) = parser("glm45").parse(glm, TOOLS).tool_calls
    assert json.loads(found.arguments) == {"command": "42"}  # a string by its schema, though it reads as JSON


def test_a_family_with_an_official_renderer_is_built_by_its_package_not_a_template() -> None:
    made = renderer_of("unused: harmony carries its own vocabulary", None, {}, "gpt-oss")
    assert type(made).__name__ == "HarmonyTemplate" and made.family.name == "gpt-oss"
    assert made.end_of_turn in made.stops


# A template that joins each message's `content` to its text with `+`, as SmolLM2's does: a reply that is only tool
# calls, with no content field, makes it raise (an undefined field cannot be added to a string)
READS_CONTENT = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_refuses_the_conversation_is_a_difference_from_its_start_not_a_lost_call() -> None:
    # The whole-conversation check raised instead: the served call was never answered, and its agent heard 504 once
    # the turn timed out (SmolLM2's run of benchmarks/long_episode.py, RESULTS.md section 35)
    strict = ChatTemplate(tokenizer("chatml"), READS_CONTENT, {}, named("chatml"))
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "tool_calls": [call("bash", {"command": "ls"}, 0)]},
        {"role": "tool", "tool_call_id": "functions.bash:0", "content": "a.py"},
    ]
    ids = strict.encode("<|im_start|>user\nlist the files<|im_end|>\n<|im_start|>assistant\n")
    differs = strict.difference(ids, messages, TOOLS)
    assert differs is not None and differs.at == 0
    assert differs.rendered.startswith("(the chat template refused the conversation: ")
    assert differs.sent == "<|im_start|>user\nlist the files<|im_end|>\n<|im_start|>assistant\n"
