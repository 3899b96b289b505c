"""An agent and a trainer as programs of their own, for tests that kill, freeze or cut them off.

    python -m tests.actors agent BASE_URL KEY TEXT [--stream] [--retries N]
    python -m tests.actors trainer BASE_URL --turns N --lease-s S
    python -m tests.actors poller BASE_URL

Each says what it is doing on stdout, one JSON object per line, flushed, so a test knows when to strike:
the agent `{"calling": TEXT}`, then `{"streaming": true}` once a stream's headers are in, then
`{"content": ...}` or `{"error": ...}`; the trainer `{"pulled": [turns]}`, then, when a line `reply` comes on
stdin, replies to each turn under the lease it pulled it with and prints `{"statuses": [...]}`; the poller
`{"polling": true}` before a long poll it is not meant to live through.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

WAIT_S = 30.0  # bound on every wait here: a test kills these programs, but never waits on them forever


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def agent(base_url: str, key: str, text: str, stream: bool, retries: int) -> int:
    import openai

    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=retries, timeout=WAIT_S * 4) as client:
        messages: Any = [{"role": "user", "content": text}]
        say(calling=text)
        try:
            if stream:
                chunks = client.chat.completions.create(model="m", messages=messages, stream=True)
                say(streaming=True)
                content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            else:
                content = client.chat.completions.create(model="m", messages=messages).choices[0].message.content or ""
        except openai.OpenAIError as e:
            say(error=f"{type(e).__name__}: {e}")
            return 1
        say(content=content)
        return 0


def trainer(base_url: str, turns: int, lease_s: float) -> int:
    from proxy.client import TrainerClient, TrajproxyAPIError

    with TrainerClient(base_url) as client:
        pulled: list[Any] = []
        deadline = time.monotonic() + WAIT_S
        while len(pulled) < turns and time.monotonic() < deadline:
            pulled += client.next_turns(max=turns - len(pulled), wait_s=1.0, lease_s=lease_s)
        say(pulled=[{"id": t.id, "lease_id": t.lease_id, "deliveries": t.deliveries} for t in pulled])
        if sys.stdin.readline().strip() != "reply":
            return 0
        statuses = []
        for turn in pulled:
            try:
                client.reply(turn.id, f"late from the trainer that pulled {turn.lease_id}", lease_id=turn.lease_id)
                statuses.append(200)
            except TrajproxyAPIError as e:
                statuses.append(e.status)
        say(statuses=statuses)
    return 0


def poller(base_url: str) -> int:
    from proxy.client import TrainerClient

    with TrainerClient(base_url) as client:
        say(polling=True)
        got = client.next_turns(max=8, wait_s=WAIT_S, lease_s=120)
        say(pulled=[turn.id for turn in got])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    as_agent = roles.add_parser("agent")
    as_agent.add_argument("base_url")
    as_agent.add_argument("key")
    as_agent.add_argument("text")
    as_agent.add_argument("--stream", action="store_true")
    as_agent.add_argument("--retries", type=int, default=0)
    as_trainer = roles.add_parser("trainer")
    as_trainer.add_argument("base_url")
    as_trainer.add_argument("--turns", type=int, required=True)
    as_trainer.add_argument("--lease-s", type=float, required=True)
    as_poller = roles.add_parser("poller")
    as_poller.add_argument("base_url")
    args = parser.parse_args()
    if args.role == "agent":
        return agent(args.base_url, args.key, args.text, args.stream, args.retries)
    if args.role == "trainer":
        return trainer(args.base_url, args.turns, args.lease_s)
    return poller(args.base_url)


if __name__ == "__main__":
    sys.exit(main())
