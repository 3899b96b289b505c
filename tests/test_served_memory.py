"""What `trajproxy serve` does to its process's memory for a long episode's sake: large blocks from glibc's heap,
not mapped afresh each turn, and a conversation's prompt ids out of the garbage collector's sight."""

from __future__ import annotations

import ctypes
import gc
import subprocess
import sys

import pytest

from proxy.adapters.chat_templates import ChatTemplate
from proxy.adapters.id_tuples import untracked
from proxy.adapters.served_tokens import _prompt
from proxy.adapters.served_upstream import SERVERS, _reply
from proxy.core.values import Reply, Turn, TurnStatus
from proxy.families import named
from testkit.family_checks import tokenizer

GROWING = """
import resource, sys
from proxy.cli.serve import settle_memory

if sys.argv[1] == "settled":
    settle_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for turn in range(64):  # each turn's body a little larger than the last one, which is freed
    body = b"x" * ((1 << 20) + turn * 32768)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_served_process_takes_a_growing_bodys_blocks_from_the_heap() -> None:
    def faults(how: str) -> int:
        run = subprocess.run([sys.executable, "-c", GROWING, how], capture_output=True, text=True, check=True)
        return int(run.stdout)

    if not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("glibc's malloc")
    started, settled = faults("as started"), faults("settled")
    assert started > 64 * (1 << 20) // 4096  # every page of every body faulted in afresh
    assert settled < started / 4, (started, settled)  # the heap's pages used again


def test_a_prompts_ids_are_out_of_the_collectors_sight() -> None:
    ids = tuple(int(str(i)) for i in range(5000))
    assert gc.is_tracked(ids)
    assert untracked(ids) is ids and not gc.is_tracked(ids)
    assert untracked(ids) is ids  # twice: nothing more to do
    short = tuple(int(str(i)) for i in range(10))
    assert gc.is_tracked(untracked(short))  # not worth the call: the collector drops it soon enough
    assert list(ids) == list(range(5000))


def test_a_continued_turns_prompt_is_out_of_the_collectors_sight_in_tokens_mode() -> None:
    family = named("qwen3")
    t = ChatTemplate(tokenizer("qwen3"), None, dict(family.template_kwargs), family)
    history = [{"role": "system", "content": "Run commands. " * 600}, {"role": "user", "content": "go"}]
    first, _, _ = _prompt(t, history, [], None)
    reply = {"role": "assistant", "content": "done"}
    sampled = tuple(t.encode("done<|im_end|>"))
    answered = Reply(message=reply, prompt_token_ids=first, completion_token_ids=sampled)
    parent = Turn("t0", "e", 0, "chat", {"messages": history}, b"", False, TurnStatus.ANSWERED, 0.0, reply=answered)
    ids, continued, _ = _prompt(t, [*history, reply, {"role": "user", "content": "more"}], [], parent)
    assert continued == "t0" and len(ids) > len(first) > 1024
    assert ids[: len(first) + len(sampled)] == first + sampled and not gc.is_tracked(ids)


def test_a_prompt_read_from_the_servers_echo_is_out_of_the_collectors_sight_in_chat_mode() -> None:
    echoed = [int(str(i)) for i in range(3000)]
    choice = {"message": {"role": "assistant", "content": "ok"}, "token_ids": [7, 8], "finish_reason": "stop"}
    reply = _reply(SERVERS["vllm"], "http://x/v1/chat/completions", {"choices": [choice]}, {}, (echoed, None))
    assert reply.prompt_token_ids == tuple(echoed) and not gc.is_tracked(reply.prompt_token_ids)
