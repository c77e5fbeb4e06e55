"""The host profile and the number formats `auto` picks from it: the resolution table, the ISA limits honoured in a
fresh process, and a served folder in the engine's dtype that every weight sync keeps."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import TrainerConfig
from trainer.engine.folders import served_folder, shared_served_model
from trainer.engine.sync import write_weights
from trainer.host import ISA_LIMITS, HostProfile, detect, resolve, summary

ROOT = Path(__file__).resolve().parents[2]
AVX512_BF16 = HostProfile(cpu_model="EPYC", cpu_flags=("avx2", "avx512f", "avx512_bf16"), torch_capability="AVX512",
                          cores=2, memory_gb=23.5)
AVX512_NO_BF16 = HostProfile(cpu_flags=("avx2", "avx512f"), torch_capability="AVX512", cores=2)
AVX2_ONLY = HostProfile(cpu_flags=("avx2",), torch_capability="AVX2", cores=2, memory_gb=23.5)
LIMITED_TORCH = HostProfile(cpu_flags=("avx2", "avx512f", "avx512_bf16"), torch_capability="AVX2",
                            isa_limit="ATEN_CPU_CAPABILITY=avx2")
LIMITED_ONEDNN = HostProfile(cpu_flags=("avx2", "avx512f", "avx512_bf16"), torch_capability="AVX512",
                             onednn_max_isa="AVX512_CORE", isa_limit="ONEDNN_MAX_CPU_ISA=AVX512_CORE")
ONEDNN_BF16_OK = HostProfile(cpu_flags=("avx2", "avx512f", "amx_bf16"), torch_capability="AVX512",
                             onednn_max_isa="avx512_core_amx")
GPU_BF16 = HostProfile(cpu_flags=("avx2",), torch_capability="AVX2", gpu="NVIDIA H100", gpu_bf16=True)
GPU_NO_BF16 = HostProfile(cpu_flags=("avx2", "avx512f", "avx512_bf16"), torch_capability="AVX512", gpu="Tesla T4")

BF16, F32 = "bfloat16", "float32"


@pytest.mark.parametrize("host, native", [
    (AVX512_BF16, True), (AVX512_NO_BF16, False), (AVX2_ONLY, False), (LIMITED_TORCH, False),
    (LIMITED_ONEDNN, False), (ONEDNN_BF16_OK, True), (GPU_BF16, True), (GPU_NO_BF16, False),
])
@pytest.mark.parametrize("engine, trainer, by_hand", [
    ("auto", "auto", False), (F32, "auto", False), ("auto", BF16, False), (BF16, F32, True), (F32, F32, True),
])
def test_it_resolves_auto_to_bf16_only_where_the_host_computes_it_natively(host, native, engine, trainer, by_hand):
    best = BF16 if native else F32
    formats = resolve(host, engine, trainer)
    assert host.native_bf16 is native
    assert formats.engine_dtype == (best if engine == "auto" else engine)
    assert formats.trainer_dtype == (best if trainer == "auto" else trainer)
    if by_hand:
        assert formats.reason == "set by hand"
    else:
        assert formats.reason.startswith("auto (") and formats.reason.endswith(
            f"has {'native' if native else 'no native'} bf16")


def test_it_resolves_a_config_and_rejects_unknown_formats():
    config, formats = TrainerConfig().on_host(AVX2_ONLY)
    assert (TrainerConfig().dtype, TrainerConfig().engine_dtype) == ("auto", "auto")
    assert (config.dtype, config.engine_dtype) == (F32, F32) == (formats.trainer_dtype, formats.engine_dtype)
    assert formats.reason == "auto (engine and trainer): the CPU has no native bf16"
    config, formats = TrainerConfig(engine_dtype=F32).on_host(AVX512_BF16)
    assert (config.dtype, config.engine_dtype, formats.reason) == (BF16, F32, "auto (trainer): the CPU has native bf16")
    with pytest.raises(ValueError, match=r"engine_dtype must be one of \['auto', 'bfloat16', 'float32'\]"):
        resolve(AVX2_ONLY, "float64", "auto")


def test_it_describes_the_host_and_why_for_a_person():
    assert summary(AVX2_ONLY, resolve(AVX2_ONLY)) == \
        "CPU: AVX2, no native bf16 (2 cores, 23.5 GiB) -> engine float32, trainer float32"
    assert summary(AVX512_BF16, resolve(AVX512_BF16)) == \
        "CPU: AVX-512, native bf16 (2 cores, 23.5 GiB) -> engine bfloat16, trainer bfloat16"
    assert LIMITED_TORCH.describe().startswith(
        "CPU: AVX2, no native bf16 (the CPU has it; limited by ATEN_CPU_CAPABILITY=avx2)")
    assert GPU_BF16.describe() == "GPU: NVIDIA H100, native bf16"
    assert HostProfile.from_dict(json.loads(json.dumps(AVX2_ONLY.to_dict()))) == AVX2_ONLY


def _detect_in(env: dict) -> dict:
    """detect() in a fresh interpreter: torch reads ATEN_CPU_CAPABILITY once, when it first dispatches."""
    code = ("import json; from trainer.host import detect, resolve; p = detect(); "
            "print(json.dumps({**p.to_dict(), 'formats': resolve(p).to_dict()}))")
    clean = {k: v for k, v in os.environ.items() if k not in ISA_LIMITS["avx2"]}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_detection_honours_the_avx2_limit_in_the_environment():
    here = detect()
    assert here.torch_capability == torch.backends.cpu.get_cpu_capability()
    assert here.cores == len(os.sched_getaffinity(0)) and here.memory_gb > 0
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]
    assert set(here.cpu_flags) == {f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile",
                                               "avx512_vnni", "avx_vnni") if f" {f}" in f" {flags.split(':', 1)[1]} "}
    limited = _detect_in(ISA_LIMITS["avx2"])
    assert limited["torch_capability"] == "AVX2" and limited["onednn_max_isa"] == "AVX2"
    assert limited["isa_limit"] == "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"
    assert limited["native_bf16"] is False
    assert limited["formats"] == {"engine_dtype": F32, "trainer_dtype": F32,
                                  "reason": "auto (engine and trainer): the CPU has no native bf16"}
    assert limited["cpu_flags"] == list(here.cpu_flags)  # the hardware is the same; what may use it is not


@pytest.mark.parametrize("source_dtype, engine_dtype", [(BF16, F32), (F32, BF16), (F32, None)])
def test_the_served_folder_holds_the_engines_dtype_and_syncs_keep_it(tmp_path, source_dtype, engine_dtype):
    from trainer.models import build_tiny_model

    source = build_tiny_model(tmp_path / "tiny", seed=0)
    state = {k: v.to(getattr(torch, source_dtype)) for k, v in load_file(source / "model.safetensors").items()}
    write_weights(source, state, source_dtype)
    served = shared_served_model(source, tmp_path / "models", engine_dtype)
    assert served == served_folder(source, tmp_path / "models", engine_dtype)
    assert served != served_folder(source, tmp_path / "models", BF16 if engine_dtype == F32 else F32)
    want = getattr(torch, engine_dtype or source_dtype)
    files = load_file(served / "model.safetensors")
    assert {t.dtype for t in files.values()} == {want}
    for name, tensor in state.items():  # widening is exact; narrowing rounds once
        assert torch.equal(files[name], tensor.to(want)), name
    assert files["lm_head.weight"].data_ptr() != files["model.embed_tokens.weight"].data_ptr()  # untied
    config = json.loads((served / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    if engine_dtype:
        assert config.get("torch_dtype", config.get("dtype")) == engine_dtype
    trained = {k: v.float() + 1e-3 for k, v in state.items()}  # the trainer's float32 weights after a step
    write_weights(served, trained)
    synced = load_file(served / "model.safetensors")
    assert {t.dtype for t in synced.values()} == {want}
    assert torch.equal(synced["model.norm.weight"], trained["model.norm.weight"].to(want))
    assert json.loads((served / ".served-from.json").read_text())["dtype"] == engine_dtype
