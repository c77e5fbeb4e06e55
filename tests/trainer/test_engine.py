"""Engine lifecycle and weight files without vLLM: a fake engine venv stands in for the server process."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainer.engine import serving_engine
from trainer.engine.server import EngineConfig, EngineError, VLLMServer, build_command, build_env, group_alive
from trainer.engine.sync import ExternalEngine, copy_weights, stage_model, write_weights

FAKE_SERVER = textwrap.dedent("""
    import http.server, os, subprocess, sys
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if os.environ.get("FAKE_VLLM_CRASH"):
        print("RuntimeError: fake engine cannot allocate the KV cache", flush=True)
        sys.exit(3)
    race = os.environ.get("FAKE_VLLM_PORT_RACE")
    if race and not os.path.exists(race):
        open(race, "w").close()
        print("OSError: [Errno 98] Address already in use", flush=True)
        sys.exit(1)
    subprocess.Popen(["sleep", "300"])  # a helper process, like vLLM's engine core
    if os.environ.get("FAKE_VLLM_SLOW_START"):
        __import__("time").sleep(300)  # compiling, loading weights: no /health for minutes
    if os.environ.get("FAKE_VLLM_HANG"):
        signal_ignored = __import__("signal").signal(15, lambda *_: None)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("fake vLLM listening", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


@pytest.fixture
def fake_venv(tmp_path):
    """A venv whose python runs scripts with this interpreter and answers `-m vllm...` with a fake server."""
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    python = tmp_path / "venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ]; then shift 2; exec {sys.executable} '
                      f'{tmp_path / "fake_server.py"} "$@"; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return tmp_path / "venv"


def _config(model_dir, venv, **kwargs):
    return EngineConfig(model_path=str(model_dir), served_model_name="tiny", max_model_len=512,
                        kv_cache_gb=0.5, venv=str(venv), **kwargs)


def _wait_gone(pgid, within=30.0):
    deadline = time.monotonic() + within
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not group_alive(pgid)


def test_it_builds_the_module_command_and_dev_mode_env(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path / "v", extra_args=("--enforce-eager",), extra_env={"X": 1})
    cmd = build_command(config, 8123)
    assert cmd[:3] == [str(tmp_path / "v" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model"] == str(tiny_model_dir) and flags["--served-model-name"] == "tiny"
    assert flags["--max-model-len"] == "512" and flags["--port"] == "8123"
    assert flags["--kv-cache-memory-bytes"] == str(2**29)
    assert cmd[-4:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enforce-eager"]
    assert flags["--logprobs-mode"] == "processed_logprobs"  # the distribution it sampled from, as the trainer
    env = build_env(config)
    assert (env["HF_HUB_OFFLINE"], env["VLLM_SERVER_DEV_MODE"], env["X"]) == ("1", "1", "1")
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


async def test_cancelling_a_start_in_progress_stops_the_whole_group_within_seconds(tiny_model_dir, fake_venv,
                                                                                  tmp_path):
    config = _config(tiny_model_dir, fake_venv, extra_env={"FAKE_VLLM_SLOW_START": "1"})

    async def serve():
        async with serving_engine(config, tmp_path / "work", start_timeout=600):
            raise AssertionError("the slow engine never becomes healthy")

    task = asyncio.create_task(serve())
    while not (pgid := _fake_server_group(tmp_path)):
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # the server is up and sleeping through its start, /health is not answering
    task.cancel()
    asked = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - asked < 10
    assert not group_alive(pgid)


def _fake_server_group(tmp_path) -> int | None:
    """Process group of the fake engine server started from `tmp_path`, once it runs."""
    for entry in Path("/proc").iterdir():
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if "fake_server" in cmd and str(tmp_path) in cmd:
            return int(stat[2])
    return None


def test_it_rejects_a_folder_without_a_model(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        EngineConfig(model_path=str(tmp_path))


def test_a_missing_venv_names_the_setup_command(tiny_model_dir, tmp_path):
    with pytest.raises(EngineError, match="scripts/setup-engine"):
        VLLMServer(_config(tiny_model_dir, tmp_path / "none")).start(timeout=5)


def test_it_starts_on_a_free_port_and_stop_kills_the_whole_group(tiny_model_dir, fake_venv, tmp_path):
    server = VLLMServer(_config(tiny_model_dir, fake_venv), log_path=tmp_path / "engine.log")
    with server:
        assert server.health() and server.base_url == f"http://127.0.0.1:{server.port}"
        pgid = server.pgid
        members = subprocess.run(["ps", "-o", "comm=", "-g", str(pgid)], capture_output=True, text=True).stdout
        assert "sleep" in members.split()
    assert not group_alive(pgid) and not server.health()
    assert "fake vLLM listening" in (tmp_path / "engine.log").read_text()


def test_stop_sigkills_an_engine_that_ignores_sigterm(tiny_model_dir, fake_venv):
    server = VLLMServer(_config(tiny_model_dir, fake_venv, extra_env={"FAKE_VLLM_HANG": "1"})).start(timeout=30)
    pgid = server.pgid
    server.stop(grace=1.0)
    assert not group_alive(pgid)


def test_a_crash_at_startup_raises_with_the_log_tail(tiny_model_dir, fake_venv):
    server = VLLMServer(_config(tiny_model_dir, fake_venv, extra_env={"FAKE_VLLM_CRASH": "1"}))
    with pytest.raises(EngineError, match="exited with code 3 during startup") as err:
        server.start(timeout=30)
    assert "fake engine cannot allocate the KV cache" in str(err.value)
    assert not group_alive(server.pgid)


def test_a_lost_port_race_is_retried_on_another_port(tiny_model_dir, fake_venv, tmp_path):
    config = _config(tiny_model_dir, fake_venv, extra_env={"FAKE_VLLM_PORT_RACE": str(tmp_path / "raced")})
    with VLLMServer(config, log_path=tmp_path / "engine.log") as server:
        assert server.health()
    log = (tmp_path / "engine.log").read_text()
    assert "Address already in use" in log and "fake vLLM listening" in log


def test_no_engine_survives_its_owner_being_killed(tiny_model_dir, fake_venv, tmp_path):
    owner = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from trainer.engine.server import EngineConfig, VLLMServer
        config = EngineConfig(model_path={str(tiny_model_dir)!r}, venv={str(fake_venv)!r})
        server = VLLMServer(config).start(timeout=30)
        print(server.pgid, flush=True)
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", owner], stdout=subprocess.PIPE, text=True)
    pgid = int(proc.stdout.readline())
    assert group_alive(pgid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert _wait_gone(pgid), f"engine group {pgid} outlived its owner"


def test_stage_model_links_files_unties_the_head_and_never_touches_the_source(tiny_model_dir, tmp_path):
    before = {p.name: p.read_bytes() for p in tiny_model_dir.iterdir()}
    served = stage_model(tiny_model_dir, tmp_path / "served")
    assert (served / "tokenizer.json").stat().st_ino == (tiny_model_dir / "tokenizer.json").stat().st_ino
    assert json.loads((served / "config.json").read_text())["tie_word_embeddings"] is False
    staged = load_file(served / "model.safetensors")
    assert torch.equal(staged["lm_head.weight"], staged["model.embed_tokens.weight"])

    state = {k: v + 1 for k, v in staged.items() if k != "lm_head.weight"}
    write_weights(served, {f"_orig_mod.{k}": v for k, v in state.items()})
    written = load_file(served / "model.safetensors")
    assert torch.equal(written["lm_head.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(written["model.norm.weight"], state["model.norm.weight"])
    assert {p.name: p.read_bytes() for p in tiny_model_dir.iterdir()} == before
    assert not list(served.glob(".weights-*")) and not list(served.glob(".tmp-*"))


def test_write_weights_leaves_a_tied_head_out_where_the_folder_stays_tied(tiny_model_dir, tmp_path):
    folder = tmp_path / "tied"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    embed = torch.ones(4, 2)
    write_weights(folder, {"model.embed_tokens.weight": embed, "lm_head.weight": embed})
    assert sorted(load_file(folder / "model.safetensors")) == ["model.embed_tokens.weight"]


def test_copy_weights_replaces_shards_with_the_checkpoint(tiny_model_dir, tmp_path):
    served = stage_model(tiny_model_dir, tmp_path / "served")
    (served / "model.safetensors").rename(served / "model-00001-of-00002.safetensors")
    (served / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"model.norm.weight": torch.zeros(128), "model.embed_tokens.weight": torch.ones(1024, 128)},
              ckpt / "model.safetensors")  # a tied checkpoint: no lm_head.weight
    copy_weights(served, ckpt)
    assert sorted(p.name for p in served.glob("*.safetensors*")) == ["model.safetensors"]
    copied = load_file(served / "model.safetensors")
    assert torch.equal(copied["model.norm.weight"], torch.zeros(128))
    assert torch.equal(copied["lm_head.weight"], torch.ones(1024, 128))  # the untied head follows the embedding


async def test_an_external_engine_refuses_weight_sync_clearly():
    engine = ExternalEngine("http://example.invalid/v1/")
    await engine.pause()
    await engine.resume()
    assert engine.version == 0
    with pytest.raises(EngineError, match="http://example.invalid/v1 is an external URL: weight sync is not"):
        await engine.update_weights(torch.nn.Linear(1, 1), 1)
