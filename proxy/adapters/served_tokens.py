"""Token in, token out: a served policy's turns prompted with ids trajproxy builds, so that every id a turn samples
stays trainable (`policy_options.mode: "tokens"`).

A call that continues its parent turn (the same conversation, with the parent's reply handed back as it was given)
is prompted with the parent's prompt ids, the ids the parent sampled, and the chat template's ids for the new
messages only: the model goes on from exactly what it saw and sampled, whatever the template or the agent would
make of the history in text (reasoning dropped, tool arguments re-serialised). Any other call is rendered in full
by the model's own chat template. The ids go to the server's token endpoint (vLLM's completions with a token-id
prompt, SGLang's `/generate` with `input_ids`); the text sampled becomes the agent's reply, its tool calls read
by the model family's parser (`policy_options.tool_parser`, else its family's). Where the text does not parse, the
agent gets it as text and the turn records why (`served.parse_error`).

The family (`policy_options.family`, else the one the tokenizer says: `proxy/families`) is recorded on every turn
(`served.family`). Every turn says whether it continued its parent (`served.continued`) and, where not, why
(`served.not_continued`). Where a call extends its parent but the template cannot say which ids the new messages
add (a discontinuity), `policy_options.on_discontinuity` decides: `branch` (the default) renders the call in full
and starts a new line of the export there, so the earlier turns train on their own line and every sampled id is
trained exactly once; `fail` refuses the call, an infrastructure failure of the episode (fail closed); `rerender`
renders it in full within the branch, as before, where the export masks what no longer matches.

Continued turns also render their whole conversation with the template, as a chat endpoint would, and record where
that text first differs from the ids sent (`served.template_differs`): what chat mode would have lost. That costs
the whole conversation, so by default only the turns whose message count reaches a power of two check
(`_checked`; `check_template: "every"` checks each).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson

from proxy.adapters.chat_templates import ChatTemplate, ChatTemplates, Discontinuity
from proxy.adapters.ids_json import (
    IdsJson,
    Pieces,
    answer_of,
    chained,
    compacted,
    cut_echo,
    dumped,
    json_object,
    pieces,
    token_ids,
)
from proxy.adapters.parsers import parser
from proxy.adapters.renderer import Renderer
from proxy.adapters.template_messages import TemplateMessages
from proxy.adapters.token_endpoints import ENDPOINTS, TokenEndpoint
from proxy.core.branches import same_message
from proxy.core.chunks import Chunks
from proxy.core.errors import UpstreamError
from proxy.core.ids import TokenIds
from proxy.core.values import Answerer, JsonObject, Reply, Turn, Usage, new_id
from proxy.families import GENERAL, Family

# trajproxy's own options in tokens mode, never sent to the server
TOKEN_OPTIONS = frozenset(
    {
        "mode",
        "tokenizer",
        "tool_parser",
        "chat_template",
        "chat_template_kwargs",
        "check_template",
        "family",
        "on_discontinuity",
    }
)
ON_DISCONTINUITY = ("branch", "fail", "rerender")  # the first is the default
FIRST_CALL = "the first call of its branch"  # as proxy/storage/samples.py reads it
Send = Callable[[str, Pieces, float], Awaitable[Chunks]]  # a body, in pieces, to a URL, within a time: the answer's


class TokenPolicy:
    def __init__(self, send: Send, model_root: Callable[[str], Awaitable[str]], ids: IdsJson) -> None:
        self._send = send
        self._model_root = model_root  # where a server's model lies, for its tokenizer
        self._templates = ChatTemplates()
        self._ids = ids  # the JSON of turns' ids, for their children's

    async def complete(
        self, answerer: Answerer, request: JsonObject, parent: Turn | None, api_base: str, timeout_s: float
    ) -> Reply:
        options = answerer.options
        endpoint = ENDPOINTS[answerer.kind]
        tools = functions(request.get("tools"))
        template = await self._template(answerer, api_base)
        messages = TemplateMessages(request.get("messages") or ())
        on_discontinuity = str(options.get("on_discontinuity") or ON_DISCONTINUITY[0])
        ids, continued, not_continued = _prompt(template, messages, tools, parent, on_discontinuity)
        check = getattr(template, "difference", None)  # the jinja template's: official renderers have no text
        checked = check and _checked(options, continued, parent, messages)
        differs = check(ids, messages.all(), tools) if check is not None and checked else None
        sampling = {k: v for k, v in options.items() if k not in TOKEN_OPTIONS and k not in ("api_base", "timeout_s")}
        sent = self._sent(ids, parent if continued else None)
        asked = endpoint.ask(answerer.model, _PLACE, sampling)
        response, sent = await self._asked(endpoint, asked, ids, sent, api_base, timeout_s)
        _, sampled_ids, logprobs, text, why = endpoint.sampled(response)
        if not token_ids(sampled_ids, empty=True):
            raise UpstreamError("the policy's server answered without the token ids it sampled, which training needs")
        completion = tuple(sampled_ids)
        parent_ids = parent.reply.prompt_token_ids if continued and parent is not None and parent.reply else None
        self._ids.keep(ids, completion, chained(sent, pieces(dumped(completion))), parent_ids)
        if logprobs is not None and (len(logprobs) != len(completion) or not all(_number(v) for v in logprobs)):
            logprobs = None  # not one per sampled token: not to be trusted for a loss
        family: Family = getattr(template, "family", GENERAL)
        message, parse_error = await _reply_message(text, tools, str(options.get("tool_parser") or family.tool_parser))
        served: JsonObject = {
            "server": endpoint.name,
            "mode": "tokens",
            "sampling": sampling,
            "continued": continued,
            "family": family.name,
            "response": kept(response),
        }
        if not_continued is not None:
            served["not_continued"] = not_continued
            if not_continued.startswith(_DISCONTINUITY):
                served["on_discontinuity"] = on_discontinuity
        if differs is not None:
            served["template_differs"] = {"at": differs.at, "rendered": differs.rendered, "sent": differs.sent}
        if parse_error is not None:
            served["parse_error"] = parse_error
        finish = "tool_calls" if message.get("tool_calls") else "length" if why == "length" else "stop"
        return Reply(
            message=message,
            finish_reason=finish,
            usage=Usage(len(ids), len(completion)),
            prompt_token_ids=ids,
            completion_token_ids=completion,
            logprobs=tuple(float(v) for v in logprobs) if logprobs is not None else None,
            served=served,
            policy_version=_version(response.get("policy_version")),
            # by construction: its parent's prompt and sampled ids, then more
            extends_parent=True if continued else None,
        )

    def _sent(self, ids: TokenIds, continued: Turn | None) -> Pieces:
        """The JSON of a prompt's ids, in pieces: of a continued turn, its parent's ids' text (kept), the new ids'."""
        reply = continued.reply if continued is not None else None
        if reply is None or reply.prompt_token_ids is None or reply.completion_token_ids is None:
            return pieces(dumped(ids))
        prompt, sampled = reply.prompt_token_ids, reply.completion_token_ids
        return chained(self._ids.of(prompt, sampled), pieces(dumped(ids[len(prompt) + len(sampled) :])))

    async def _asked(
        self,
        endpoint: TokenEndpoint,
        asked: JsonObject,
        ids: TokenIds,
        sent: Pieces,
        api_base: str,
        timeout_s: float,
    ) -> tuple[JsonObject, Pieces]:
        """The server's answer to `asked`, its prompt the ids whose JSON is `sent` (in place of `_PLACE`): their
        echo compared as text where the server writes it as it was sent, else parsed and compared as ids. And the
        ids' text as sent, in pieces (joined where they grew many: `compacted`)."""
        dumped_asked = orjson.dumps(asked)
        at = dumped_asked.find(_PLACED)
        if at >= 0 and dumped_asked.find(_PLACED, at + 1) < 0:
            sent = compacted(sent)
            whole = memoryview(dumped_asked)
            body: Pieces = (whole[:at], *sent, whole[at + len(_PLACED) :])
        else:  # the placeholder's text in the sampling options too: not worth a cleverer place
            body = (orjson.dumps({k: ids.tolist() if v is _PLACE else v for k, v in asked.items()}),)
        content = await self._send(endpoint.url(api_base), body, timeout_s)
        echo = cut_echo(content, "choice", sent)
        if echo is not None and echo.after == b"]":  # it begins with what was sent, and ends there
            return echo.response, sent
        response = answer_of(content) if endpoint.in_choices else json_object(content)
        read = endpoint.sampled(response)[0]
        if read is not None and ids != read:
            raise UpstreamError("the policy's server read other prompt ids than it was sent")
        return response, sent

    async def _template(self, answerer: Answerer, api_base: str) -> ChatTemplate:
        options = answerer.options
        where = options.get("tokenizer")
        if not isinstance(where, str):
            where = await self._model_root(api_base)
        kwargs = options.get("chat_template_kwargs")
        chat_template = options.get("chat_template")
        family = options.get("family")
        which = (
            where,
            chat_template if isinstance(chat_template, str) else None,
            kwargs if isinstance(kwargs, dict) else None,
            family if isinstance(family, str) else None,
        )
        if (loaded := self._templates.loaded(*which)) is not None:
            return loaded  # a thread only to load it: a hop per call wakes another thread, long on a busy machine
        return await asyncio.to_thread(self._templates.get, *which)


_DISCONTINUITY = "discontinuity: "
_PLACE = [-(1 << 62) - 48]  # where the prompt's ids go in the body sent, as their JSON text
_PLACED = dumped(_PLACE)


def _prompt(
    template: ChatTemplate,
    given: Sequence[JsonObject],
    tools: list[JsonObject],
    parent: Turn | None,
    on_discontinuity: str = ON_DISCONTINUITY[0],
) -> tuple[TokenIds, str | None, str | None]:
    """The call's prompt ids, the id of the turn they continue (None: rendered in full), and why not where not. A
    continued call's messages are read from its parent's reply on (`given`: shaped for templates, or shaped as read)."""
    messages = given if isinstance(given, TemplateMessages) else TemplateMessages(given, shaped=True)
    reply = parent.reply if parent is not None else None
    if parent is None or reply is None or reply.message is None:
        return TokenIds(template.prompt(messages.all(), tools)), None, FIRST_CALL
    prompt, sampled = reply.prompt_token_ids, reply.completion_token_ids
    n = len(parent.request.get("messages") or ())
    if not prompt or sampled is None:
        return TokenIds(template.prompt(messages.all(), tools)), None, "its parent's reply has no token ids"
    if n >= len(messages) or not same_message(reply.message, messages[n]):
        return (
            TokenIds(template.prompt(messages.all(), tools)),
            None,
            "its history does not hold its parent's reply as it was given",
        )
    try:
        delta = _delta(template, messages[n + 1 :], tools, sampled, messages.head(n + 1))
    except Discontinuity as e:
        why = _DISCONTINUITY + " ".join(str(e).split())
        if on_discontinuity == "fail":
            raise UpstreamError(
                f"token in, token out cannot attribute this call's ids ({why}); policy_options.on_discontinuity is fail"
            ) from e
        return TokenIds(template.prompt(messages.all(), tools)), None, why
    return TokenIds.joined(prompt, sampled, delta), parent.id, None  # one copy of the prompt's bytes


def _delta(
    template: Renderer,
    new: list[JsonObject],
    tools: list[JsonObject],
    sampled: Sequence[int],
    history: Sequence[JsonObject],
) -> list[int]:
    """The template's ids for the new messages after the parent's sampled ids; Discontinuity where it cannot say."""
    family: Family = getattr(template, "family", GENERAL)
    ended = bool(sampled) and sampled[-1] in template.stops
    delta = template.delta(new, tools, ended or family.ends_with_next_header, history)
    if delta is None:
        raise Discontinuity("the renderer cannot say what the new messages add after a reply")
    if family.ends_with_next_header and ended:  # the model stopped on the role token that opens the new messages
        if not delta or delta[0] != sampled[-1]:
            stopped, opened = template.decode(sampled[-1:]), template.decode(delta[:1])
            raise Discontinuity(f"the reply stopped on {stopped!r} but the new messages open {opened!r}")
        return delta[1:]
    return delta


def _checked(options: JsonObject, continued: str | None, parent: Turn | None, messages: Sequence[JsonObject]) -> bool:
    """Whether this continued turn's whole conversation is rendered to find where the template would differ: on
    every turn with `check_template: "every"`, never with false, and by default on the turns whose message count
    reaches a power of two (a branch's 8th message, 16th, 32nd, ...), so that the check, which costs the whole
    conversation, costs a constant per turn on average."""
    check = options.get("check_template", True)
    if continued is None or parent is None or not check:
        return False
    if check == "every":
        return True
    before = len(parent.request.get("messages") or ())
    return before.bit_length() < len(messages).bit_length()


# Parsing is linear in the output, yet a long one would hold the loop, and every other call, for that long.
_PARSED_ON_THE_LOOP_CHARS = 16_384


async def _reply_message(text: str, tools: Sequence[JsonObject], parser_name: str) -> tuple[JsonObject, str | None]:
    try:
        reader = parser(parser_name)
    except ValueError as e:
        raise UpstreamError(f"policy_options.tool_parser: {e}") from e
    if len(text) <= _PARSED_ON_THE_LOOP_CHARS:
        parsed = reader.parse(text, tools)
    else:
        parsed = await asyncio.to_thread(reader.parse, text, tools)
    message: JsonObject = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id or new_id("call"),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in parsed.tool_calls
        ]
    return message, parsed.error


def functions(tools: Any) -> list[JsonObject]:
    """The function tools, in OpenAI's field order (the template renders them as JSON into the prompt, so the order
    is part of the prompt); tools a served model cannot call (an API's own, like web search) are left out."""
    kept = []
    for tool in tools if isinstance(tools, list) else ():
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            fields = ("name", "description", "parameters", "strict")
            kept.append({"type": "function", "function": {k: function[k] for k in fields if k in function}})
    return kept


def kept(response: JsonObject) -> JsonObject:
    """The server's answer as kept on the turn: verbatim, less what the reply holds already: the prompt ids it echoes
    (on every turn, the whole conversation's) and the sampled ids' logprobs (with each token's text, and its top
    alternatives where asked)."""
    kept = {k: v for k, v in response.items() if k != "prompt_token_ids"}
    if isinstance(choices := response.get("choices"), list):
        kept["choices"] = [_kept_choice(choice) for choice in choices]
    return kept


def _kept_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice
    return {k: v for k, v in choice.items() if k not in ("prompt_token_ids", "logprobs")}


def _version(value: Any) -> str | None:
    """The weights that sampled, where the server names them (a trainer's token server does; vLLM does not)."""
    return value if isinstance(value, str) and 0 < len(value) <= 200 and "\0" not in value else None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
