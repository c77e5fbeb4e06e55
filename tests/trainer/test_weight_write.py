"""Weight sync's file side: in-place updates of the served safetensors, and writes in the served dtype."""
import json

import torch
from safetensors.torch import load_file, save_file

from trainer.engine.sync import stage_model, update_weights_in_place, write_weights


def untied_folder(path, dtype=torch.bfloat16):
    """A served-style folder: untied config and one bf16 safetensors file with an explicit head."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    state = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4),
             "lm_head.weight": torch.randn(8, 4)}
    save_file({k: v.to(dtype) for k, v in state.items()}, path / "model.safetensors")
    return path


def test_it_updates_the_served_file_in_place_in_its_own_dtype(tmp_path):
    folder = untied_folder(tmp_path / "served")
    inode = (folder / "model.safetensors").stat().st_ino
    state = {"_orig_mod.model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.full((4,), 0.3),
             "lm_head.weight": torch.randn(8, 4)}
    assert update_weights_in_place(folder, state) is True
    assert (folder / "model.safetensors").stat().st_ino == inode  # the same file, rewritten in place
    written = load_file(folder / "model.safetensors")
    assert {k: v.dtype for k, v in written.items()} == dict.fromkeys(written, torch.bfloat16)
    assert torch.equal(written["model.embed_tokens.weight"],
                       state["_orig_mod.model.embed_tokens.weight"].to(torch.bfloat16))
    assert torch.equal(written["model.norm.weight"], torch.full((4,), 0.3).to(torch.bfloat16))
    assert torch.equal(written["lm_head.weight"], state["lm_head.weight"].to(torch.bfloat16))


def test_a_shared_embedding_fills_the_untied_head_in_place(tiny_model_dir, tmp_path):
    served = stage_model(tiny_model_dir, tmp_path / "served")  # tiny is tied: untie wrote a file of our own
    staged = load_file(served / "model.safetensors")
    state = {k: v + 1 for k, v in staged.items() if k != "lm_head.weight"}
    assert update_weights_in_place(served, state) is True
    written = load_file(served / "model.safetensors")
    head = written["lm_head.weight"]
    assert torch.equal(head, state["model.embed_tokens.weight"].to(head.dtype))
    assert torch.equal(written["model.norm.weight"], state["model.norm.weight"])


def test_it_never_writes_through_a_link_into_the_registry(tmp_path):
    source = untied_folder(tmp_path / "registry-model")
    before = (source / "model.safetensors").read_bytes()
    served = stage_model(source, tmp_path / "served")  # untied: the weights file is a hard link to the source
    state = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in load_file(served / "model.safetensors").items()}
    assert update_weights_in_place(served, state) is False
    assert (source / "model.safetensors").read_bytes() == before
    write_weights(served, state)  # the fallback: a new file of its own, after which in place is allowed
    assert (source / "model.safetensors").read_bytes() == before
    assert update_weights_in_place(served, {k: v + 2 for k, v in state.items()}) is True
    norm = load_file(served / "model.safetensors")["model.norm.weight"]
    assert torch.equal(norm, torch.full((4,), 2.0, dtype=torch.bfloat16))
    assert (source / "model.safetensors").read_bytes() == before


def test_it_refuses_other_names_or_shapes_and_leaves_the_file_alone(tmp_path):
    folder = untied_folder(tmp_path / "served")
    before = (folder / "model.safetensors").read_bytes()
    base = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    assert update_weights_in_place(folder, {**base, "model.norm.weight": torch.ones(5)}) is False
    assert update_weights_in_place(folder, {**base, "model.extra.weight": torch.ones(2)}) is False
    assert update_weights_in_place(tmp_path / "missing", base) is False
    assert (folder / "model.safetensors").read_bytes() == before


def test_write_weights_writes_in_the_dtype_the_folder_serves(tmp_path):
    folder = untied_folder(tmp_path / "served")
    state = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.randn(4)}
    write_weights(folder, state)
    written = load_file(folder / "model.safetensors")
    assert written["model.norm.weight"].dtype == torch.bfloat16
    assert torch.equal(written["model.norm.weight"], state["model.norm.weight"].to(torch.bfloat16))
    assert torch.equal(written["lm_head.weight"], written["model.embed_tokens.weight"])


def test_in_place_writes_the_same_bytes_a_full_rewrite_would(tiny_model_dir, tmp_path):
    rewritten = stage_model(tiny_model_dir, tmp_path / "rewritten")
    in_place = stage_model(tiny_model_dir, tmp_path / "in-place")
    assert (rewritten / "model.safetensors").read_bytes() == (in_place / "model.safetensors").read_bytes()
    staged = {k: v.clone() for k, v in load_file(in_place / "model.safetensors").items()}  # load_file maps the file
    torch.manual_seed(0)
    state = {k: torch.randn(v.shape) for k, v in staged.items() if k != "lm_head.weight"}  # float32, like the trainer
    write_weights(rewritten, state)
    assert update_weights_in_place(in_place, state) is True
    assert (in_place / "model.safetensors").read_bytes() == (rewritten / "model.safetensors").read_bytes()
    assert not torch.equal(load_file(in_place / "model.safetensors")["model.norm.weight"],
                           staged["model.norm.weight"])  # and the new weights did land


def test_a_float32_trainer_is_cast_to_a_bfloat16_file_in_place(tmp_path):
    folder = untied_folder(tmp_path / "served", dtype=torch.bfloat16)
    size = (folder / "model.safetensors").stat().st_size
    state = {"model.embed_tokens.weight": torch.full((8, 4), 1.0 + 2**-10), "model.norm.weight": torch.ones(4),
             "lm_head.weight": torch.randn(8, 4)}
    assert update_weights_in_place(folder, state) is True
    assert (folder / "model.safetensors").stat().st_size == size  # the file keeps its bf16 layout
    written = load_file(folder / "model.safetensors")
    assert written["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(written["model.embed_tokens.weight"], torch.ones(8, 4, dtype=torch.bfloat16))  # rounded
