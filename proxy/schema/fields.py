"""What requests may carry: strict and open models, and the JSON values that can be stored and sent back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


class _Strict(BaseModel):
    """A request: unknown fields and values of another JSON type (`true` for a number, "5" for an integer)
    are refused, as the schema says, rather than coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# Requests
#
# Whatever a request carries is stored and served back as JSON, so it must be JSON that can be written out again:
# valid Unicode (Python's own JSON parser lets lone surrogates through) and integers within 64 bits. Strings
# stored as text columns (names, ids, reasons) also may not hold U+0000, which Postgres text cannot.

_INT64 = (-(2**63), 2**63 - 1)
_INT32_MAX = 2**31 - 1  # counts stored in INTEGER columns


def _unicode(text: str) -> str:
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode: a lone surrogate (U+D800 to U+DFFF) cannot be stored") from None
    return text


def _no_nul(text: str) -> str:
    if "\x00" in text:
        raise ValueError("must not contain U+0000")
    return _unicode(text)


def _storable(value: Any, text: Callable[[str], str] = _unicode) -> Any:
    """Refuse free-form JSON that could not be stored and served back: see the note above. (Nesting is bounded
    before any route reads a body.)"""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            text(item)
        elif isinstance(item, int) and not _INT64[0] <= item <= _INT64[1]:
            raise ValueError(f"integers must fit in 64 bits; {item} does not")
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
    return value


def _whole(value: Any) -> Any:
    """JSON has one number type, and the schema's `integer` is any number without a fraction: 5.0 counts as 5."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Integers within bounds; the bounds come before the validator, or they leave the schema as `ge` and `le`.
_WHOLE = BeforeValidator(_whole)
TokenId = Annotated[int, Field(ge=_INT64[0], le=_INT64[1]), _WHOLE]
TokenCount = Annotated[int, Field(ge=0, le=_INT32_MAX), _WHOLE]
Limit = Annotated[int, Field(ge=1, le=_INT32_MAX), _WHOLE]
HttpStatus = Annotated[int, Field(ge=400, le=599), _WHOLE]
Text = Annotated[str, AfterValidator(_unicode)]
Name = Annotated[str, AfterValidator(_no_nul)]
Json = Annotated[dict[str, Any], AfterValidator(_storable)]
# An episode's metadata is read by the database too (filters, an index finding forks), and Postgres cannot read a
# JSON value holding U+0000 (it refuses to de-escape \u0000): none anywhere in it, keys included.
Metadata = Annotated[dict[str, Any], AfterValidator(lambda value: _storable(value, _no_nul))]


# A reply's fields for the agent that its dialect renders itself, and the shape each rendering reads: Anthropic's
# thinking blocks (a streamed block is rebuilt by its type, its thinking joined as text by the SDK), Responses'
# reasoning items (a streamed item is rebuilt by its type), and the reasoning every dialect renders as text.
_THINKING = "thinking_blocks must be a list of thinking blocks: objects of type 'thinking' or 'redacted_thinking'"
_REASONING = "reasoning_items must be a list of reasoning items: objects of type 'reasoning'"


def agent_extras(extras: dict[str, Any]) -> dict[str, Any]:
    """Refuse a reply's extra fields in a shape its dialect could not render (see the note above)."""
    reasoning = extras.get("reasoning_content")
    if reasoning is not None and not isinstance(reasoning, str):
        raise ValueError(f"reasoning_content must be a string or null, not {type(reasoning).__name__}")
    blocks = extras.get("thinking_blocks")
    if not _all_of(blocks, ("thinking", "redacted_thinking")):
        raise ValueError(_THINKING)
    if not all(map(_thought_as_text, blocks or ())):
        raise ValueError("thinking_blocks: a 'thinking' block's thinking and signature must be strings")
    if not _all_of(extras.get("reasoning_items"), ("reasoning",)):
        raise ValueError(_REASONING)
    return extras


def _all_of(items: Any, types: tuple[str, ...]) -> bool:
    """Whether `items` is null or a list of objects, each of one of these types."""
    if items is None:
        return True
    return isinstance(items, list) and all(isinstance(item, dict) and item.get("type") in types for item in items)


def _thought_as_text(block: dict[str, Any]) -> bool:
    """Whether a thinking block's thinking and signature, where it has them, are text: the SDKs join their deltas."""
    return block["type"] != "thinking" or all(isinstance(block.get(k, ""), str) for k in ("thinking", "signature"))


def _no_credentials(options: dict[str, Any]) -> dict[str, Any]:
    secret = [name for name in options if _credential(name)]
    if secret:
        raise ValueError(
            f"options {secret} look like credentials, which would be stored with the episode: set them in "
            "trajproxy's environment instead (OPENAI_API_KEY, ANTHROPIC_API_KEY, …), where litellm finds them"
        )
    return options


def _credential(name: str) -> bool:
    """A name that reads as a secret (`api_key`, `access_token`, `password`), not a sampling one (`max_tokens`)."""
    lowered = name.lower()
    return lowered.endswith(("key", "token", "secret")) or "passw" in lowered or "secret" in lowered


ModelOptions = Annotated[Json, AfterValidator(_no_credentials)]
