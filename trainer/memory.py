"""Training memory: the micro-batch size a memory limit allows, resident-set readings, freed heap handed back."""
from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from typing import Any

from common.procs import status_kib
from trainer.config import ConfigError, TrainerConfig

logger = logging.getLogger(__name__)

GB = 1e9
OVERHEAD_BYTES = 0.9 * GB
"""Python, torch and transformers (0.25 GB) plus the heap's slack and a step's transients (measured on SmolLM2)."""
STATE_BYTES_PER_PARAM = 16
"""float32 weights (4), their gradients (4) and AdamW's two moments (8)."""
REFERENCE_BYTES_PER_PARAM = 4
"""The frozen float32 reference model kept when kl_coef > 0."""
AUTOCAST_BYTES_PER_PARAM = 2
"""bfloat16 copies of the weights that autocast makes in forward and backward keeps until it has run."""
HEAD_GRADIENT_COPIES = 3
"""Vocabulary x hidden float32 buffers alive while a micro-batch's embedding/LM-head gradient is accumulated."""
ACTIVATION_BYTES = {("float32", False): 96, ("bfloat16", False): 64, ("float32", True): 24, ("bfloat16", True): 24}
"""Bytes kept for backward per padded position, per layer and per hidden unit, by (dtype, gradient checkpointing).

Measured on SmolLM2-135M (30 layers, hidden 576, intermediate 1536) with demo-shaped samples (400 positions,
60 of them loss tokens): 1.63, 1.07 and 0.35 MB per position. Loss tokens add about 20 bytes per vocabulary entry
each (float32 logits and their gradients), so samples that are mostly loss tokens take up to 1.6x the estimate.
"""


def micro_batch_positions(config: TrainerConfig, model_config: Any, params: int) -> int:
    """Padded positions per micro-batch: `micro_batch_tokens`, lowered to fit `max_train_memory_gb`.

    peak ~ 0.9 GB + params x (16, +4 with a reference model, +2 in bfloat16) + 3 x vocab x hidden x 4
           + positions x layers x hidden x ACTIVATION_BYTES[dtype, gradient_checkpointing]

    Measured on SmolLM2-135M with 32 demo-shaped samples, the peak RSS of a step was 2% to 4% below this
    estimate for 667 to 1,024 positions and 2% to 3% above it for 5,400 positions (float32 and bfloat16).
    """
    if not config.max_train_memory_gb:
        return config.micro_batch_tokens
    config = config.for_this_host()  # the estimate depends on the dtype `auto` becomes here
    fixed = fixed_bytes(config, model_config, params)
    per_position = bytes_per_position(config, model_config)
    spare = config.max_train_memory_gb * GB - fixed
    if spare < per_position:
        raise ConfigError(f"max_train_memory_gb={config.max_train_memory_gb} leaves no room for activations: "
                          f"this model's weights, gradients and optimizer state alone take {fixed / GB:.1f} GB; "
                          f"set max_train_memory_gb above {(fixed + 512 * per_position) / GB:.1f} or 0 (no limit)")
    return min(config.micro_batch_tokens, int(spare // per_position))


def fixed_bytes(config: TrainerConfig, model_config: Any, params: int) -> int:
    """Memory a step needs whatever the micro-batch size: libraries, weights, gradients, optimizer, head gradients."""
    per_param = (STATE_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if config.kl_coef > 0 else 0)
                 + (AUTOCAST_BYTES_PER_PARAM if config.dtype == "bfloat16" else 0))
    head = HEAD_GRADIENT_COPIES * model_config.vocab_size * model_config.hidden_size * 4
    return int(OVERHEAD_BYTES + params * per_param + head)


def bytes_per_position(config: TrainerConfig, model_config: Any) -> int:
    """Activation bytes one padded position keeps for backward."""
    factor = ACTIVATION_BYTES[config.dtype, config.gradient_checkpointing]
    return model_config.num_hidden_layers * model_config.hidden_size * factor


def rss_bytes() -> int:
    """Resident set size of this process now (0 where /proc is missing)."""
    return status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Highest resident set size of this process since it started or since `reset_peak_rss`."""
    return status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Start a new peak: Linux resets VmHWM to the current RSS when "5" is written to clear_refs.

    False where that is not allowed; the peak then counts from the start of the process.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`); False where libc has no such call.

    glibc raises its mmap threshold up to 32 MB as large blocks are freed, so activations soon come from the
    heap, which keeps them when freed: without this a worker stays at its peak between steps while the engine
    generates. (A fixed 64 KiB threshold, `MALLOC_MMAP_THRESHOLD_=65536`, also lowers the peak by 0.45 to 0.7 GB
    but made bfloat16 steps 1.6x slower on SmolLM2, 113 vs 186 tokens/s: every block's pages fault in afresh.)
    """
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The symbols this process already has loaded (libc among them)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        logger.info("cannot look up C library symbols: freed training memory stays with the process")
        return None
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc
