"""The policy model and its optimizer: packed logprobs, micro-batched PPO steps, exact-resume checkpoints."""
from __future__ import annotations

import copy
import json
import logging
import os
import random
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from trainer.algorithms import Metrics, loss_weights, policy_loss
from trainer.config import TrainerConfig
from trainer.host import AUTO
from trainer.memory import GB, micro_batch_positions, peak_rss_bytes, release_free_memory, reset_peak_rss, rss_bytes
from trainer.packing import PackedBatch, loss_token_starts, micro_batches, pack
from trainer.samples import Sample

logger = logging.getLogger(__name__)
# A single-process policy saves its optimizer with torch.distributed.checkpoint's no_dist, which warns every time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

TRAINER_CONFIG_FILE = "trainer_config.json"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
"""The optimizer state of checkpoints written before it moved to OPTIMIZER_DIR (still loaded)."""
OPTIMIZER_DIR = "optimizer"
RNG_FILE = "rng.pt"
REFERENCE_FILE = "reference.safetensors"
MIN_LOGPROB = -50.0


def token_logprobs(model: nn.Module, batch: PackedBatch, temperature: float = 1.0,
                   autocast_dtype: torch.dtype | None = None, top_k: int = -1) -> tuple[Tensor, Tensor]:
    """Logprob of each target and the entropy at its position, both (M,); logits only where a loss token is.

    The distribution is the one the engine samples from and reports with `--logprobs-mode processed_logprobs`:
    logits / temperature, restricted to the `top_k` largest when top_k > 0, renormalised.
    """
    device = next(model.parameters()).device
    batch = batch.to(device)
    ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
    with ctx:
        hidden = model.get_decoder()(input_ids=batch.input_ids, position_ids=batch.position_ids,
                                     use_cache=False).last_hidden_state  # (R, L, H)
        logits = model.get_output_embeddings()(hidden[batch.logit_rows, batch.logit_cols])  # (M, V)
    logp_all = torch.log_softmax(sampling_logits(logits.float(), temperature, top_k), dim=-1)  # (M, V)
    # A sampled token just outside the trainer's top k (ties, rounding) would be -inf and poison the loss.
    logp = logp_all.gather(1, batch.targets[:, None])[:, 0].clamp(min=MIN_LOGPROB)  # (M,)
    probs = logp_all.exp()
    entropy = -torch.where(probs > 0, probs * logp_all, 0.0).sum(-1).detach()  # (M,) masked tokens add 0
    return logp, entropy


def sampling_logits(logits: Tensor, temperature: float, top_k: int = -1) -> Tensor:
    """(M, V) logits of the sampling distribution: scaled by temperature, -inf outside the top k (k > 0)."""
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (M, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


class Policy:
    """A causal LM being trained, its AdamW state and step count (= the policy version it serves after sync)."""

    rank, world_size = 0, 1
    """This process's place among the trainer's processes (trainer.distributed.ShardedPolicy sets them)."""

    def __init__(self, model: nn.Module, config: TrainerConfig):
        if config.dtype == AUTO:  # a run resolved it when it started (and recorded it); anything else, here
            config = config.for_this_host()
        self.model, self.config = model, config
        # Fails fast (ConfigError) when max_train_memory_gb cannot hold even this model's optimizer state.
        self.micro_batch_positions = micro_batch_positions(config, model.config,
                                                           sum(p.numel() for p in model.parameters()))
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate,
                                           weight_decay=config.weight_decay)
        self.reference = _frozen_copy(model) if config.kl_coef > 0 else None
        self.trained_logprobs: list[list[float | None]] = []
        """After train_step: each sample's trainer logprob of its loss tokens before the update (None elsewhere)."""
        if config.gradient_checkpointing:  # after the copy: the reference never runs backward
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        logger.info("micro-batches of at most %d padded positions (micro_batch_tokens=%d, max_train_memory_gb=%s, "
                    "gradient_checkpointing=%s)", self.micro_batch_positions, config.micro_batch_tokens,
                    config.max_train_memory_gb, config.gradient_checkpointing)
        self.step = 0
        self._autocast = torch.bfloat16 if config.dtype == "bfloat16" else None

    @property
    def version(self) -> int:
        return self.step

    def logprobs(self, samples: Sequence[Sample]) -> tuple[Tensor, Tensor]:
        """(M,) logprobs and entropies of all loss tokens of `samples`, without gradients."""
        with torch.no_grad():
            return token_logprobs(self.model, pack(samples), self.config.temperature, self._autocast,
                                  self.config.top_k)

    def train_step(self, samples: Sequence[Sample], advantages: Sequence[float], rollouts: Sequence[int]
                   ) -> Metrics:
        """One training step: `updates_per_step` optimizer steps over mini-batches of `samples`.

        `advantages[i]` and `rollouts[i]` belong to samples[i] (its rollout's advantage and an id shared by
        the samples of one rollout, used by 'rollout_mean').
        """
        start = time.perf_counter()
        if not samples:  # every rollout failed: nothing to learn from, but the step still counts
            self.trained_logprobs = []
            self.step += 1
            return {"train/samples": 0, "train/tokens": 0, "train/seconds": 0.0}
        reset_peak_rss()
        self.model.train()
        adv = torch.tensor(advantages, dtype=torch.float32)  # (S,)
        rollout = torch.tensor(rollouts, dtype=torch.long)  # (S,)
        norm = self.config.loss_norm_tokens or max(1, max(s.num_loss_tokens for s in samples))
        old = self._old_logprobs(samples)
        self.trained_logprobs = [[None] * len(s.token_ids) for s in samples]
        totals = _MetricSum(sum_losses=False)  # mini-batch losses are each a mean: average them
        for part in minibatches(len(samples), self.config.updates_per_step):
            totals.add(self._update([samples[i] for i in part], adv[part], rollout[part], norm,
                                    None if old is None else [old[i] for i in part], part))
        self.step += 1
        seconds = time.perf_counter() - start
        release_free_memory()  # the activations are gone: let RSS fall while the engine generates
        metrics = totals.result()
        metrics.update({"train/samples": len(samples), "train/seconds": seconds,
                        "train/tokens_per_s": metrics["train/tokens"] / max(seconds, 1e-9),
                        "train/micro_batch_positions": self.micro_batch_positions,
                        "train/peak_rss_gb": peak_rss_bytes() / GB, "train/rss_gb": rss_bytes() / GB})
        return metrics

    def _old_logprobs(self, samples: Sequence[Sample]) -> list[Tensor] | None:
        """Per-sample logprobs before any update; with one update per step the live ones are equal, so skip."""
        if self.config.updates_per_step == 1:
            return None
        out: list[Tensor] = []
        for indices in micro_batches(samples, self.micro_batch_positions):
            chunk = [samples[i] for i in indices]
            logp, _ = self.logprobs(chunk)  # (M,) in sample order
            out.extend(logp.split([sum(s.loss_mask[1:]) for s in chunk]))
        return out

    def _update(self, samples: list[Sample], adv: Tensor, rollout: Tensor, norm: int,
                old: list[Tensor] | None, part: Sequence[int]) -> Metrics:
        """Accumulate gradients over packed micro-batches, clip, and take one optimizer step.

        `part[i]` is the index of samples[i] in the step's samples (trained_logprobs is kept by that index).
        """
        owner = pack(samples).sample_index  # (M,) over the whole mini-batch, for global loss weights
        weights = loss_weights(self.config.loss_agg, torch.ones(len(owner)), owner, rollout[owner], norm).float()
        starts = loss_token_starts(samples)  # where each sample's weights begin
        parts: list[tuple[Metrics, int]] = []
        for indices in self._micro_batches(samples):
            batch = pack([samples[i] for i in indices], first_index=indices[0])
            m, offset = len(batch.targets), starts[indices[0]]
            before = None if old is None else torch.cat([old[i] for i in indices])
            metrics, logp = self._backward(batch, adv[batch.sample_index], weights[offset:offset + m], before)
            self._keep_logprobs([samples[i] for i in indices], [part[i] for i in indices],
                                logp if before is None else before)
            metrics["train/tokens"] = batch.num_tokens
            parts.append((metrics, m))
        totals = _MetricSum()
        for metrics, m in self._all_parts(parts):
            totals.add(metrics, weight=m)
        self._reduce_gradients()
        grad_norm = self._clip_gradients()
        # A gradient of exactly 0 (every advantage 0, no KL term: no group had signal) must not move the policy.
        # AdamW would: its momentum from the last step with signal keeps pushing the weights the same way, step
        # after step. The norm is the whole mini-batch's (after _reduce_gradients), so every rank skips alike.
        skipped = grad_norm == 0.0
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        result = totals.result()
        result["actor/grad_norm"] = grad_norm
        result["train/optimizer_skipped"] = float(skipped)
        return result

    # Data parallel hooks (trainer.distributed.ShardedPolicy): in one process a rank trains every micro-batch.

    def _micro_batches(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Index lists of the micro-batches of a mini-batch this process trains."""
        return micro_batches(samples, self.micro_batch_positions)

    def _all_parts(self, parts: list[tuple[Metrics, int]]) -> list[tuple[Metrics, int]]:
        """Metrics and loss tokens of every micro-batch of the mini-batch, from whichever process trained it."""
        return parts

    def _reduce_gradients(self) -> None:
        """Make the accumulated gradients those of the whole mini-batch (a no-op in one process)."""

    def close(self) -> None:
        """Release the trainer's processes (none in one process)."""

    def _backward(self, batch: PackedBatch, adv: Tensor, weights: Tensor, old: Tensor | None
                  ) -> tuple[Metrics, Tensor]:
        """Loss and gradients of one packed micro-batch: its metrics and the (M,) logprobs it trained, detached."""
        device = next(self.model.parameters()).device
        batch, adv, weights = batch.to(device), adv.to(device), weights.to(device)
        old = None if old is None else old.to(device)
        logp, entropy = token_logprobs(self.model, batch, self.config.temperature, self._autocast,
                                       self.config.top_k)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.reference, batch, self.config.temperature, self._autocast,
                                        self.config.top_k)
        c = self.config
        loss, metrics = policy_loss(logp, logp.detach() if old is None else old, batch.behaviour, adv, weights,
                                    clip_low=c.clip_low, clip_high=c.clip_high, tis_cap=c.tis_cap,
                                    ref_logprobs=ref, kl_coef=c.kl_coef)
        loss.backward()
        metrics["loss/total"] = loss.item()
        metrics["actor/entropy"] = entropy.mean().item() if len(entropy) else 0.0
        metrics["train/loss_tokens"] = len(batch.targets)
        return metrics, logp.detach()

    def _keep_logprobs(self, chunk: list[Sample], step_indices: list[int], logp: Tensor) -> None:
        """Store the trainer's logprob of each loss token (before the update) at its position in its sample.

        `logp` lists the loss tokens of `chunk` in sample order, as `pack` does (loss_mask 1 and position > 0).
        """
        values = iter(logp.float().cpu().tolist())
        for sample, k in zip(chunk, step_indices):
            row = self.trained_logprobs[k]
            for t, m in enumerate(sample.loss_mask):
                if m and t > 0:
                    row[t] = next(values)

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm or float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0

    # ---- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """HF-format safetensors weights + config, trainer config, optimizer, RNG states and step.

        The optimizer state goes through torch.distributed.checkpoint (keyed by parameter name), so a checkpoint
        written at one world size loads at any other; every rank calls this, only rank 0 writes the other files.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        stepped = bool(self.optimizer.state)  # no state before the first optimizer step: nothing to save
        if stepped:
            with _checkpoint_errors():
                dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.optimizer)},
                         checkpoint_id=path / OPTIMIZER_DIR, no_dist=self.world_size == 1)
        if self.rank == 0:
            self.model.save_pretrained(path, safe_serialization=True)
            (path / TRAINER_CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2))
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, path / RNG_FILE)
            if self.reference is not None:
                save_file({k: v.contiguous() for k, v in self.reference.state_dict().items()
                           if k != "lm_head.weight" or not _tied(self.reference)}, path / REFERENCE_FILE)
            (path / STATE_FILE).write_text(json.dumps({"step": self.step}))
            logger.info("saved checkpoint of step %d to %s", self.step, path)
        return path

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore everything `save_checkpoint` wrote, so the next step equals the uninterrupted one."""
        path = Path(path)
        _load_weights(self.model, load_file(path / "model.safetensors"))
        if (path / OPTIMIZER_FILE).exists():  # the single-process format of earlier checkpoints
            self.optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))
        elif (path / OPTIMIZER_DIR / ".metadata").exists():
            optimizer = get_optimizer_state_dict(self.model, self.optimizer)
            with _checkpoint_errors():
                dcp.load({"optimizer": optimizer}, checkpoint_id=path / OPTIMIZER_DIR, no_dist=self.world_size == 1)
            set_optimizer_state_dict(self.model, self.optimizer, optimizer)
        else:  # saved before the first optimizer step (nothing trained yet)
            self.optimizer.state.clear()
        rng = torch.load(path / RNG_FILE, weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if self.reference is not None and (path / REFERENCE_FILE).exists():
            _load_weights(self.reference, load_file(path / REFERENCE_FILE))
        self.step = json.loads((path / STATE_FILE).read_text())["step"]


@contextmanager
def _checkpoint_errors():
    """torch.distributed.checkpoint wraps a rank's error in CheckpointException, a BaseException: it would pass
    every `except Exception` up to the Celery worker and take the worker down (a full disk did). Raise the rank's
    own error instead (OSError 28 for a full disk), or a RuntimeError with the message."""
    try:
        yield
    except CheckpointException as exc:
        failures = [failure[0] if isinstance(failure, tuple) else failure for failure in exc.failures.values()]
        first = next((f for f in failures if isinstance(f, Exception)), None)
        if first is not None:
            raise first from None
        raise RuntimeError(f"checkpoint failed: {exc}") from None


def read_checkpoint_config(path: str | os.PathLike) -> TrainerConfig:
    return TrainerConfig.from_dict(json.loads((Path(path) / TRAINER_CONFIG_FILE).read_text()))


def _tied(model: nn.Module) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def _load_weights(model: nn.Module, state: dict[str, Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if _tied(model) else set()
    if unexpected or set(missing) - allowed:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    if _tied(model):
        model.tie_weights()


def _frozen_copy(model: nn.Module) -> nn.Module:
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    return reference


def minibatches(n: int, parts: int) -> list[list[int]]:
    """Contiguous near-equal index lists (mini-batches)."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]


class _MetricSum:
    """Combines metrics of parts: loss/* and train/* add up, the rest are averaged weighted by tokens."""

    def __init__(self, sum_losses: bool = True) -> None:
        self.sum_losses = sum_losses
        self.sums: dict[str, float] = {}
        self.weight = 0.0
        self.maxima: dict[str, float] = {}

    def add(self, metrics: Metrics, weight: float = 1.0) -> None:
        self.weight += weight
        for key, value in metrics.items():
            if key.endswith("_max"):
                self.maxima[key] = max(self.maxima.get(key, value), value)
            elif key.endswith("_min"):
                self.maxima[key] = min(self.maxima.get(key, value), value)
            elif self._additive(key):
                self.sums[key] = self.sums.get(key, 0.0) + value
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * weight

    def result(self) -> Metrics:
        out = {k: (v if self._additive(k) else v / max(self.weight, 1e-12)) for k, v in self.sums.items()}
        out.update(self.maxima)
        return out

    def _additive(self, key: str) -> bool:
        return (self.sum_losses and key.startswith("loss/")) or key in ("train/tokens", "train/loss_tokens")
