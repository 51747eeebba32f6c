"""OptimizerConfig on its own: errors name ``optimizer.<field>`` (load_config renames the prefix
to the job section, tests/config/test_config_errors.py) and the schedule state round-trips."""

from __future__ import annotations

import pytest

from sao_megatron.optim import OptimizerConfig, build_optimizer
from sao_megatron.optim.config import PrecisionConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": 0.0}, "optimizer.lr=0.0: must be > 0"),
        ({"min_lr": 1.0, "lr": 0.5}, "optimizer.min_lr=1.0: must be in [0, lr=0.5]"),
        ({"adam_eps": 0.0}, "optimizer.adam_eps=0.0: must be > 0"),
    ],
)
def test_errors_use_the_generic_section(kwargs, message):
    assert OptimizerConfig.CONFIG_SECTION == "optimizer"
    with pytest.raises(ValueError) as info:
        OptimizerConfig(**kwargs)
    assert str(info.value) == message


def test_scheduler_load_sets_the_saved_step_count(parallel_1rank, tiny_moe):
    """Loading a schedule into a freshly built one (already stepped once for warm-up) gives the
    saved step count and LR, not their sum (issue 19.3)."""
    from sao_megatron.models import build_policy

    cfg = OptimizerConfig(lr=1e-3, warmup_steps=10, decay_style="linear", decay_steps=10)
    a = build_optimizer(
        build_policy(tiny_moe, parallel_1rank), parallel_1rank, cfg, PrecisionConfig()
    )
    for _ in range(3):
        a.scheduler.step(increment=1)
    saved = a.scheduler.state_dict()
    assert saved["num_steps"] == 4  # 1 at construction + 3 updates
    b = build_optimizer(
        build_policy(tiny_moe, parallel_1rank), parallel_1rank, cfg, PrecisionConfig()
    )
    assert b.scheduler.num_steps == 1
    b.scheduler.load_state_dict(saved)
    assert b.scheduler.num_steps == 4
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(4e-4, rel=1e-12)
    b.scheduler.load_state_dict(saved)  # idempotent
    assert b.scheduler.num_steps == 4


@pytest.mark.parametrize(
    ("saved_warmup", "new_warmup", "new_lr", "lr_at_update_4"),
    [
        (0, 20, 1e-3, 4e-3 / 20),  # a warm-up added on resume: update 4 of 20
        (10, 0, 1e-3, 1e-3),  # the warm-up dropped: the peak at once
        (10, 10, 5e-4, 5e-4 * 4 / 10),  # only the peak changed
    ],
)
def test_resumed_schedule_is_the_configured_one_at_the_saved_position(
    parallel_1rank, tiny_moe, caplog, saved_warmup, new_warmup, new_lr, lr_at_update_4
):
    """A job resumed with a changed schedule uses the configured warm-up and lr (both, not the
    checkpoint's warm-up with the config's lr) after the saved number of updates (3), and logs
    each field that changed."""
    from sao_megatron.models import build_policy

    def build(lr: float, warmup: int):
        cfg = OptimizerConfig(lr=lr, warmup_steps=warmup, decay_style="constant")
        return build_optimizer(
            build_policy(tiny_moe, parallel_1rank), parallel_1rank, cfg, PrecisionConfig()
        )

    a = build(1e-3, saved_warmup)
    for _ in range(3):  # 3 updates done
        a.scheduler.step(increment=1)
    b = build(new_lr, new_warmup)
    with caplog.at_level("WARNING", logger="sao_megatron.optim.builder"):
        b.scheduler.load_state_dict(a.scheduler.state_dict())  # sets update 4's lr
    assert b.scheduler.lr_warmup_steps == new_warmup and b.scheduler.max_lr == new_lr
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at_update_4, rel=1e-12)
    messages = " ".join(r.getMessage() for r in caplog.records)
    if saved_warmup != new_warmup:
        assert f"lr_warmup_steps {saved_warmup} in the checkpoint -> {new_warmup}" in messages
    if new_lr != 1e-3:
        assert f"max_lr 0.001 in the checkpoint -> {new_lr} from the config" in messages
