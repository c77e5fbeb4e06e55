"""The host a run trains on (what its CPU offers, cores, memory, GPU) and the number formats `auto` picks there.

bfloat16 is fast only where the hardware computes it: on an AVX-512 CPU with avx512_bf16 (or AMX), or a GPU
that supports it. Elsewhere torch and oneDNN emulate it and float32 is faster (FIELD-NOTES: SmolLM2 decoding
32 calls at 96 tok/s in bf16 against 292 in float32, training at 6 tok/s against 138, on the same CPU limited
to AVX2). The limits `ATEN_CPU_CAPABILITY` (torch's kernels) and `ONEDNN_MAX_CPU_ISA` (oneDNN's) are honoured,
so the slow path can be reproduced, and tested, on any machine.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

AUTO = "auto"
ENGINE_DTYPES = (AUTO, "bfloat16", "float32")
"""vLLM --dtype values a run may ask for."""
TRAINER_DTYPES = (AUTO, "float32", "bfloat16")
"""Trainer compute dtypes a run may ask for: float32, or bfloat16 autocast (weights and optimizer stay float32)."""

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni")
"""The /proc/cpuinfo flags a profile keeps: the ones that decide how fast each number format runs."""
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""Either one computes bfloat16 natively (oneDNN's avx512_core_bf16 and avx512_core_amx kernels)."""
TORCH_BF16_CAPABILITIES = ("AVX512",)
"""torch.backends.cpu.get_cpu_capability() values whose kernels may use the CPU's bf16 instructions; 'AVX2',
'DEFAULT' and 'NO AVX' (what ATEN_CPU_CAPABILITY=avx2 and lower give) never do."""
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                    "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2",
                    "ALL")
"""ONEDNN_MAX_CPU_ISA values that still let oneDNN run bfloat16 matmuls natively; a lower one (AVX2, AVX512_CORE,
...) makes oneDNN emulate them."""
LIMIT_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
ISA_LIMITS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
"""Environments that limit torch and oneDNN to an ISA (bench/cpu_speed.py, bench/demo_learning.py --cpu-isa)."""


@dataclass(frozen=True)
class HostProfile:
    """What the machine offers a run, as the worker process sees it (its environment's ISA limits included)."""

    cpu_model: str = ""
    """The CPU's model name from /proc/cpuinfo."""
    cpu_flags: tuple[str, ...] = ()
    """Which of CPU_FLAGS the CPU has."""
    torch_capability: str = ""
    """torch.backends.cpu.get_cpu_capability(): the kernels torch dispatches to (ATEN_CPU_CAPABILITY lowers it)."""
    onednn_max_isa: str = ""
    """ONEDNN_MAX_CPU_ISA as set in the environment ('' when not set: oneDNN uses all the CPU has)."""
    isa_limit: str = ""
    """The ISA limits set in the environment, e.g. 'ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2' ('' none)."""
    cores: int = 0
    """CPUs this process may run on."""
    memory_gb: float = 0.0
    """Physical memory in GiB."""
    gpu: str = ""
    """Name of the first CUDA device ('' without one)."""
    gpu_bf16: bool = False
    """Whether that GPU computes bfloat16."""

    @property
    def cpu_bf16(self) -> bool:
        """The CPU computes bfloat16 natively, and neither torch's nor oneDNN's limit hides it."""
        return (any(flag in self.cpu_flags for flag in BF16_FLAGS)
                and self.torch_capability in TORCH_BF16_CAPABILITIES
                and (not self.onednn_max_isa or self.onednn_max_isa.upper() in ONEDNN_BF16_ISAS))

    @property
    def native_bf16(self) -> bool:
        """Where the run computes (the GPU when there is one, else the CPU), bfloat16 is native."""
        return self.gpu_bf16 if self.gpu else self.cpu_bf16

    @property
    def isa(self) -> str:
        """The widest vector ISA in use, as a person names it: 'AVX-512', 'AVX2' or torch's own word."""
        return {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(self.torch_capability, self.torch_capability or "unknown")

    def describe(self) -> str:
        """One line for a person, e.g. 'CPU: AVX2, no native bf16 (2 cores, 23.4 GiB)'."""
        if self.gpu:
            return f"GPU: {self.gpu}, {'native' if self.gpu_bf16 else 'no native'} bf16"
        bf16 = "native bf16" if self.cpu_bf16 else "no native bf16"
        if not self.cpu_bf16 and any(flag in self.cpu_flags for flag in BF16_FLAGS):
            bf16 += f" (the CPU has it; limited by {self.isa_limit})" if self.isa_limit else " (torch cannot use it)"
        return f"CPU: {self.isa}, {bf16} ({self.cores} cores, {self.memory_gb:.1f} GiB)"

    def to_dict(self) -> dict:
        return {**asdict(self), "cpu_flags": list(self.cpu_flags), "native_bf16": self.native_bf16}

    @classmethod
    def from_dict(cls, data: dict) -> "HostProfile":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "cpu_flags": tuple(known.get("cpu_flags", ()))})


@dataclass(frozen=True)
class Formats:
    """The number formats a run uses on a host, and why."""

    engine_dtype: str
    """vLLM --dtype: 'bfloat16' or 'float32'."""
    trainer_dtype: str
    """Trainer compute dtype: 'bfloat16' (autocast) or 'float32'."""
    reason: str
    """Why, for a person: 'auto: the CPU has native bf16' or 'set by hand'."""

    def describe(self) -> str:
        return f"engine {self.engine_dtype}, trainer {self.trainer_dtype}"

    def to_dict(self) -> dict:
        return asdict(self)


def summary(profile: HostProfile, formats: Formats) -> str:
    """What the run page shows: 'CPU: AVX2, no native bf16 (2 cores, 23.4 GiB) -> engine float32, trainer float32'."""
    return f"{profile.describe()} -> {formats.describe()}"


def resolve(profile: HostProfile, engine_dtype: str = AUTO, trainer_dtype: str = AUTO) -> Formats:
    """Concrete dtypes for the settings: `auto` is bfloat16 where the host computes it natively, float32 elsewhere;
    any other value is kept as set."""
    for name, value, valid in (("engine_dtype", engine_dtype, ENGINE_DTYPES),
                               ("trainer dtype", trainer_dtype, TRAINER_DTYPES)):
        if value not in valid:
            raise ValueError(f"{name} must be one of {list(valid)}, got {value!r}")
    best = "bfloat16" if profile.native_bf16 else "float32"
    where = "the GPU" if profile.gpu else "the CPU"
    why = f"{where} has native bf16" if profile.native_bf16 else f"{where} has no native bf16"
    auto = [name for name, value in (("engine", engine_dtype), ("trainer", trainer_dtype)) if value == AUTO]
    reason = f"auto ({' and '.join(auto)}): {why}" if auto else "set by hand"
    return Formats(engine_dtype=best if engine_dtype == AUTO else engine_dtype,
                   trainer_dtype=best if trainer_dtype == AUTO else trainer_dtype, reason=reason)


def detect() -> HostProfile:
    """The profile of this process's host. Imports torch (about a second the first time)."""
    import torch

    flags, model = _cpuinfo()
    gpu, gpu_bf16 = "", False
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        gpu_bf16 = bool(torch.cuda.is_bf16_supported())
    return HostProfile(cpu_model=model, cpu_flags=tuple(f for f in CPU_FLAGS if f in flags),
                       torch_capability=torch.backends.cpu.get_cpu_capability(),
                       onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip(),
                       isa_limit=" ".join(f"{k}={os.environ[k]}" for k in LIMIT_VARIABLES if os.environ.get(k)),
                       cores=len(os.sched_getaffinity(0)), memory_gb=round(_memory_gb(), 1), gpu=gpu,
                       gpu_bf16=gpu_bf16)


def compile_cache_key(env: Mapping[str, str] | None = None) -> str:
    """A folder name for code compiled on this CPU under `env`'s ISA limits (os.environ by default), e.g.
    'avx2-avx512f-avx512_bf16-avx512_vnni' or '...-limit-avx2-AVX2': code compiled under another CPU or limit
    must never be loaded here (trainer.engine.server)."""
    env = os.environ if env is None else env
    flags, _ = _cpuinfo()
    name = "-".join(flag for flag in CPU_FLAGS if flag in flags) or "cpu"
    limits = [env[k].strip() for k in LIMIT_VARIABLES if env.get(k, "").strip()]
    if limits:
        name += "-limit-" + "-".join(limits)
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[set[str], str]:
    """The first CPU's flags and model name ('' and an empty set where the file does not exist)."""
    flags: set[str] = set()
    model = ""
    try:
        text = path.read_text()
    except OSError:
        return flags, model
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
        if flags and model:
            break
    return flags, model


def _memory_gb(path: Path = Path("/proc/meminfo")) -> float:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return 0.0
