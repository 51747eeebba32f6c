"""The tiny MoE's fp32 policy and value train states, built one way for the trainer tests (the
golden runs, the critic-placement runs, the DP-whitening runs)."""

from __future__ import annotations

from tests.conftest import tiny_moe_kwargs

#: learning rates of the two optimizers (constant unless ``warmup_steps`` is given)
POLICY_LR = 1e-3
VALUE_LR = 5e-3


def build_train_states(parallel, *, with_value: bool = True, role: str | None = None, **optim):
    """(policy TrainState, value TrainState) of the tiny MoE (`tests.conftest.tiny_moe_kwargs`)
    in fp32, seeded by ``parallel.cfg.seed``; the value model is initialised from the policy's
    trunk and frozen by the default patterns.

    Args:
        parallel: this rank's `ParallelState` (a role's own with split roles).
        with_value: build the value model (SAO); False: the value state is None (GRPO).
        role: "policy" or "value" leaves the other state None (its model is still built, so the
            seeded init and the value's trunk are the colocated ones); None returns both.
        optim: further `OptimizerConfig` fields of both optimizers (``warmup_steps=2``,
            ``adam_eps=1e-3``).
    """
    from sao_megatron.models import (
        VALUE_DEFAULT_FREEZE_PATTERNS,
        MoEModelConfig,
        apply_freeze,
        build_policy,
        build_value_model,
        init_value_from_policy,
    )
    from sao_megatron.optim.builder import build_optimizer
    from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig

    if role not in (None, "policy", "value") or (role == "value" and not with_value):
        raise ValueError(f"role={role!r}: use None, 'policy' or (with the value model) 'value'")
    cfg, prec = MoEModelConfig(**tiny_moe_kwargs()), PrecisionConfig()
    policy = build_policy(cfg, parallel, prec)
    p_state = v_state = None
    if role in (None, "policy"):
        p_state = build_optimizer(policy, parallel, OptimizerConfig(lr=POLICY_LR, **optim), prec)
    if with_value:
        value = build_value_model(cfg, parallel, prec)
        for v, p in zip(value, policy, strict=True):
            init_value_from_policy(v, p.state_dict())
        apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS, group=parallel.pg_collection.pp)
        if role in (None, "value"):
            v_state = build_optimizer(value, parallel, OptimizerConfig(lr=VALUE_LR, **optim), prec)
    return p_state, v_state
