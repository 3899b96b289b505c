"""What the served model's own tokenizer and weights say, asked in the vLLM environment (transformers lives there, not
in trajproxy's): the chat template's ids for a request, the text of ids, the logprobs the weights give; and new
weights written in place of the old, as a training step would."""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import IO, Any

_SCRIPT = r"""
import json, sys, traceback
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tokenizers = {}  # by model folder: a tokenizer's files never change (new weights do: a score reads them anew)

def answer(asked):
  tokenizer = tokenizers.get(asked["model_dir"])
  if tokenizer is None:
      tokenizer = tokenizers[asked["model_dir"]] = AutoTokenizer.from_pretrained(asked["model_dir"])
  out = {}
  if "messages" in asked:
      out["ids"] = list(tokenizer.apply_chat_template(
          asked["messages"], tools=asked.get("tools"), add_generation_prompt=True, tokenize=True, return_dict=False,
          chat_template=asked.get("chat_template"),
      ))
  if "decode" in asked:
      out["text"] = tokenizer.decode(asked["decode"], skip_special_tokens=True)
  if "decode_all" in asked:
      out["text"] = tokenizer.decode(asked["decode_all"], skip_special_tokens=False)
  if "encode" in asked:
      out["ids"] = tokenizer.encode(asked["encode"], add_special_tokens=False)
  if "score" in asked:
      prompt, completion = asked["score"]
      model = AutoModelForCausalLM.from_pretrained(asked["model_dir"], torch_dtype=torch.float32).eval()
      ids = torch.tensor([prompt + completion])
      with torch.no_grad():
          logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
      picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
      out["logprobs"] = picked.tolist()
  if "perturb" in asked:  # new weights, as a training step would leave them, written where the server reads them
      model = AutoModelForCausalLM.from_pretrained(asked["model_dir"], torch_dtype=torch.float32)
      torch.manual_seed(asked["perturb"])
      with torch.no_grad():
          for name, parameter in model.named_parameters():
              # vLLM 0.32's in-place reload on the CPU leaves the output layer's prepacked GEMM (tied to the
              # embedding) on the old weights: the example trainer freezes those, and so do these steps.
              if "embed_tokens" not in name and "lm_head" not in name:
                  parameter.add_(torch.randn_like(parameter) * 0.5)
      model.save_pretrained(asked["model_dir"])
  return out

for line in sys.stdin:  # a question a line, an answer a line, until the asker closes its end
  everything = json.loads(line)
  try:
      if "batch" in everything:  # many questions at once
          said = {"batch": [answer({**everything, **one}) for one in everything["batch"]]}
      else:
          said = answer(everything)
  except Exception:
      said = {"error": traceback.format_exc()}
  sys.stdout.write(json.dumps(said) + "\n")
  sys.stdout.flush()
"""


@dataclass
class _Asker:
    process: subprocess.Popen[str]
    stderr: IO[bytes]  # a file, not a pipe: what torch and transformers warn never fills a buffer nobody reads


_ASKERS: dict[str, _Asker] = {}  # by python: one interpreter a process (torch's import: 5 s of CPU)
_LOCK = threading.Lock()
TIMEOUT_S = 120


def ask(python: str, model_dir: str | os.PathLike[str], **question: Any) -> dict[str, Any]:
    """The served model's own answer to `question`, from an interpreter in `python`'s environment that stays for
    the next question (one at a time; a question that fails to be answered ends it, and the next starts another)."""
    with _LOCK:
        asker = _ASKERS.get(python)
        if asker is None or asker.process.poll() is not None:
            stderr = tempfile.TemporaryFile()  # noqa: SIM115 (it lives as long as its interpreter)
            process = subprocess.Popen(
                [python, "-c", _SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
            )
            asker = _ASKERS[python] = _Asker(process, stderr)
        line = _exchange(asker.process, json.dumps({"model_dir": str(model_dir), **question}))
        if line is None:
            asker.process.kill()
            asker.process.wait()
            asker.stderr.seek(0)
            said = asker.stderr.read().decode(errors="replace")
            raise RuntimeError(f"the tokenizer check gave no answer in {TIMEOUT_S} s: {said[-2000:]}")
    answer: dict[str, Any] = json.loads(line)
    if "error" in answer:
        raise RuntimeError(f"the tokenizer check failed: {answer['error'][-2000:]}")
    return answer


def _exchange(process: subprocess.Popen[str], question: str) -> str | None:
    """The answer's line, or None where the interpreter ended or said nothing for TIMEOUT_S."""
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write(question + "\n")
        process.stdin.flush()
    except BrokenPipeError:
        return None
    ready, _, _ = select.select([process.stdout], [], [], TIMEOUT_S)
    return (process.stdout.readline() or None) if ready else None
