"""TrainerConfig: defaults, JSON round trip, and impossible combinations rejected with the fix named."""
import dataclasses
import inspect
import json

import pytest

from trainer.config import ConfigError, TrainerConfig


def test_it_round_trips_through_json():
    config = TrainerConfig.from_dict({"mode": "async", "max_staleness": 2, "learning_rate": 1, "advantage": "rloo"})
    data = json.loads(json.dumps(config.to_dict()))
    assert TrainerConfig.from_dict(data) == config
    assert config.learning_rate == 1.0 and isinstance(config.learning_rate, float)
    assert config.effective_groups_in_flight == 8 * 3
    assert config.effective_max_staleness == 2


def test_it_documents_every_field_with_a_default():
    source = open(inspect.getsourcefile(TrainerConfig)).read()
    for f in dataclasses.fields(TrainerConfig):
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        # The docstring line follows the field's declaration.
        lines = source.splitlines()
        i = next(n for n, line in enumerate(lines) if line.strip().startswith(f"{f.name}:"))
        assert lines[i + 1].strip().startswith('"""'), f.name


def test_it_keeps_one_step_of_groups_in_sync_mode():
    config = TrainerConfig()
    assert (config.mode, config.effective_groups_in_flight, config.effective_max_staleness) == ("sync", 8, 0)


@pytest.mark.parametrize("data, fix", [
    ({"mode": "async", "max_staleness": 0}, "set max_staleness >= 1 or mode='sync'"),
    ({"groups_in_flight": 16}, "set groups_in_flight=0 or mode='async'"),
    ({"mode": "async", "groups_in_flight": 3}, "set groups_in_flight >= 8 or 0 for auto"),
    ({"group_size": 1}, "set group_size >= 2"),
    ({"advantage": "ppo"}, "advantage must be one of ['grpo', 'dr_grpo', 'rloo']"),
    ({"loss_agg": "sum"}, "'rollout_mean'"),
    ({"tis_cap": 0.5}, "set tis_cap >= 1 or 0 to disable"),
    ({"clip_low": 1.5}, "clip_low must be in (0, 1)"),
    ({"temperature": 0}, "set e.g. 0.7"),
    ({"dtype": "float16"}, "dtype must be one of ['auto', 'float32', 'bfloat16']"),
    ({"engine_dtype": "float64"}, "engine_dtype must be one of ['auto', 'bfloat16', 'float32']"),
    ({"updates_per_step": 64}, "lower updates_per_step"),
    ({"steps": 0}, "set steps >= 1"),
    ({"micro_batch_tokens": 0}, "set micro_batch_tokens >= 1"),
    ({"max_train_memory_gb": -1}, "max_train_memory_gb must not be negative, got -1.0; set max_train_memory_gb >= 0"),
    ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be bool, got str 'yes'"),
    ({"gradient_checkpointing": 1}, "gradient_checkpointing must be bool, got int 1"),
    ({"stepz": 3}, "unknown config field(s) ['stepz']"),
    ({"steps": "3"}, "steps must be int, got str"),
    ({"steps": True}, "steps must be int, got a boolean"),
])
def test_it_rejects_impossible_configs_naming_the_fix(data, fix):
    with pytest.raises(ConfigError) as info:
        TrainerConfig.from_dict(data)
    assert fix in str(info.value)


def test_it_accepts_dr_grpo_with_single_attempts():
    assert TrainerConfig.from_dict({"group_size": 1, "advantage": "dr_grpo"}).group_size == 1


def test_every_size_field_has_an_upper_bound_that_names_it():
    """Issue 26.6: a size past its limit is refused naming the field; the limit itself is allowed."""
    import dataclasses

    from trainer.config import SIZE_LIMITS, ConfigError, TrainerConfig

    sized = {f.name for f in dataclasses.fields(TrainerConfig) if f.type in ("int", "float", int, float)}
    unbounded = sized - set(SIZE_LIMITS) - {"learning_rate", "temperature", "top_p", "top_k", "failure_reward",
                                            "seed", "adv_eps", "clip_low", "clip_high", "tis_cap", "kl_coef",
                                            "max_grad_norm", "weight_decay", "pass_threshold"}
    assert unbounded == set(), f"size fields without an upper bound: {unbounded}"
    for name, most in SIZE_LIMITS.items():
        value = int(most) + 1 if isinstance(getattr(TrainerConfig(), name), int) else most * 2
        with pytest.raises(ConfigError, match=f"^{name} must be at most"):
            TrainerConfig.from_dict({name: value})
