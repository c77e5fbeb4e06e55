"""Served model folders: one shared untied copy per model, built once and atomically; a weights folder per run."""
import json
import os
import threading

import torch
from safetensors.torch import load_file

from trainer.engine.folders import MARKER, run_weights_folder, shared_served_model
from trainer.engine.sync import write_weights


def snapshot(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_the_shared_folder_is_built_once_untied_and_the_source_stays_untouched(tiny_model_dir, tmp_path):
    before = snapshot(tiny_model_dir)
    served = shared_served_model(tiny_model_dir, tmp_path / "models")
    assert served.parent == tmp_path / "models" and (served / MARKER).is_file()
    assert json.loads((served / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(served / "model.safetensors")
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert (served / "tokenizer.json").stat().st_ino == (tiny_model_dir / "tokenizer.json").stat().st_ino
    inode = (served / "model.safetensors").stat().st_ino
    assert shared_served_model(tiny_model_dir, tmp_path / "models") == served
    assert (served / "model.safetensors").stat().st_ino == inode  # reused, not rebuilt
    assert snapshot(tiny_model_dir) == before
    assert [p.name for p in (tmp_path / "models").iterdir()] == [served.name]  # no temporary folder left


def test_a_changed_source_gets_a_new_folder(tiny_model_dir, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for item in tiny_model_dir.iterdir():
        (source / item.name).write_bytes(item.read_bytes())
    first = shared_served_model(source, tmp_path / "models")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))  # re-imported differently
    second = shared_served_model(source, tmp_path / "models")
    assert second != first and json.loads((second / "config.json").read_text())["rms_norm_eps"] == 1e-5
    assert (first / MARKER).is_file()  # a run still serving the old one keeps it


def test_a_half_built_folder_left_by_a_crash_is_replaced(tiny_model_dir, tmp_path):
    served = shared_served_model(tiny_model_dir, tmp_path / "models")
    (served / MARKER).unlink()
    (served / "model.safetensors").write_bytes(b"truncated")
    assert shared_served_model(tiny_model_dir, tmp_path / "models") == served
    assert (served / MARKER).is_file() and "lm_head.weight" in load_file(served / "model.safetensors")


def test_starts_racing_to_build_it_all_get_the_same_complete_folder(tiny_model_dir, tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(shared_served_model(tiny_model_dir, tmp_path / "models"))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(set(results)) == 1
    assert [p.name for p in (tmp_path / "models").iterdir()] == [results[0].name]
    assert (results[0] / MARKER).is_file()


def test_a_runs_weights_folder_links_the_served_weights_and_a_sync_never_writes_through(tiny_model_dir, tmp_path):
    served = shared_served_model(tiny_model_dir, tmp_path / "models")
    weights = run_weights_folder(served, tmp_path / "run" / "weights")
    assert sorted(p.name for p in weights.iterdir()) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (weights / name).stat().st_ino == (served / name).stat().st_ino
    shared = (served / "model.safetensors").read_bytes()
    base = load_file(served / "model.safetensors")
    write_weights(weights, {k: v * 2 for k, v in base.items()})
    assert (served / "model.safetensors").read_bytes() == shared
    assert torch.equal(load_file(weights / "model.safetensors")["model.norm.weight"], base["model.norm.weight"] * 2)
    run_weights_folder(served, weights)  # the next engine start serves the base weights again: so does the folder
    assert (weights / "model.safetensors").stat().st_ino == (served / "model.safetensors").stat().st_ino
    assert os.stat(served / "model.safetensors").st_nlink == 2
