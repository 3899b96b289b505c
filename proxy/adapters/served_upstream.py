"""ServedUpstream: answers turns from the policy being trained, on its inference server; the one module that speaks
to vLLM and SGLang.

Two modes (`policy_options.mode`). `"tokens"` (the default; token in, token out: `proxy/adapters/served_tokens.py`)
builds each turn's prompt ids itself, continuing the ids its parent turn was prompted with and sampled. `"chat"` (string
in, tokens out) sends each turn's chat request to the server's OpenAI-compatible chat endpoint, which renders the
prompt with the model's own chat template and samples. Either way the turn records the prompt ids the server read,
the ids it sampled and their logprobs exactly as it returned them, never a re-tokenisation of text.
The episode's `policy_options` are the sampling parameters (`temperature`, `top_p`, `max_tokens`, `seed`,
`stop`, or anything else the server takes), sent as they are; `api_base` says where the server is and
`timeout_s` how long one call may take. The agent's own sampling fields are recorded with its call but not
sent: the trainer, not the agent, decides how the policy samples.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from proxy.adapters.ids_json import (
    Echo,
    IdsJson,
    Pieces,
    answer_of,
    chained,
    cut_echo,
    dumped,
    new_ids,
    pieces,
    token_ids,
    with_choices,
)
from proxy.adapters.messages_json import MessagesJson
from proxy.adapters.sent_body import payload
from proxy.adapters.served_tokens import TOKEN_OPTIONS, TokenPolicy, functions, kept
from proxy.core.chunks import Chunks
from proxy.core.errors import ContextFull, UpstreamError
from proxy.core.ids import TokenIds
from proxy.core.values import Answerer, JsonObject, Reply, Turn, Usage

if TYPE_CHECKING:  # aiohttp itself is loaded at a served policy's first call (below): a server whose policies are the
    import aiohttp  # trainer or a hosted model never loads it, a tenth of its start-up

# trajproxy's, not the server's (a chat endpoint renders the template itself: its template options are the server's)
_OWN_OPTIONS = frozenset({"api_base", "timeout_s"}) | TOKEN_OPTIONS - {"chat_template", "chat_template_kwargs"}
_REQUEST_FIELDS = ("messages", "tools", "tool_choice")  # what the policy sees of the agent's call
_MESSAGE_FIELDS = ("role", "content", "tool_calls", "reasoning_content")
# How vLLM ("This model's maximum context length is 2048 tokens. However, ...", "... longer than the maximum model
# length of 2048") and SGLang ("... longer than the model's context length ...") refuse a prompt that does not fit
_CONTEXT_FULL = re.compile(r"context length|maximum model length|max_model_len", re.IGNORECASE)


class ServerDialect(Protocol):
    """How one inference server's chat endpoint is asked for token ids, and where its answer holds them."""

    name: str
    enable: str  # what to turn on when a server answers without ids
    echo_at: str  # where its answer holds the prompt ids: "top" (level) or (first) "choice"

    def ask(self, body: JsonObject) -> JsonObject: ...

    def ids(self, response: JsonObject) -> tuple[list[int] | None, list[int] | None, list[float] | None]: ...


class VllmServer:
    """vLLM's OpenAI server: `return_token_ids` puts the prompt ids at the top level and the sampled ids on the
    choice; `logprobs` gives one entry per sampled token."""

    name = "vllm"
    enable = "vLLM 0.10.2 or later answers `return_token_ids`; older servers cannot give the ids"
    echo_at = "top"

    def ask(self, body: JsonObject) -> JsonObject:
        return {**body, "logprobs": True, "return_token_ids": True}

    def ids(self, response: JsonObject) -> tuple[list[int] | None, list[int] | None, list[float] | None]:
        choice = response["choices"][0]
        return response.get("prompt_token_ids"), choice.get("token_ids"), _logprobs(choice)


class SglangServer:
    """SGLang's OpenAI server, from 0.5.13 (its documented shapes; no SGLang runs here, so untested live): the ids
    come with `return_prompt_token_ids` and `return_meta_info`, on the choice: `prompt_token_ids`, and
    `meta_info.output_token_logprobs` as `[logprob, token_id, text]` (or `{logprob, token_id}`) per sampled token."""

    name = "sglang"
    enable = "SGLang 0.5.13 or later answers `return_prompt_token_ids` and `return_meta_info`; upgrade the server"
    echo_at = "choice"

    def ask(self, body: JsonObject) -> JsonObject:
        return {**body, "logprobs": True, "return_prompt_token_ids": True, "return_meta_info": True}

    def ids(self, response: JsonObject) -> tuple[list[int] | None, list[int] | None, list[float] | None]:
        choice = response["choices"][0]
        meta = choice.get("meta_info")
        sampled = _sampled(meta.get("output_token_logprobs") if isinstance(meta, dict) else None)
        if sampled is None:
            return choice.get("prompt_token_ids"), None, None
        return choice.get("prompt_token_ids"), *sampled


SERVERS: Mapping[str, ServerDialect] = {"vllm": VllmServer(), "sglang": SglangServer()}


class ServedUpstream:
    def __init__(self, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None  # made on the serving loop, at the first call
        self._timeout_s = timeout_s
        self._ids = IdsJson()
        self._messages = MessagesJson()
        self._tokens = TokenPolicy(self._send, self._model_root, self._ids)
        self._roots: dict[str, str] = {}

    async def complete(self, answerer: Answerer, request: JsonObject, parent: Turn | None = None) -> Reply:
        api_base = _api_base(answerer)
        timeout_s = float(answerer.options.get("timeout_s") or self._timeout_s)
        if mode_of(answerer) == "tokens":
            return await self._tokens.complete(answerer, request, parent, api_base, timeout_s)
        server = SERVERS[answerer.kind]
        url = api_base + "/chat/completions"
        sampling = {k: v for k, v in answerer.options.items() if k not in _OWN_OPTIONS}
        asked = {k: request[k] for k in _REQUEST_FIELDS if request.get(k) is not None}
        if tools := functions(asked.pop("tools", None)):
            asked["tools"] = tools
        else:
            asked.pop("tool_choice", None)
        body = server.ask({**asked, **sampling, "model": answerer.model, "stream": False})
        earlier = parent.request.get("messages") if parent is not None else None
        content = await self._send(url, self._messages.body(body, earlier), timeout_s)
        if (echo := cut_echo(content, server.echo_at, self._parents(parent))) is None:
            return _reply(server, url, answer_of(content), sampling)
        reply = _reply(server, url, with_choices(echo.response), sampling, self._prompt(echo, parent))
        if reply.prompt_token_ids is not None and reply.completion_token_ids is not None:
            self._ids.keep(
                reply.prompt_token_ids,
                reply.completion_token_ids,
                chained(echo.text, pieces(dumped(reply.completion_token_ids))),
                parent.reply.prompt_token_ids if parent is not None and parent.reply is not None else None,
            )
        return reply

    def _parents(self, parent: Turn | None) -> tuple[bytes | memoryview, ...]:
        """The text of a parent's prompt then sampled ids, in pieces, where it has them (else an empty array's)."""
        reply = parent.reply if parent is not None else None
        if reply is None or not reply.prompt_token_ids or reply.completion_token_ids is None:
            return pieces(b"[]")
        return self._ids.of(reply.prompt_token_ids, reply.completion_token_ids)

    def _prompt(self, echo: Echo, parent: Turn | None) -> tuple[Sequence[int], bool | None]:
        """The prompt ids a server echoed, and True where they extend its parent's prompt and sampled ids (then read
        from the parent's, and only the ids after them parsed)."""
        reply = parent.reply if parent is not None else None
        if reply is not None and reply.prompt_token_ids and reply.completion_token_ids is not None:
            prompt, sampled = reply.prompt_token_ids, reply.completion_token_ids
            if (new := new_ids(echo)) is not None:
                return TokenIds.joined(prompt, sampled, new), True  # one copy of the prompt's bytes
        try:
            return orjson.loads(b"".join(echo.text)), None
        except orjson.JSONDecodeError as e:
            raise UpstreamError("the policy's server answered with something other than JSON") from e

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        """The connections to the servers, kept alive between calls. aiohttp's, not httpx's: it sends a request's
        headers and body in one write (httpx: two, and on a busy machine the server's process takes the core between
        them) and parses the answer in C ("The served policy's added time, profiled" in benchmarks/RESULTS.md)."""
        import aiohttp  # lazy: loaded at a served policy's first call (see the top)

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    async def _model_root(self, api_base: str) -> str:
        """Where the server's model lies (vLLM's `/v1/models` says, as `root`): its tokenizer, for token in, token out
        where `policy_options.tokenizer` does not say."""
        if (root := self._roots.get(api_base)) is not None:
            return root
        import aiohttp  # lazy: loaded at a served policy's first call (see the top)

        try:
            async with self._client().get(api_base + "/models", timeout=aiohttp.ClientTimeout(total=30.0)) as answer:
                content = await answer.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            raise UpstreamError(f"the policy's server could not be reached: {type(e).__name__}") from e
        try:
            models = orjson.loads(content)["data"]
            root = str(next(m["root"] for m in models if isinstance(m.get("root"), str)))
        except (orjson.JSONDecodeError, KeyError, TypeError, StopIteration) as e:
            raise UpstreamError(
                "the policy's server did not say where its model lies: give policy_options.tokenizer, the model's "
                "folder or name, for token in, token out"
            ) from e
        self._roots[api_base] = root
        return root

    async def _send(self, url: str, body: Pieces, timeout_s: float) -> Chunks:
        """A JSON body, in pieces, to the server; its answer's bytes, in the chunks they came in, where it answered
        200."""
        import aiohttp  # lazy: loaded at a served policy's first call (see the top)

        try:
            async with self._client().post(
                url, data=payload(body), timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as answer:
                status, reason, content = answer.status, answer.reason, Chunks(await _chunks(answer))
        except (aiohttp.ClientError, TimeoutError) as e:
            raise UpstreamError(f"the policy's server could not be reached: {type(e).__name__}") from e
        if status != 200:
            why = _why(content.joined(), reason)
            if status == 400 and _CONTEXT_FULL.search(why):
                raise ContextFull(f"the conversation is longer than the policy's context: {why}")
            raise UpstreamError(f"the policy's server answered {status}: {why}")
        return content


async def _chunks(answer: aiohttp.ClientResponse) -> list[bytes]:
    """An answer's body as the chunks it arrived in (`read` joins them: one more copy of the whole)."""
    chunks: list[bytes] = []
    while True:
        chunk, _ = await answer.content.readchunk()  # (b"", True) ends an HTTP chunk, not always the body
        if chunk:
            chunks.append(chunk)
        elif answer.content.at_eof():
            return chunks


def mode_of(answerer: Answerer) -> str:
    """`tokens` unless the episode asks for `chat`."""
    return "chat" if answerer.options.get("mode") == "chat" else "tokens"


def _api_base(answerer: Answerer) -> str:
    base = answerer.options.get("api_base")
    if not isinstance(base, str) or not base.startswith(("http://", "https://")):
        raise UpstreamError(
            f"policy {answerer.spec} needs policy_options.api_base, the server's URL (e.g. http://127.0.0.1:8000/v1)"
        )
    return base.rstrip("/")


def _reply(
    server: ServerDialect,
    url: str,
    response: JsonObject,
    sampling: JsonObject,
    echoed: tuple[Sequence[int], bool | None] | None = None,  # the prompt ids, cut out of the answer
) -> Reply:
    prompt: Sequence[int] | None
    prompt, completion, logprobs = server.ids(response)
    extends = None
    if echoed is not None:
        prompt, extends = echoed
    if not (extends or token_ids(prompt)) or not token_ids(completion, empty=True):
        raise UpstreamError(
            f"the policy's server answered without the token ids it sampled, which training needs: {server.enable}"
        )
    assert prompt is not None and completion is not None
    if logprobs is not None and len(logprobs) != len(completion):
        logprobs = None  # not one per sampled token: not to be trusted for a loss
    choice = response["choices"][0]
    message = {k: v for k, v in (choice.get("message") or {}).items() if k in _MESSAGE_FIELDS and v is not None}
    if "reasoning" in (choice.get("message") or {}) and "reasoning_content" not in message:
        message["reasoning_content"] = choice["message"]["reasoning"]
    message["role"] = "assistant"
    message.setdefault("content", None)
    usage = Usage(len(prompt), len(completion))
    finish = choice.get("finish_reason") or ("tool_calls" if message.get("tool_calls") else "stop")
    return Reply(
        message=message,
        finish_reason=finish,
        usage=usage,
        prompt_token_ids=TokenIds(prompt),
        completion_token_ids=tuple(completion),
        logprobs=tuple(logprobs) if logprobs is not None else None,
        served={"server": server.name, "mode": "chat", "sampling": sampling, "response": kept(response)},
        extends_parent=extends,
    )


def _sampled(entries: Any) -> tuple[list[int], list[float]] | None:
    """SGLang's `output_token_logprobs`: the ids and logprobs, or None where an entry is not one."""
    if not isinstance(entries, list):
        return None
    ids, logprobs = [], []
    for entry in entries:
        if isinstance(entry, dict):
            token, logprob = entry.get("token_id"), entry.get("logprob")
        elif isinstance(entry, list) and len(entry) >= 2:
            logprob, token = entry[0], entry[1]
        else:
            return None
        if not isinstance(token, int) or isinstance(token, bool) or not isinstance(logprob, int | float):
            return None
        ids.append(token)
        logprobs.append(float(logprob))
    return ids, logprobs


def _logprobs(choice: JsonObject) -> list[float] | None:
    content = (choice.get("logprobs") or {}).get("content")
    if not isinstance(content, list):
        return None
    values = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    return [float(v) for v in values if isinstance(v, int | float)] if all(_number(v) for v in values) else None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _why(content: bytes, reason: str | None) -> str:
    """The server's own one-line reason, from its error body if it has one."""
    try:
        error = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content.decode(errors="replace")[:200] or reason or ""
    if isinstance(error, dict):
        detail = error.get("error", error)
        message = detail.get("message") if isinstance(detail, dict) else detail
        return str(message)[:300]
    return reason or ""
