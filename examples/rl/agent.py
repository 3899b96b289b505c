"""A tiny agent: asks one question on the plain `openai` SDK and prints the answer. It knows nothing of trajproxy
or of training; like any agent, it only reads OPENAI_BASE_URL and OPENAI_API_KEY.

    OPENAI_BASE_URL=... OPENAI_API_KEY=... python examples/rl/agent.py "What colour is the sky?"
"""

from __future__ import annotations

import sys

import openai


def main() -> None:
    question = " ".join(sys.argv[1:]) or "Which colour do you like best? Answer with one colour word."
    client = openai.OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
    reply = client.chat.completions.create(
        model="policy",  # whichever model answers is the environment's business
        messages=[
            {"role": "system", "content": "You answer with one colour word."},
            {"role": "user", "content": question},
        ],
    )
    print(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()
