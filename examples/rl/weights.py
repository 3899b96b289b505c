"""Pushes a trainer's new weights into a running vLLM server, without restarting it.

    push_weights(model, model_dir, base_url)   # model: a transformers model (or any torch module)

The server must serve `model_dir` and run with VLLM_SERVER_DEV_MODE=1 (vLLM 0.32; testkit/vllm_server.py starts
it so), which adds the routes used here:

    POST /pause?mode=wait                       running requests finish on the old weights, new ones wait
    POST /collective_rpc {"method": "reload_weights"}   every worker reads the model folder's safetensors again
    POST /reset_prefix_cache                    cached KV blocks were computed with the old weights
    POST /update_weight_version {"new_version": "..."}  (optional) a tag, read back with GET /weight_info
    POST /resume

On the CPU build this takes about 50 ms for the tiny model. Only the standard library is used for HTTP. A model
whose output layer is tied to its input embedding is not fully reloaded on the CPU build (the output layer's
prepacked matrix keeps the old weights): serve an untied copy (`integrations.train.weights.served_copy`), or
restart the server.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from integrations.train.vllm import reload_weights  # the one recipe, shared with the tests and trajproxy train
from integrations.train.weights import WEIGHT_FILES, save_weights


def push_weights(model: Any, model_dir: str | os.PathLike[str], base_url: str, *, version: str | None = None) -> float:
    """Saves the model's weights into the folder the server serves and makes the server load them.
    Returns the seconds the server took to switch (saving not included)."""
    save_weights(model, model_dir)
    return reload_weights(base_url, version=version)


def restore_weights(source_dir: str | os.PathLike[str], model_dir: str | os.PathLike[str], base_url: str) -> float:
    """Copies another folder's weights (e.g. the initial model's) into the served folder and loads them."""
    for pattern in WEIGHT_FILES:
        for path in Path(source_dir).glob(pattern):
            tmp = Path(model_dir) / f".{path.name}.tmp"
            shutil.copyfile(path, tmp)
            os.replace(tmp, Path(model_dir) / path.name)
    return reload_weights(base_url)
