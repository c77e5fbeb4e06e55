"""TrainerConfig: the one validated configuration of a training run (saved with every checkpoint)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any


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
    """Sampling temperature used by the engine for rollouts."""
    mode: str = "sync"
    """Scheduling mode: 'sync' or 'async'."""
    seed: int = 0
    """Seed for task sampling and torch."""
    extra: dict = field(default_factory=dict)
    """Free-form notes carried along with the config (not interpreted)."""

    def __post_init__(self) -> None:
        for name in ("steps", "tasks_per_step", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.mode not in ("sync", "async"):
            raise ConfigError(f"mode must be 'sync' or 'async', got {self.mode!r}")

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
