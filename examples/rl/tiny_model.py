"""Builds a tiny, randomly initialised chat model that a real vLLM can serve on a CPU, with no download.

    python examples/rl/tiny_model.py OUT_DIR      # run with the vLLM venv's python (.ci/vllm prints it)

The result is deterministic: the same script under the same library versions writes byte-identical files.
It holds
  - a byte-level BPE tokenizer (about 2,048 tokens) trained with `tokenizers` on the fixed corpus below, wrapped
    as a transformers `PreTrainedTokenizerFast` with ChatML tokens (`<|im_start|>`, `<|im_end|>` as eos) and the
    plain-text markers `<tool_call>`, `</tool_call>`, `<think>`, `</think>`, `<tool_response>`, `</tool_response>`
    each as one token;
  - a chat template in the Qwen2/Qwen3 style: tools in the system turn and hermes-style `<tool_call>` JSON in
    assistant turns, and, like Qwen3's, the reasoning (`reasoning_content`, or `<think>…</think>` at the start
    of the content) of assistant turns before the last user message left out when the history is rendered again.
    That makes a real case of "drift": the tokens a model sampled differ from the re-rendered history;
  - a `Qwen2ForCausalLM` with hidden size 64, 2 layers, 2 attention heads of 32 (vLLM's CPU attention needs a
    head size of 32, 64, 80, ...), 1 KV head, tied embeddings, float32, initialised with `torch.manual_seed(0)`.

A directory that already holds a model built by this very script (its stamp file names the script's sha256 and
the library versions) is left as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

STAMP = ".model_stamp"  # in every model folder publish writes (the tiny one, SmolLM2)
# Contractions, letter runs (with one leading non-letter), single digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOCAB_SIZE = 2048

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # special: skipped when decoding for content
MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]

# The fixed corpus. Simple English about colours, yes/no answers, digits and JSON, so that a tiny RL task
# ("answer with one colour word") has whole-word tokens to find. Generated below from these lists only.
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "brown", "grey"]
THING_WORDS = """
sky sea grass apple leaf car house door cat dog bird fish ball book cup hat shirt flower river stone tree box pen
chair table lamp boat road cloud moon sun star train bag shoe key egg cake tea
"""
THINGS = THING_WORDS.split()
PEOPLE = ["Anna", "Ben", "Clara", "David", "Emma", "Frank", "Grace", "Henry", "Ivy", "Jack", "the user", "the agent"]
VERBS = ["likes", "sees", "paints", "finds", "wants", "buys", "draws", "picks", "keeps", "gives", "makes", "has"]
QUESTIONS = [
    "What colour is the {thing}?",
    "Which colour do you like best?",
    "Answer with one colour word.",
    "Is the {thing} {colour}?",
    "Say one word: red, green or blue.",
    "Pick a colour for the {thing}.",
    "Do you like {colour}?",
    "Can you see the {thing}?",
    "How many {thing}s are there?",
    "Please answer yes or no.",
]
ANSWERS = [
    "The {thing} is {colour}.",
    "{Colour}.",
    "{colour}",
    "Yes, the {thing} is {colour}.",
    "No, the {thing} is not {colour}.",
    "yes",
    "no",
    "I think it is {colour}.",
    "There are {n} {thing}s.",
    "My answer is {colour}.",
]
PROSE = """\
This is a small text for a small model. It is written in plain English with short words.
A user asks a question and the assistant gives an answer. The answer is short and clear.
When the assistant needs a tool, it writes a tool call in JSON with a name and arguments.
The tool sends back a result, and the assistant reads it and then answers the user.
Good answers are short. Bad answers are long and wrong. The reward is one for a good answer and zero for a bad one.
The model thinks first, then it answers. It can say yes or no. It can count: one, two, three, four, five, six,
seven, eight, nine, ten. It knows the numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 2048.
The weather today is sunny and warm. Tomorrow it will rain. The file is saved. The test has passed.
Please read the file, list the folder, run the command and tell me what you see.
"""
# More everyday words, so that the BPE merges reach about 2,048 tokens of whole words and common pieces.
WORDS = """\
about above across act add after again against age ago air all almost alone along already also always am among
and animal another answer any appear area arm around art ask at away baby back bad bank base be bear beat beauty
bed before began begin behind believe below best better between big bill black body bone born both bottom bought
boy bread break bring brother build built burn busy but by call came camp can capital care carry case catch
cause cell cent centre certain chance change character charge check chief child choose church city class clean
clear climb clock close clothes coast coat cold collect come common company compare complete contain control
cook cool copy corn corner correct cost could country course cover cow create cross crowd cry current cut dance
dark day dead deal dear death decide deep degree depend describe desert design detail develop did die
different difficult dinner direct discover distant divide do doctor does done down draw dream dress drink drive
drop dry during each ear early earth east easy eat edge effect eight either electric else end enemy energy
enough enter equal even evening event ever every exact example except excite exercise expect experience eye
face fact fair fall family famous far farm fast father fear feel feet few field fight figure fill final fine
finger finish fire first fit five flat floor flow fly follow food foot for force forest form forward found
free fresh friend from front fruit full game garden gas gather gave general get girl give glad glass go gold
gone good got govern great ground group grow guess guide had hair half hand happen happy hard head hear heard
heart heat heavy held help her here high hill him his history hold hole home hope horse hot hour how huge
human hundred hunt hurry ice idea if important inch include increase indicate instrument interest invent iron
island it job join jump just keep kept kind king kitchen knew know lady lake land language large last late
laugh law lay lead learn least leave left leg length less let letter level lie life lift light like line
liquid list listen little live long look lost lot loud love low machine made main major make man many map
mark market master match matter may mean measure meat meet melody men metal method middle might mile milk
million mind minute miss modern moment money month more morning most mother mountain mouth move much music
must name nation natural nature near need never new next night nine noise none noon nor north nose note
nothing notice now number object observe ocean of off offer office often oil old on once only open operate
or order other our out over own page paint pair paper part party pass past path pay people perhaps person
picture piece place plain plan plane plant play please point poor position possible pound power practice
prepare present press pretty print probable problem process produce product proper protect proud prove pull
push put quick quiet quite race radio rain raise ran rather reach read ready real reason receive record region
remember repeat reply rest result rich ride right ring rise rock roll room root rope round row rule safe said
sail salt same sand save say school science score season seat second section seed seem self sell send sense
sentence serve set settle seven shall shape share sharp she ship shop short should shoulder shout show side
sight sign silent silver simple since sing single sister sit size skill skin sleep slow small smell smile
snow so soft soil soldier some son song soon sound south space speak special speed spell spend spoke spot
spring square stand start state stay steam steel step stick still stop store story straight strange stream
street strong student study subject such sudden sugar suggest summer supply sure surface surprise swim
system take talk teach team tell ten term test than thank that the their them then there these they thick
thin thing think third this those though thought thousand three through throw thus time tiny tire to
together told tone too took tool top total touch toward town track trade travel trip trouble true try turn
twenty type under unit until up us use usual valley value very visit voice vowel wait walk wall want war
warm was wash watch water wave way we wear weather week weight well went were west what wheel when where
which while who whole why wide wife wild will win wind window wing winter wire wise wish with woman wonder
wood word work world would write written wrong yard year yet you young your
"""
TOOLS = [
    ("get_weather", {"city": "Paris"}),
    ("get_colour", {"thing": "sky"}),
    ("add", {"a": 2, "b": 3}),
    ("read_file", {"path": "notes.txt"}),
    ("list_dir", {"path": "."}),
    ("run", {"command": "ls -la"}),
    ("search", {"query": "blue sky", "limit": 5}),
]


def corpus() -> list[str]:
    """The training text: the same list every time (no randomness, no files)."""
    lines = PROSE.splitlines()
    for i, thing in enumerate(THINGS):
        for j, colour in enumerate(COLOURS):
            person = PEOPLE[(i + j) % len(PEOPLE)]
            verb = VERBS[(i * 3 + j) % len(VERBS)]
            fill = {"thing": thing, "colour": colour, "Colour": colour.capitalize(), "n": (i * 7 + j) % 13}
            lines.append(f"{person} {verb} the {colour} {thing}.")
            lines.append(QUESTIONS[(i + 2 * j) % len(QUESTIONS)].format(**fill))
            lines.append(ANSWERS[(2 * i + j) % len(ANSWERS)].format(**fill))
            lines.append(json.dumps({"thing": thing, "colour": colour, "count": fill["n"], "ok": (i + j) % 2 == 0}))
    for name, args in TOOLS:
        call = {"name": name, "arguments": args}
        lines.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        lines.append(json.dumps({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}))
        lines.append(f"<tool_response>\n{json.dumps({'result': 'ok', 'value': len(name)})}\n</tool_response>")
    words = WORDS.split()
    for i in range(0, len(words), 9):
        chunk = words[i : i + 9]
        lines.append(" ".join(chunk).capitalize() + ".")
        lines.append(", ".join(chunk[::-1]) + "?")
    for n in range(200):
        lines.append(f'{n} + {n % 10} = {n + n % 10}; [{n}, {n * 2}, {n * 3}] {{"n": {n}}}')
    lines += ["yes", "no", "Yes", "No", "red", "green", "blue", "Red", "Green", "Blue", " red", " green", " blue"]
    return lines


# The chat template (Jinja, rendered by transformers and by vLLM alike). Written for this model: ChatML turns,
# tools as JSON lines in the system turn, tool calls as <tool_call> JSON, tool results as user turns of
# <tool_response> blocks, and reasoning kept only for the assistant turns after the last user message.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set first_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if first_system -%}{{- messages[0].content ~ '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nThese functions may be called. "
    "Their JSON schemas, one a line, inside <tools></tools>:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' ~ (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments between <tool_call> and "
    '</tool_call>:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>'
    "<|im_end|>\\n' -}}"
    "{%- elif first_system -%}"
    "{{- '<|im_start|>system\\n' ~ messages[0].content ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'user' or m.role == 'system' -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ (m.content or '') ~ '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content or '' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif m.reasoning is string -%}{%- set reasoning = m.reasoning -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user and reasoning -%}"
    "{{- '<think>\\n' ~ reasoning.strip('\\n') ~ '\\n</think>\\n\\n' ~ content.lstrip('\\n') -}}"
    "{%- else -%}"
    "{{- content.lstrip('\\n') -}}"
    "{%- endif -%}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    '{{- \'<tool_call>\\n{"name": "\' ~ f.name ~ \'", "arguments": \' -}}'
    "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ (m.content or '') ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def script_hash() -> str:
    """The sha256 of this file: a model built by another version of the script is rebuilt."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def stamp_text() -> str:
    from importlib.metadata import version  # not the imports themselves: a cached build answers in milliseconds

    versions = " ".join(f"{name}={version(name)}" for name in ("torch", "transformers", "tokenizers", "safetensors"))
    return f"{script_hash()} {versions}\n"


def build_tokenizer(out: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AddedToken, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # The same normalisation and splitting as Qwen2's tokenizers (digits one by one, words with their leading
    # space): transformers 5 loads a "qwen2" model's tokenizer.json into its Qwen2Tokenizer class, which imposes
    # them, so any other choice would tokenise differently under vLLM than under tokenizers or transformers 4.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKERS),  # the markers are added after training
        min_frequency=1,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=None,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    # Plain-text markers: one token each, but not special, so they stay in decoded content (vLLM decodes with
    # skip_special_tokens) where the hermes tool parser and reasoning readers look for them.
    fast.add_tokens([AddedToken(m, special=False, normalized=False) for m in MARKERS])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Name the class that transformers 4 and 5 both know (5 writes its new name, TokenizersBackend).
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return fast


def build_model(out: Path, tokenizer) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: vLLM's CPU attention has no kernel for 16
        num_key_value_heads=1,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        use_sliding_window=False,
        dtype="float32",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out, safe_serialization=True)


def build(out_dir: str | os.PathLike[str]) -> Path:
    """Builds the model into out_dir unless it already holds this script's build; returns its path."""

    def fill(folder: Path) -> None:
        build_model(folder, build_tokenizer(folder))

    return publish(out_dir, stamp_text(), fill)


def publish(out_dir: str | os.PathLike[str], stamp: str, fill: Callable[[Path], None]) -> Path:
    """A model folder at out_dir written by fill, unless out_dir holds one with this stamp already (its STAMP file,
    written last). Filled beside its place and renamed in, so a reader never sees half a model and two builders
    don't mix. Also examples/models/smollm2.py's."""
    out = Path(out_dir).resolve()
    if (out / STAMP).is_file() and (out / STAMP).read_text() == stamp:
        return out
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        (tmp / STAMP).write_text(stamp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / "model")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not ((out / STAMP).is_file() and (out / STAMP).read_text() == stamp):  # another builder won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str], build: Callable[[str], Path] = build) -> int:
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUT_DIR", file=sys.stderr)
        return 2
    print(build(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
