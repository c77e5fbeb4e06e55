"""The run model's tokenizer in the web process (a small thread-safe LRU, local files only) and token display texts."""
from __future__ import annotations

import codecs
import functools
import importlib
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

logger = logging.getLogger(__name__)

CACHED_TOKENIZERS = 4
"""Tokenizers kept loaded (a few runs' models at once); the least recently used one is dropped first."""
CACHED_TEXTS = 16
"""Samples whose decoded token texts are kept (a 32k-token sample's texts are a few hundred kB)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model")
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")
"""One of these must be there: the vocabulary itself (a tokenizer_config.json alone does not decode anything)."""


@dataclass(frozen=True)
class Loaded:
    """A model folder's tokenizer, or why there is none (`tokenizer` None and `note` saying why)."""

    key: tuple
    tokenizer: Any = None
    note: str = ""


class _LRU:
    """A tiny thread-safe LRU: the web process serves requests from several threads."""

    def __init__(self, size: int):
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key):
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


_tokenizers = _LRU(CACHED_TOKENIZERS)
_texts = _LRU(CACHED_TEXTS)
_load_lock = threading.Lock()  # one load at a time: two requests for a cold model must not both pay for it


def warm_up() -> threading.Thread:
    """Import transformers' AutoTokenizer in a daemon thread, so that the web process's first token view does not
    pay for it (seconds: it imports torch). Meant for the web server's start (lightning_web/asgi.py)."""
    def load() -> None:
        try:
            importlib.import_module("transformers.models.auto.tokenization_auto")
        except Exception:
            logger.warning("could not import transformers for the token view", exc_info=True)

    thread = threading.Thread(target=load, name="tokenizer-warm-up", daemon=True)
    thread.start()
    return thread


def clear_caches() -> None:
    _tokenizers.clear()
    _texts.clear()


def _folder_key(folder: Path) -> tuple | None:
    """(path, newest mtime of the folder and its tokenizer files), or None when the folder is gone.

    The mtime is in the key so a folder rewritten in place (a model re-imported under the same name) is reloaded.
    """
    try:
        stamps = [folder.stat().st_mtime_ns]
    except OSError:
        return None
    for name in TOKENIZER_FILES:
        try:
            stamps.append((folder / name).stat().st_mtime_ns)
        except OSError:
            pass
    return (str(folder), max(stamps))


def load_tokenizer(path: str) -> Loaded:
    """The tokenizer of the model folder `path` (a checkpoint folder works the same), loaded once per folder version.

    Only local files are read (`local_files_only`, and `path` must be an existing folder), so a page never waits on
    a download. A folder that is gone or does not load gives `tokenizer` None and a note; pages then show ids.
    """
    if not path:
        return Loaded(key=("", 0), note="The run's model is served by an external engine: no tokenizer to decode with.")
    folder = Path(path)
    key = _folder_key(folder)
    if key is None or not folder.is_dir():
        return Loaded(key=(str(folder), 0), note=f"The model folder {folder} is gone: showing token ids only.")
    if not any((folder / name).is_file() for name in VOCABULARY_FILES):
        # transformers would build an empty tokenizer from config.json alone (every id decodes to nothing)
        return Loaded(key=key, note=f"The model folder {folder} holds no tokenizer files: showing token ids only.")
    found = _tokenizers.get(key)
    if found is not None:
        return found
    with _load_lock:
        found = _tokenizers.get(key)
        if found is None:
            found = _load(folder, key)
            _tokenizers.put(key, found)
    return found


def _load(folder: Path, key: tuple) -> Loaded:
    from transformers import AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: local_files_only already forbids the hub
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # any broken folder: the page still shows ids, with the reason
        logger.warning("could not load the tokenizer of %s", folder, exc_info=True)
        return Loaded(key=key, note=f"The tokenizer in {folder} did not load ({type(exc).__name__}: {exc}): "
                                    "showing token ids only.")
    logger.info("loaded the tokenizer of %s", folder)
    return Loaded(key=key, tokenizer=tokenizer)


def cached_token_texts(loaded: Loaded, cache_key: Any, ids: Sequence[int]) -> list[str] | None:
    """token_texts for `ids`, kept per (cache_key, tokenizer version): a sample's chunks decode it once."""
    if loaded.tokenizer is None:
        return None
    key = (cache_key, loaded.key)
    texts = _texts.get(key)
    if texts is None or len(texts) != len(ids):
        texts = token_texts(loaded.tokenizer, ids)
        _texts.put(key, texts)
    return texts


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """The text each token adds, so that "".join(texts) == tokenizer.decode(ids) (special tokens included).

    Decoding each id alone is wrong for byte-level BPE: a character of several bytes may be split over tokens,
    and each piece alone decodes to U+FFFD. Here a token that ends part way through a character adds "" and the
    token that completes it adds the whole character.
    """
    if _is_byte_level(tokenizer):
        return _byte_level_texts(tokenizer, ids)
    return _incremental_texts(tokenizer, ids)


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and type(backend.decoder).__name__ == "ByteLevel"


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the symbol a vocabulary piece uses -> the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def _byte_level_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Map each token's byte-level symbols back to bytes and feed them through one incremental UTF-8 decoder."""
    byte_of = _byte_of_char()
    added = {i: token.content for i, token in tokenizer.added_tokens_decoder.items()}
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    texts = []
    for token_id, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids))):
        if token_id in added:
            texts.append(decoder.decode(b"", final=True) + added[token_id])
            decoder.reset()
        elif piece is None:  # an id outside the vocabulary: say so rather than fail the page
            texts.append(decoder.decode(b"", final=True) + f"<unk {token_id}>")
            decoder.reset()
        else:
            texts.append(decoder.decode(bytes(byte_of.get(c, 0x3F) for c in piece)))
    if texts:
        texts[-1] += decoder.decode(b"", final=True)
    return texts


def _incremental_texts(tokenizer, ids: Sequence[int], window: int = 6) -> list[str]:
    """Any other tokenizer (SentencePiece, WordPiece): decode a short window before and after each token.

    The difference is the text the token adds (in context, so a SentencePiece word start keeps its space); text
    ending in U+FFFD is held back until a later token completes the character (vLLM's incremental detokenizer).
    """
    ids = list(ids)
    texts: list[str] = []
    prefix, read = 0, 0  # decode(ids[prefix:read]) is the text already given out of the current window
    for i in range(len(ids)):
        before = tokenizer.decode(ids[prefix:read], clean_up_tokenization_spaces=False)
        after = tokenizer.decode(ids[prefix:i + 1], clean_up_tokenization_spaces=False)
        if after.endswith("\ufffd") and i + 1 < len(ids):
            texts.append("")
            continue
        texts.append(after[len(before):] if after.startswith(before) else after)
        read = i + 1
        prefix = max(0, read - window)
    return texts
