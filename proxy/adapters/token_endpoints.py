"""The inference servers' endpoints that take a prompt as token ids, for token in, token out
(`proxy/adapters/served_tokens.py`): what each is sent, and what its answer says was read and sampled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from proxy.core.values import JsonObject

Sampled = tuple[list[int] | None, list[int] | None, list[float] | None, str, str | None]


class TokenEndpoint(Protocol):
    """One inference server's endpoint that takes a prompt as token ids."""

    name: str
    in_choices: bool  # its answer holds what was sampled on `choices` (an OpenAI-shaped answer), or at the top

    def url(self, api_base: str) -> str: ...

    def ask(self, model: str, ids: list[int], sampling: JsonObject) -> JsonObject: ...

    def sampled(self, response: JsonObject) -> Sampled:
        """The prompt ids it read, the ids it sampled, their logprobs, the text, and why it stopped."""
        ...


class VllmCompletions:
    """vLLM's `/v1/completions` with a token-id prompt: `return_token_ids` gives the ids on the choice, `logprobs: 0`
    the sampled token's logprob alone; special tokens stay in the text, where tool-call markers may be special."""

    name = "vllm"
    in_choices = True

    def url(self, api_base: str) -> str:
        return api_base.rstrip("/") + "/completions"

    def ask(self, model: str, ids: list[int], sampling: JsonObject) -> JsonObject:
        return {
            "skip_special_tokens": False,
            **sampling,
            "model": model,
            "prompt": ids,
            "return_token_ids": True,
            "logprobs": 0,
            "stream": False,
        }

    def sampled(self, response: JsonObject) -> Sampled:
        choice = response["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        return (
            choice.get("prompt_token_ids"),
            choice.get("token_ids"),
            logprobs,
            choice.get("text") or "",
            finish(choice),
        )


class SglangGenerate:
    """SGLang's native `/generate` with `input_ids` (its documented shapes; no SGLang runs here, so untested live):
    sampling parameters go in `sampling_params`, `max_tokens` as `max_new_tokens`."""

    name = "sglang"
    in_choices = False  # {"text", "output_ids", "meta_info"}

    def url(self, api_base: str) -> str:
        return api_base.rstrip("/").removesuffix("/v1") + "/generate"

    def ask(self, model: str, ids: list[int], sampling: JsonObject) -> JsonObject:
        params = {"skip_special_tokens": False, **sampling}
        if "max_tokens" in params:
            params["max_new_tokens"] = params.pop("max_tokens")
        return {"input_ids": ids, "sampling_params": params, "return_logprob": True, "stream": False}

    def sampled(self, response: JsonObject) -> Sampled:
        meta = response.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        logprobs = [entry[0] for entry in entries if isinstance(entry, list) and entry]
        finish = meta.get("finish_reason")
        why = finish.get("type") if isinstance(finish, dict) else finish
        return None, response.get("output_ids"), logprobs, response.get("text") or "", why


ENDPOINTS: Mapping[str, TokenEndpoint] = {"vllm": VllmCompletions(), "sglang": SglangGenerate()}


def finish(choice: JsonObject) -> str | None:
    """Why an OpenAI-shaped choice stopped, where it says."""
    why = choice.get("finish_reason")
    return why if isinstance(why, str) else None
