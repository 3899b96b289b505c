"""Rollouts that survive weight updates, against a real vLLM (on the CPU, with the tiny model) whose weights are
really reloaded: with `pause("keep")` a call already at the server finishes on the weights it was sent to and
carries their version, a call made during the update waits only for it and is answered by the new weights, and
nothing is lost or answered twice."""

from __future__ import annotations

import contextlib
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from integrations.train.vllm import post, vllm_server
from proxy.client import TrainerClient
from testkit.served_checks import ask
from testkit.vllm_server import copy_model, reload_weights
from tests.test_served_policy import sampled

ON_SQLITE = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def running_at(vllm: Any) -> int:
    """How many requests the server is running now (its own gauge)."""
    with urllib.request.urlopen(f"{vllm.root_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.findall(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    return int(sum(float(value) for value in found))


def outcome(call: Any, running: int) -> str:
    """What became of a call (a future of the SDK's answer), and how many requests vLLM ran as the pause began."""
    if not call.done():
        return f"still waiting, {running} running at vLLM"
    if call.exception() is not None:
        return f"failed: {call.exception()!r}, {running} running"
    choice = call.result().choices[0]
    return f"ended: {choice.finish_reason}, {call.result().usage.completion_tokens} tokens, {running} running"


def wait_for(what: Any, timeout_s: float = 60.0) -> None:
    """Wait for an event (polling what says it happened), never for a time."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what.__doc__ or what}"
        time.sleep(0.01)


@ON_SQLITE
@pytest.mark.timeout(400)  # the first test using vllm waits for it to start
def test_with_keep_a_call_in_flight_finishes_on_the_old_weights_and_a_new_call_waits_only_for_the_reload(
    vllm: Any, trainer: TrainerClient, background: Any, tmp_path: Any
) -> None:
    options = {"api_base": vllm.base_url, "temperature": 1.0, "seed": 3}
    trainer.resume(policy_version="step-0")
    # The long call samples to its limit, 1,800 tokens (within the tiny model's 2,048 positions): at the server
    # while the pause begins.
    long_options = {**options, "max_tokens": 1800, "ignore_eos": True}
    served: dict[str, Any] = {"policy": f"vllm:{vllm.served_name}", "turn_timeout_s": 300}  # a first call is slow
    short = trainer.create_episode(**served, policy_options={**options, "max_tokens": 8})
    with contextlib.ExitStack() as clients:
        short_agent = clients.enter_context(
            openai.OpenAI(base_url=short.env["OPENAI_BASE_URL"], api_key=short.key, max_retries=0)
        )
        first = [{"role": "user", "content": "hello"}]
        short_agent.chat.completions.create(model="p", messages=first)  # type: ignore[arg-type]
        before = copy_model(vllm.model_dir, tmp_path / "before")
        try:
            ask(vllm.python, vllm.model_dir, perturb=2)  # the new weights, on disk: the server reads them at reload
            # The long call must be in flight when the pause begins, whatever the machine's speed: once it is
            # sampling, vLLM's own pause ("keep") freezes it where it is, until the reload below. Where it ended
            # before that (its 1,800 tokens sampled between two polls of the server's gauge), it is made again in an
            # episode of its own, so that each episode holds one turn either way.
            tries: list[str] = []  # what became of each long call that vLLM did not hold: said where all five fail
            for _ in range(5):
                long = trainer.create_episode(**served, policy_options=long_options)
                long_agent = clients.enter_context(
                    openai.OpenAI(base_url=long.env["OPENAI_BASE_URL"], api_key=long.key, max_retries=0)
                )
                # The server is shared by the tests on this worker: an earlier test's call may still be sampling
                # (its client gone). Only once none is, is the one call running the long one.
                wait_for(lambda: running_at(vllm) == 0)
                in_flight = background(long_agent.chat.completions.create, model="p", messages=first)
                # at the server, sampling on the old weights (on a busy machine its way there is slow)
                wait_for(lambda call=in_flight: call.done() or running_at(vllm) == 1, 180)
                post(vllm, "/pause?mode=keep&clear_cache=false")
                paused = trainer.pause("keep")
                if paused.in_flight == 1:
                    break
                tries.append(outcome(in_flight, running_at(vllm)))
                trainer.resume(policy_version="step-0")
                post(vllm, "/resume")
            assert (paused.paused, paused.in_flight) == ("keep", 1), f"vLLM held no long call in 5 tries: {tries}"
            second = [*first, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
            held = background(short_agent.chat.completions.create, model="p", messages=second)
            wait_for(lambda: len(trainer.trajectory(short.id).turns) == 2)  # parked, held by the pause
            # vLLM's own pause ("wait") lets the call it runs finish on the weights it started with, then reloads
            post(vllm, "/resume")
            reload_weights(vllm, version="step-1")
            assert in_flight.result(timeout=120).choices[0].finish_reason == "length"
            resumed = trainer.resume(policy_version="step-1")
            assert resumed.released == 1
            held.result(timeout=60)

            (long_turn,) = trainer.trajectory(long.id).turns
            old_turn, new_turn = trainer.trajectory(short.id).turns
            assert [t.reply.policy_version for t in (old_turn, long_turn, new_turn) if t.reply] == [
                "step-0",
                "step-0",
                "step-1",
            ]
            assert trainer.trajectory(short.id).policy_versions == ["step-0", "step-1"]
            checks = [(long_turn, before), (new_turn, vllm.model_dir)]
            for turn, weights in checks:
                assert turn.reply is not None and turn.reply.logprobs is not None
                scored = ask(vllm.python, weights, score=sampled(turn.reply))["logprobs"]
                assert scored == pytest.approx(turn.reply.logprobs, abs=1e-3)
            assert new_turn.reply is not None
            assert ask(vllm.python, before, score=sampled(new_turn.reply))["logprobs"] != pytest.approx(
                new_turn.reply.logprobs, abs=1e-3
            )  # the held call was answered by the new weights
            every = [*trainer.trajectory(long.id).turns, *trainer.trajectory(short.id).turns]
            assert [turn.status for turn in every] == ["answered"] * 3  # nothing lost, nothing answered twice
        finally:
            with contextlib.suppress(RuntimeError, OSError):  # where the test stopped while vLLM held the long call
                post(vllm, "/resume")
            copy_model(before, vllm.model_dir)
            reload_weights(vllm)


def test_the_engines_sockets_are_in_a_directory_of_the_servers_own(vllm: Any) -> None:
    """vLLM names its engine's ZeroMQ sockets in $VLLM_RPC_BASE_PATH and leaves them behind when it is killed (the
    temporary directory filled with them, a few every start): each server is given a directory of its own."""
    pairs = Path(f"/proc/{vllm.pid}/environ").read_text().split("\0")
    environ = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
    sockets = Path(environ["VLLM_RPC_BASE_PATH"])
    assert sockets.name.startswith("vllm-rpc-") and sockets.parent == Path(tempfile.gettempdir())
    assert [path for path in sockets.iterdir() if path.is_socket()], f"vLLM put no socket in {sockets}"


def test_a_server_that_never_started_leaves_its_log_and_no_socket_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # This python has no vLLM: it exits at once.
    with pytest.raises(RuntimeError, match="exited with 1 before answering"), vllm_server(tmp_path, sys.executable):
        pass
    assert [path.name.startswith("vllm-") and path.suffix == ".log" for path in tmp_path.iterdir()] == [True]
