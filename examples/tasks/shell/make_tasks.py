"""Writes the shell tasks: short file tasks in /work, each graded by a shell test of the files the agent left.

    python3 examples/tasks/shell/make_tasks.py    # rewrites files/, train.jsonl and heldout.jsonl here
    docker build -t trajproxy-example/shell examples/tasks/shell

One kind, sized to SmolLM2-135M-Instruct (whose untrained pass rate on it is between 5% and 60%): create a file that
holds a given word, graded by `grep -qiw WORD FILE`. Renaming a file (`mv`) and counting a file's lines into a file
(`wc -l`) were tried first and left out: the untrained model passed none of 20 such held-out episodes
(benchmarks/RESULTS.md, section 37).
The train and held-out splits share no instance (no (file, word) pair is in both). Everything is deterministic:
the same files every time. The files in /work (a few lists of words) are there to look around in.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
IMAGE = "trajproxy-example/shell"
WORKDIR = "/work"
WORDS = [
    "apple",
    "banana",
    "cherry",
    "grape",
    "lemon",
    "mango",
    "melon",
    "olive",
    "peach",
    "pear",
    "plum",
    "berry",
    "red",
    "blue",
    "green",
    "black",
    "white",
    "pink",
    "gray",
    "gold",
    "cat",
    "dog",
    "fox",
    "owl",
    "bee",
    "cow",
    "pig",
    "hen",
    "ant",
    "bat",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "wind",
    "rock",
    "sand",
    "tree",
    "leaf",
]
NAMES = [
    "note",
    "memo",
    "hello",
    "greet",
    "word",
    "answer",
    "result",
    "output",
    "data",
    "info",
    "label",
    "tag",
    "item",
    "entry",
    "token",
    "name",
]
# The files in the image, for counting and renaming: each a list of words, of its own length.
FILES = {
    "colors.txt": 3,
    "animals.txt": 4,
    "fruits.txt": 5,
    "cities.txt": 6,
    "tools.txt": 7,
    "planets.txt": 8,
    "numbers.txt": 9,
    "days.txt": 2,
}


def files() -> dict[str, str]:
    picks = random.Random(7)
    return {name: "".join(f"{picks.choice(WORDS)}\n" for _ in range(lines)) for name, lines in FILES.items()}


def instances() -> list[tuple[str, str, str]]:
    """Every (prompt, eval_cmd, key) instance, the key naming what makes it one (the file's name and the word)."""
    found = []
    for name in NAMES:
        for word in WORDS:
            prompt = (
                f"Create a file named {name}.txt that contains the word {word}. Use echo with > in one bash command."
            )
            found.append((prompt, f"grep -qiw {word} {name}.txt", f"create:{name}:{word}"))
    return found


def split(train: int, heldout: int, seed: int) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """Disjoint splits of the instances shuffled by `seed`: no (file, word) pair is in both."""
    found = instances()
    random.Random(seed).shuffle(found)
    rows: list[dict[str, object]] = [
        {"prompt": prompt, "label": key, "metadata": {"image": IMAGE, "workdir": WORKDIR, "eval_cmd": check}}
        for prompt, check, key in found[: train + heldout]
    ]
    return rows[:train], rows[train:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=64, help="tasks in the train split (default: 64)")
    parser.add_argument("--heldout", type=int, default=24, help="tasks in the held-out split (default: 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    folder = args.out / "files"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files().items():
        (folder / name).write_text(text)
    train, heldout = split(args.train, args.heldout, args.seed)
    assert not {r["label"] for r in train} & {r["label"] for r in heldout}, "the splits share an instance"
    for name, picked in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        (args.out / name).write_text("".join(json.dumps(row) + "\n" for row in picked))
    print(f"{len(train)} train and {len(heldout)} held-out tasks in {args.out}")


if __name__ == "__main__":
    main()
