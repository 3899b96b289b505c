"""A trainer's weights into the vLLM that serves them, and the check that it serves them: the served model's
logprobs of a sampled sequence against the trainer's own.

    served_copy(model_dir, served_dir)              # a copy vLLM can reload in place (output layer untied)
    save_weights(model, served_dir)                 # new safetensors, file by file with a rename
    served_logprobs(server, ids), trainer_logprobs(model, ids)   # each id's logprob, given those before it
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from integrations.train.vllm import VllmServer

WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")


def served_copy(model_dir: str | os.PathLike[str], served_dir: str | os.PathLike[str]) -> None:
    """Copies a model folder into `served_dir`, its output layer untied from its input embedding.

    Why: vLLM 0.32's in-place weight reload loads a tied model's new embedding but leaves its output layer at the old
    weights, so the server would sample from another policy than the one trained. Untied, both are tensors of their
    own in the checkpoint and both reload; the trainer trains the untied model, so the two stay the same."""
    import torch  # lazy: the train extra's; `trajproxy train` loads this module before checking it is there
    from transformers import AutoModelForCausalLM

    shutil.rmtree(served_dir, ignore_errors=True)
    shutil.copytree(model_dir, served_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
        model.save_pretrained(served_dir)


def save_weights(model: Any, model_dir: str | os.PathLike[str]) -> None:
    """Writes the model's weights as safetensors into model_dir, replacing the old ones file by file with a rename
    (a reader sees the old file or the new one, never half of one). Config and tokenizer stay."""
    model_dir = Path(model_dir)
    with tempfile.TemporaryDirectory(prefix=".weights.", dir=model_dir.parent) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        new = {p.name for pattern in WEIGHT_FILES for p in Path(tmp).glob(pattern)}
        if not new:
            raise RuntimeError(f"saving {type(model).__name__} wrote no safetensors")
        for name in sorted(new):
            os.replace(os.path.join(tmp, name), model_dir / name)
        for pattern in WEIGHT_FILES:  # shards of an earlier, differently sharded save
            for old in model_dir.glob(pattern):
                if old.name not in new:
                    old.unlink()


def served_logprobs(server: VllmServer, ids: list[int]) -> list[float | None]:
    """The server's logprob of each id given those before it (None for the first), sampling nothing."""
    body = {"model": server.served_name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0}
    request = urllib.request.Request(
        f"{server.base_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        scored = json.load(reply)["choices"][0]["prompt_logprobs"]
    return [None if entry is None else float(entry[str(i)]["logprob"]) for i, entry in zip(ids, scored, strict=True)]


def trainer_logprobs(model: Any, ids: list[int]) -> list[float]:
    """The trainer's logprob of each id after the first, given those before it."""
    import torch  # lazy: as in served_copy

    with torch.no_grad():
        tokens = torch.tensor([ids], device=model.device)
        logits = model(tokens).logits[0, :-1].float()
        scored: list[float] = torch.log_softmax(logits, dim=-1).gather(1, tokens[0, 1:, None])[:, 0].tolist()
    return scored
