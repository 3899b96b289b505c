"""Token ids as JSON text: a server's echo of the prompt ids cut out of its answer only where it is the one echo, where
the ids are read from, and written as servers write it; the ids' text kept for a turn's child within its bound; an
echo read after its parent's ids where it extends them."""

from __future__ import annotations

import orjson
import pytest

from proxy.adapters.ids_json import IdsJson, after, cut_echo, dumped, joined


def completion(echo: bytes, *, top: bytes = b"") -> bytes:
    choice = b'{"index":0,"text":"say \\"prompt_token_ids\\": [1]","token_ids":[7,8],"prompt_token_ids":' + echo + b"}"
    return b'{"id":"cmpl-1",' + top + b'"choices":[' + choice + b'],"usage":{"prompt_tokens":3}}'


def test_the_one_echo_on_the_choice_is_cut_out_as_text() -> None:
    echo = cut_echo(completion(b"[1,22,333]"), "choice")
    assert echo is not None and echo.text == b"[1,22,333]"
    assert echo.response["choices"][0] == {
        "index": 0,
        "text": 'say "prompt_token_ids": [1]',  # the key's text inside a string is no echo
        "token_ids": [7, 8],
        "prompt_token_ids": None,
    }
    assert echo.response["usage"] == {"prompt_tokens": 3}


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (completion(b"[1, 22, 333]"), "choice"),  # another spacing: parsed whole, as before
        (completion(b"[1,-2]"), "choice"),
        (completion(b"null"), "choice"),
        (completion(b"[1,2]", top=b'"prompt_token_ids":[1,2],'), "choice"),  # two echoes
        (completion(b"[1,2]"), "top"),  # not where the ids are read from
        (b'{"choices":[{"meta":{"prompt_token_ids":[1,2]}}]}', "choice"),
        (b'{"choices":[{"text":"a"}]}', "choice"),
    ],
)
def test_an_echo_not_as_servers_write_it_is_left_to_the_whole_parse(content: bytes, where: str) -> None:
    assert cut_echo(content, where) is None


def test_ids_text_is_joined_and_kept_for_the_same_objects_only() -> None:
    assert joined(b"[1,2]", b"[]", b"[3]") == b"[1,2,3]" == dumped((1, 2, 3))
    assert joined(b"[]", b"[]") == b"[]"
    ids = IdsJson(kept_bytes=64)
    prompt, sampled = (1, 2, 3), (4,)
    ids.keep(prompt, sampled, b"[1,2,3,4,9]")  # (a text that is not theirs: the test tells where it came from)
    assert ids.of(prompt, sampled) == b"[1,2,3,4,9]"
    assert ids.of(tuple(orjson.loads(b"[1,2,3]")), sampled) == b"[1,2,3,4]"  # equal ids, other objects: dumped
    ids.keep((5,) * 4, (6,), b"[5,5,5,5,6]")  # 11 + 40 bytes: over 64 with the first, which goes
    assert ids.of(prompt, sampled) == b"[1,2,3,4]"


@pytest.mark.parametrize(
    ("echo", "before", "new"),
    [
        (b"[1,2,3,44]", b"[1,2]", [3, 44]),
        (b"[1,2]", b"[1,2]", []),
        (b"[1,23]", b"[1,2]", None),  # 23 is not 2 then more
        (b"[1]", b"[1,2]", None),
        (b"[9,2,3]", b"[1,2]", None),
        (b"[1,2,3]", b"[]", None),  # no parent's ids to extend
    ],
)
def test_an_echo_extends_its_parents_ids_token_for_token(echo: bytes, before: bytes, new: list[int] | None) -> None:
    assert after(echo, before) == new
