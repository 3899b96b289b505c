"""What the served model's own tokenizer and weights say, asked in the vLLM environment (transformers lives there, not
in trajproxy's): the chat template's ids for a request, the text of ids, the logprobs the weights give; and new
weights written in place of the old, as a training step would."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

_SCRIPT = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

def answer(asked):
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

everything = json.load(sys.stdin)
tokenizer = AutoTokenizer.from_pretrained(everything["model_dir"])
if "batch" in everything:  # many questions, one start of the interpreter
    json.dump({"batch": [answer({**everything, **one}) for one in everything["batch"]]}, sys.stdout)
else:
    json.dump(answer(everything), sys.stdout)

"""


def ask(python: str, model_dir: str | os.PathLike[str], **question: Any) -> dict[str, Any]:
    done = subprocess.run(
        [python, "-c", _SCRIPT],
        input=json.dumps({"model_dir": str(model_dir), **question}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"the tokenizer check failed: {done.stderr[-2000:]}")
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer
