"""catalog.tokenizers: the model folder's tokenizer, cached per folder version; the text each token adds."""
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from catalog import tokenizers

CHAT = 'héllo 世界 <|im_start|>user\n  def x():\n\treturn 1 🎉<tool_call>{"a": 1}</tool_call><|im_end|>\n'


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """The tokenizer files trainer.models.build_tiny_model writes (byte-level BPE, ChatML), without the weights."""
    from trainer.models import build_tiny_tokenizer

    folder = tmp_path_factory.getbasetemp() / "tiny-tokenizer"
    if not (folder / "tokenizer.json").exists():
        build_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def empty_caches():
    tokenizers.clear_caches()
    yield
    tokenizers.clear_caches()


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace, no byte level): the incremental decoding path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.models import _tiny_corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_tiny_corpus(), trainer=trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                                       show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", clean_up_tokenization_spaces=False)


def prefix_texts(tokenizer, ids):
    """Reference (quadratic, for valid text): token i adds decode(ids[:i+1]) minus the text given so far; a prefix
    ending in a partial character (U+FFFD) adds nothing yet."""
    texts, given = [], ""
    for i in range(len(ids)):
        after = tokenizer.decode(ids[:i + 1], clean_up_tokenization_spaces=False)
        if after.endswith("\ufffd") and i + 1 < len(ids):
            texts.append("")
            continue
        assert after.startswith(given)
        texts.append(after[len(given):])
        given = after
    return texts


def test_it_gives_each_token_the_text_it_adds(tiny_tokenizer_dir):
    tokenizer = tokenizers.load_tokenizer(str(tiny_tokenizer_dir)).tokenizer
    ids = tokenizer.encode(CHAT)
    texts = tokenizers.token_texts(tokenizer, ids)
    assert len(texts) == len(ids)
    assert "".join(texts) == tokenizer.decode(ids) == CHAT
    assert "\ufffd" not in "".join(texts)
    for char in ("é", "世", "界", "🎉"):  # split over byte tokens: the last piece carries the whole character
        at = texts.index(char)
        assert ids[at] != ids[at - 1] and texts[at - 1] == ""
    assert [texts[ids.index(tokenizer.convert_tokens_to_ids(t))] for t in ("<|im_start|>", "<tool_call>")] == [
        "<|im_start|>", "<tool_call>"]
    assert "\n" in texts and "\t" in texts  # whitespace is kept, for the page to show


def test_it_matches_the_reference_on_valid_text_and_decode_on_any_ids(tiny_tokenizer_dir):
    tokenizer = tokenizers.load_tokenizer(str(tiny_tokenizer_dir)).tokenizer
    ids = tokenizer.encode(CHAT * 3)
    assert tokenizers.token_texts(tokenizer, ids) == prefix_texts(tokenizer, ids)
    rng = random.Random(5)
    for _ in range(100):  # random ids: broken UTF-8 too; the pieces still spell what decode gives
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
        assert "".join(tokenizers.token_texts(tokenizer, ids)) == tokenizer.decode(ids)


def test_a_tokenizer_without_byte_level_decodes_incrementally(metaspace_tokenizer):
    text = "The answer is 42. What is the reward of the agent? Return the value."
    ids = metaspace_tokenizer.encode(text)
    texts = tokenizers.token_texts(metaspace_tokenizer, ids)
    assert texts == prefix_texts(metaspace_tokenizer, ids)
    assert "".join(texts) == metaspace_tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    assert any(t.startswith(" ") for t in texts[1:])  # a word start keeps its space in context


def test_it_loads_a_folder_once_and_again_after_it_changes(tiny_tokenizer_dir, caplog):
    caplog.set_level("INFO", logger="catalog.tokenizers")
    first = tokenizers.load_tokenizer(str(tiny_tokenizer_dir))
    assert first.tokenizer is not None and first.note == ""
    assert tokenizers.load_tokenizer(str(tiny_tokenizer_dir)) is first
    stamp = os.stat(tiny_tokenizer_dir / "tokenizer.json")
    os.utime(tiny_tokenizer_dir / "tokenizer.json", ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 5_000_000_000))
    again = tokenizers.load_tokenizer(str(tiny_tokenizer_dir))
    assert again is not first and again.tokenizer is not first.tokenizer
    assert again.key[1] > first.key[1]
    assert [r.message for r in caplog.records].count(f"loaded the tokenizer of {tiny_tokenizer_dir}") == 2


def test_threads_asking_for_a_cold_tokenizer_load_it_once(tiny_tokenizer_dir, caplog):
    caplog.set_level("INFO", logger="catalog.tokenizers")
    got, barrier = [], threading.Barrier(6)

    def ask():
        barrier.wait()
        got.append(tokenizers.load_tokenizer(str(tiny_tokenizer_dir)))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(got) == 6 and all(loaded is got[0] for loaded in got)
    assert [r.message for r in caplog.records].count(f"loaded the tokenizer of {tiny_tokenizer_dir}") == 1


def test_the_cache_keeps_a_few_tokenizers(tiny_tokenizer_dir, tmp_path):
    import shutil

    folders = []
    for n in range(tokenizers.CACHED_TOKENIZERS + 1):
        folders.append(shutil.copytree(tiny_tokenizer_dir, tmp_path / f"m{n}"))
    loaded = [tokenizers.load_tokenizer(str(folder)) for folder in folders]
    assert tokenizers.load_tokenizer(str(folders[-1])) is loaded[-1]
    assert tokenizers.load_tokenizer(str(folders[0])) is not loaded[0]  # the least recently used was dropped


def test_a_missing_or_broken_folder_gives_a_note_and_no_tokenizer(tmp_path):
    gone = tokenizers.load_tokenizer(str(tmp_path / "deleted-model"))
    assert gone.tokenizer is None and gone.note == f"The model folder {tmp_path / 'deleted-model'} is gone: " \
                                                  "showing token ids only."
    external = tokenizers.load_tokenizer("")
    assert external.tokenizer is None and "external engine" in external.note
    hub_name = tokenizers.load_tokenizer("gpt2")  # a hub name is never fetched: it is not a local folder
    assert hub_name.tokenizer is None and "gpt2 is gone" in hub_name.note
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text("{not json")
    (broken / "tokenizer.json").write_text("{not json either")
    result = tokenizers.load_tokenizer(str(broken))
    assert result.tokenizer is None and result.note.startswith(f"The tokenizer in {broken} did not load (")
    assert tokenizers.cached_token_texts(result, "any", [1, 2]) is None


def test_texts_are_cached_per_sample_and_tokenizer_version(tiny_tokenizer_dir):
    loaded = tokenizers.load_tokenizer(str(tiny_tokenizer_dir))
    ids = loaded.tokenizer.encode(CHAT)
    texts = tokenizers.cached_token_texts(loaded, ("sample", 1), ids)
    assert tokenizers.cached_token_texts(loaded, ("sample", 1), ids) is texts
    assert tokenizers.cached_token_texts(loaded, ("sample", 2), ids) is not texts
    assert texts == tokenizers.token_texts(loaded.tokenizer, ids)


def test_warm_up_imports_transformers_in_the_background():
    code = ("import sys; from catalog.tokenizers import warm_up; assert 'transformers' not in sys.modules; "
            "warm_up().join(); print('transformers.models.auto.tokenization_auto' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(Path(__file__).resolve().parents[2]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_a_folder_with_a_config_but_no_vocabulary_is_said_so_not_an_empty_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # transformers builds a 1-token tokenizer
    loaded = tokenizers.load_tokenizer(str(tmp_path))
    assert loaded.tokenizer is None
    assert loaded.note == f"The model folder {tmp_path} holds no tokenizer files: showing token ids only."
