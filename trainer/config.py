"""TrainerConfig: the one validated configuration of a training run (saved with every checkpoint)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from trainer.host import AUTO, ENGINE_DTYPES, TRAINER_DTYPES, Formats, detect, resolve

if TYPE_CHECKING:
    from trainer.host import HostProfile

# Names are kept here (not imported from trainer.algorithms) so validating a config never imports torch.
ADVANTAGE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "rollout_mean")
DTYPES = TRAINER_DTYPES
MODES = ("sync", "async")


class ConfigError(ValueError):
    """An impossible or malformed configuration; the message names the field and the fix."""


@dataclass(frozen=True)
class TrainerConfig:
    """Hyperparameters and scheduling of one run. Every field has a default."""

    steps: int = 10
    """Number of training steps (policy updates) in the run."""
    tasks_per_step: int = 8
    """Distinct train tasks (groups) per step."""
    group_size: int = 4
    """Attempts per task in one group (GRPO group size)."""
    learning_rate: float = 1e-5
    """AdamW learning rate."""
    temperature: float = 0.7
    """Sampling temperature of every rollout call (the proxy enforces it); the trainer scales logits by it too."""
    top_p: float = 1.0
    """Nucleus sampling mass, enforced by the proxy; only 1.0 (off): the trainer cannot reproduce its renormalisation."""
    top_k: int = -1
    """Sample among the k most likely tokens (enforced by the proxy, reproduced by the trainer); -1 or 0: off."""
    failure_reward: float = 0.0
    """Reward of a policy failure (the harness timed out or exited non-zero after the model answered)."""
    mode: str = "sync"
    """Scheduling mode: 'sync' (generate, train, sync weights) or 'async' (groups stay in flight while training)."""
    seed: int = 0
    """Seed for task sampling and torch."""
    advantage: str = "grpo"
    """Advantage estimator over a group: 'grpo' (mean/std), 'dr_grpo' (mean only) or 'rloo' (leave-one-out)."""
    loss_agg: str = "token_mean"
    """Loss aggregation: 'token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum_norm' or 'rollout_mean'."""
    loss_norm_tokens: int = 0
    """Divisor of 'seq_mean_token_sum_norm' (Dr. GRPO's constant); 0: the most loss tokens of a sample in the step."""
    adv_eps: float = 1e-6
    """Added to the group std in 'grpo' so equal-reward groups do not divide by zero."""
    clip_low: float = 0.2
    """PPO-clip lower bound: the ratio is clipped at 1 - clip_low for negative advantages."""
    clip_high: float = 0.28
    """PPO-clip upper bound: the ratio is clipped at 1 + clip_high for positive advantages (clip-higher)."""
    tis_cap: float = 2.0
    """Cap of the truncated importance weight pi_old / pi_behaviour; 0 disables the correction."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen initial model; 0 keeps no reference model."""
    updates_per_step: int = 1
    """Optimizer steps per training step (the batch is split into this many mini-batches)."""
    micro_batch_tokens: int = 1024
    """Padded positions (rows x row width, padding included) per micro-batch; a longer sample goes alone."""
    max_train_memory_gb: float = 5.0
    """Peak memory of a training step in GB: lowers micro_batch_tokens to fit (trainer.memory); 0: no limit."""
    gradient_checkpointing: bool = False
    """Recompute layers in backward: 4.7x less activation memory, 15-20% fewer tokens/s (SmolLM2 on CPU)."""
    world_size: int = 1
    """Trainer processes (torch.distributed data parallel, trainer.distributed); the step's batch is split between
    them and their gradients summed, so any world size takes the same update. 1: train in the worker process."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    dtype: str = AUTO
    """Training compute dtype: 'auto' (bfloat16 where the host computes it natively, else float32), 'float32' or
    'bfloat16' (autocast; weights and optimizer stay float32). On a CPU without native bf16, bf16 autocast trained
    SmolLM2 at 9 tokens/s against 190 in float32 (bench/cpu_speed.py)."""
    engine_dtype: str = AUTO
    """Engine: vLLM --dtype, 'auto' (bfloat16 where the host computes it natively, else float32), 'bfloat16' or
    'float32'. The engine serves, and weight sync writes, its weights in this dtype."""
    max_staleness: int = 1
    """Async only: the most policy versions a trained sample may lag behind the policy it updates."""
    groups_in_flight: int = 0
    """Async only: most groups launched and not yet trained; 0 means tasks_per_step * (max_staleness + 1)."""
    dynamic_sampling: bool = False
    """Drop a finished group whose counted rewards are all equal (it gives GRPO nothing to learn from) and sample
    another task in its place, until the step holds tasks_per_step groups with signal or its extra budget
    (dynamic_sampling_max_extra) is spent; a dropped group's rollouts stay recorded, marked 'no_signal'."""
    dynamic_sampling_max_extra: float = 2.0
    """Dynamic sampling: the most groups one step may drop and replace, as a multiple of tasks_per_step (2.0: up
    to twice the batch more). Once spent, the step trains the groups it has, signal or not."""
    pass_threshold: float = 1.0
    """A rollout with reward at least this counts as a pass in the pass-rate metric."""
    checkpoint_every: int = 5
    """Save a checkpoint every this many steps (and at the end); 0 saves only at the end. A run whose worker dies
    resumes from its last checkpoint, so this bounds the work lost: 5 steps of the demo (40-100 s each on 2 CPU
    cores) is 3-8 minutes, against a few seconds to write one (SmolLM2-135M: about 1.6 GB with AdamW state)."""
    max_model_len: int = 4096
    """Engine: longest prompt + completion in tokens (vLLM --max-model-len)."""
    kv_cache_gb: float = 1.0
    """Engine: KV cache size in GiB."""
    engine_replicas: int = 1
    """Engine: vLLM servers of the model (each its own port and, on a GPU host, its own device); the proxy pins each
    rollout to one and retries a call cut off by a dying one on another. 1: one engine, as without replicas."""
    eval_every: int = 0
    """Score val tasks (eval/pass@1) every N steps, and before the first and after the last; 0: those two only."""
    eval_tasks: int = 100
    """Val tasks per evaluation (the first N of the dataset's val split); 0 turns evaluation off."""
    eval_samples: int = 4
    """Attempts per val task at the rollout sampling: eval/pass@1 is their mean, eval/pass@k their best-of-k.
    4 halves the standard deviation of one attempt's sampling noise (one attempt on 50 tasks spread 0.32-0.58
    over 7 evaluations of the same weights) for 4x the attempts, which run eval_concurrency at a time."""
    eval_greedy: bool = True
    """Also one greedy (temperature 0) attempt per val task: eval/pass@1_greedy, free of sampling noise."""
    eval_concurrency: int = 32
    """Evaluation attempts in flight at once (training keeps its own tasks_per_step * group_size): vLLM on 2 CPU
    cores answered 100 calls in 10.5 s at 32 concurrent, 21.6 s at 8."""
    health: dict = field(default_factory=dict)
    """Run-health alarm thresholds over their defaults (health.rules.DEFAULTS names them and says what each does);
    {} keeps every default. The app checks the names and values when a run is created."""
    extra: dict = field(default_factory=dict)
    """Free-form notes carried along with the config (not interpreted)."""

    def __post_init__(self) -> None:
        for check in (_check_sizes, _check_names, _check_optimisation, _check_scheduling):
            check(self)

    @property
    def effective_groups_in_flight(self) -> int:
        """Groups the scheduler keeps launched: exactly one step's worth in sync mode."""
        if self.mode == "sync":
            return self.tasks_per_step
        return self.groups_in_flight or self.tasks_per_step * (self.max_staleness + 1)

    @property
    def sampling(self) -> dict[str, float | int]:
        """The sampling parameters the proxy puts on every engine call (whatever the harness asked for)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @property
    def extra_groups_per_step(self) -> int:
        """Groups one step may drop for lack of signal and replace (0 without dynamic sampling)."""
        if not self.dynamic_sampling:
            return 0
        return math.ceil(self.dynamic_sampling_max_extra * self.tasks_per_step - 1e-9)

    @property
    def effective_max_staleness(self) -> int:
        return 0 if self.mode == "sync" else self.max_staleness

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "TrainerConfig":
        """Build from a JSON dict: unknown keys and wrongly typed values raise ConfigError."""
        data = dict(data or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; valid fields are {sorted(known)}")
        kwargs = {}
        for name, value in data.items():
            kwargs[name] = _coerce(name, known[name], value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def on_host(self, profile: "HostProfile") -> tuple["TrainerConfig", Formats]:
        """This config with `auto` dtypes made concrete for the host (trainer.host.resolve), and the formats."""
        formats = resolve(profile, self.engine_dtype, self.dtype)
        return dataclasses.replace(self, dtype=formats.trainer_dtype, engine_dtype=formats.engine_dtype), formats

    def for_this_host(self) -> "TrainerConfig":
        """This config with `auto` made concrete for the host this process runs on (itself when nothing is auto)."""
        if AUTO not in (self.dtype, self.engine_dtype):
            return self
        return self.on_host(detect())[0]


SIZE_LIMITS: dict[str, float] = {
    "steps": 100_000, "tasks_per_step": 4096, "group_size": 256, "updates_per_step": 1024,
    "micro_batch_tokens": 1_048_576, "eval_samples": 64, "eval_concurrency": 1024, "world_size": 64,
    "engine_replicas": 64, "loss_norm_tokens": 10_000_000, "max_staleness": 64, "groups_in_flight": 65_536,
    "checkpoint_every": 100_000, "eval_every": 100_000, "eval_tasks": 100_000, "max_model_len": 1_048_576,
    "kv_cache_gb": 4096.0, "max_train_memory_gb": 4096.0, "dynamic_sampling_max_extra": 64.0,
}
"""The most each size field may be: far past any machine this runs on, so that a typo (an extra zero, a number
pasted in the wrong field) is refused with its field named instead of launching thousands of harnesses or
reserving terabytes."""


def _check_sizes(c: TrainerConfig) -> None:
    for name, most in SIZE_LIMITS.items():
        if getattr(c, name) > most:
            raise ConfigError(f"{name} must be at most {most:g}, got {getattr(c, name):g}; a limit against "
                              "typos (trainer.config.SIZE_LIMITS)")
    for name in ("steps", "tasks_per_step", "group_size", "updates_per_step", "micro_batch_tokens", "eval_samples",
                 "eval_concurrency", "world_size",
                 "engine_replicas"):
        if getattr(c, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(c, name)}; set {name} >= 1")
    for name in ("loss_norm_tokens", "max_staleness", "groups_in_flight", "checkpoint_every", "eval_every",
                 "eval_tasks"):
        if getattr(c, name) < 0:
            raise ConfigError(f"{name} must not be negative, got {getattr(c, name)}; set {name} >= 0")
    if c.max_model_len < 16:
        raise ConfigError(f"max_model_len must be at least 16 tokens, got {c.max_model_len}")
    if c.kv_cache_gb <= 0:
        raise ConfigError(f"kv_cache_gb must be positive, got {c.kv_cache_gb}; 1 GiB suits small models on CPU")


def _check_names(c: TrainerConfig) -> None:
    for name, valid in (("mode", MODES), ("advantage", ADVANTAGE_ESTIMATORS),
                        ("loss_agg", LOSS_AGGREGATIONS), ("dtype", DTYPES), ("engine_dtype", ENGINE_DTYPES)):
        if getattr(c, name) not in valid:
            raise ConfigError(f"{name} must be one of {list(valid)}, got {getattr(c, name)!r}")
    if c.group_size < 2 and c.advantage in ("grpo", "rloo"):
        raise ConfigError(f"advantage={c.advantage!r} needs a group baseline: with group_size=1 every "
                          "advantage is 0; set group_size >= 2")


def _check_optimisation(c: TrainerConfig) -> None:
    if c.learning_rate <= 0:
        raise ConfigError(f"learning_rate must be positive, got {c.learning_rate}; set e.g. 1e-5")
    if c.temperature <= 0:
        raise ConfigError(f"temperature must be positive (greedy decoding has no usable logprobs), "
                          f"got {c.temperature}; set e.g. 0.7")
    if c.top_p != 1.0:
        raise ConfigError(f"top_p={c.top_p} is not supported: the trainer cannot reproduce nucleus sampling's "
                          "renormalised distribution, so its logprobs would not match the engine's; set top_p=1.0 "
                          "(use temperature or top_k to sharpen sampling)")
    if c.top_k < -1:
        raise ConfigError(f"top_k must be -1 or 0 (off) or a positive number of tokens, got {c.top_k}")
    if not 0 < c.clip_low < 1:
        raise ConfigError(f"clip_low must be in (0, 1) so 1 - clip_low stays positive, got {c.clip_low}; set e.g. 0.2")
    if c.clip_high <= 0:
        raise ConfigError(f"clip_high must be positive, got {c.clip_high}; set e.g. 0.28")
    if c.tis_cap != 0 and c.tis_cap < 1:
        raise ConfigError(f"tis_cap below 1 would down-weight even on-policy tokens, got {c.tis_cap}; "
                          "set tis_cap >= 1 or 0 to disable the correction")
    for name in ("kl_coef", "max_grad_norm", "weight_decay", "adv_eps", "max_train_memory_gb",
                 "dynamic_sampling_max_extra"):
        if getattr(c, name) < 0:
            raise ConfigError(f"{name} must not be negative, got {getattr(c, name)}; set {name} >= 0")
    if c.updates_per_step > c.tasks_per_step * c.group_size:
        raise ConfigError(f"updates_per_step={c.updates_per_step} exceeds the rollouts per step "
                          f"({c.tasks_per_step * c.group_size}); lower updates_per_step or raise tasks_per_step")


def _check_scheduling(c: TrainerConfig) -> None:
    if c.mode == "async" and c.max_staleness < 1:
        raise ConfigError("mode='async' with max_staleness=0 cannot keep any group in flight while training; "
                          "set max_staleness >= 1 or mode='sync'")
    if c.mode == "sync" and c.groups_in_flight not in (0, c.tasks_per_step):
        raise ConfigError(f"mode='sync' launches exactly tasks_per_step={c.tasks_per_step} groups per step; "
                          "set groups_in_flight=0 or mode='async'")
    if c.groups_in_flight and c.groups_in_flight < c.tasks_per_step:
        raise ConfigError(f"groups_in_flight={c.groups_in_flight} can never fill a step of tasks_per_step="
                          f"{c.tasks_per_step} groups; set groups_in_flight >= {c.tasks_per_step} or 0 for auto")


def _coerce(name: str, f: dataclasses.Field, value: Any) -> Any:
    """Check a JSON value against the field's declared type (ints may stand for floats)."""
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    checks = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,)}
    allowed = checks.get(kind.split("[")[0].split("|")[0].strip())
    if allowed is None:
        return value
    if isinstance(value, bool) and kind != "bool":
        raise ConfigError(f"{name} must be {kind}, got a boolean")
    if not isinstance(value, allowed):
        raise ConfigError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    return float(value) if kind == "float" else value
