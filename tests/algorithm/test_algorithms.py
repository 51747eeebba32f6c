"""The algorithm objects: registry, schedules, advantages and policy losses of SAO, GRPO and
GRPO+DIS against float64 loop references."""

from __future__ import annotations

import math

import pytest
import torch

from sao_megatron.algorithm import registry
from sao_megatron.algorithm.advantages import masked_whiten
from sao_megatron.algorithm.base import AdvantageInputs, Algorithm, Phase
from sao_megatron.algorithm.config import (
    AlgorithmConfig,
    GRPOConfig,
    ImportanceConfig,
    PPOClipConfig,
    SAOConfig,
)
from sao_megatron.algorithm.importance import tis_weights
from tests.algorithm.batches import random_batch, random_logprobs
from tests.algorithm.test_advantages import ref_grpo, ref_node_gae, ref_token_gae
from tests.algorithm.test_losses import make, ref_aggregate, ref_ppo


def build(**kw) -> Algorithm:
    return registry.build(AlgorithmConfig(**kw))


# ---------------------------------------------------------------- registry


def test_registry_lists_and_builds_the_three_algorithms(package_registry):
    assert registry.names() == ["grpo", "grpo_dis", "sao"]
    for name in registry.names():
        algo = build(name=name)
        assert type(algo) is registry.get(name) and algo.name == name
    with pytest.raises(ValueError, match=r"algorithm.name='ppo'.*use one of grpo, grpo_dis, sao"):
        registry.get("ppo")


def test_register_rejects_a_taken_or_empty_name(package_registry):
    class Other(Algorithm):
        name = "sao"

    with pytest.raises(ValueError, match="'sao' is already registered"):
        registry.register(Other)

    class Nameless(Algorithm):
        pass

    with pytest.raises(ValueError, match="non-empty"):
        registry.register(Nameless)
    assert registry.names() == ["grpo", "grpo_dis", "sao"]
    with pytest.raises(ValueError, match="registry.build"):
        registry.get("grpo")(AlgorithmConfig(name="sao"))


def test_a_fourth_algorithm_is_one_registered_class():
    """What docs/ALGORITHM.md "Adding an algorithm" describes: subclass, register, configure."""

    @registry.register
    class Reinforce(Algorithm):
        name = "test_reinforce"
        importance_weightings = ("none",)
        schedule = (Phase.ADVANTAGES, Phase.POLICY_UPDATE)

        @classmethod
        def config_sections(cls, config):
            return {"importance"}

    try:
        cfg = AlgorithmConfig(name="test_reinforce")
        assert isinstance(registry.build(cfg), Reinforce) and cfg.importance.weighting == "none"
        with pytest.raises(ValueError, match="algorithm.sao.gamma=0.5 is ignored"):
            AlgorithmConfig(name="test_reinforce", sao=SAOConfig(gamma=0.5))
    finally:
        registry._REGISTRY.pop("test_reinforce")


# ---------------------------------------------------------------- what each algorithm says


def test_sao_schedule_is_value_x_k_then_advantages_then_policy():
    s = build(sao=SAOConfig(value_updates_per_policy_update=2))
    assert s.schedule == (
        Phase.VALUE_TARGETS,
        Phase.VALUE_UPDATE,
        Phase.VALUE_UPDATE,
        Phase.ADVANTAGES,
        Phase.POLICY_UPDATE,
    )
    k0 = build(sao=SAOConfig(value_updates_per_policy_update=0)).schedule
    assert k0 == (Phase.VALUE_TARGETS, Phase.ADVANTAGES, Phase.POLICY_UPDATE)
    assert (s.needs_value_model, s.group_size, s.keeps_groups_together) == (True, 1, False)


def test_grpo_schedules():
    g = build(name="grpo", grpo=GRPOConfig(group_size=4))
    assert g.schedule == (Phase.OLD_LOGPROBS, Phase.ADVANTAGES, Phase.POLICY_UPDATE)
    assert (g.needs_value_model, g.group_size, g.keeps_groups_together) == (False, 4, True)
    d = build(name="grpo_dis", grpo=GRPOConfig(group_size=2))
    assert d.schedule == (Phase.ADVANTAGES, Phase.POLICY_UPDATE)  # no old log-probs
    assert (d.needs_value_model, d.group_size, d.keeps_groups_together) == (False, 2, True)


def test_phase_timers():
    timers = {p: p.timer for p in Phase}
    assert timers == {
        Phase.VALUE_TARGETS: "value",
        Phase.VALUE_UPDATE: "value",
        Phase.OLD_LOGPROBS: "old_logprobs",
        Phase.ADVANTAGES: "advantages",
        Phase.POLICY_UPDATE: "policy",
    }


# ---------------------------------------------------------------- advantages


def _inputs(bt, values=True, groups=None):
    return AdvantageInputs(
        node_rewards=bt.node_rewards,
        node_index=bt.node_index,
        action_mask=bt.action_mask,
        values=bt.values if values else None,
        truncated=bt.truncated,
        bootstrap_values=bt.bootstrap_values,
        group_ids=groups,
    )


@pytest.mark.parametrize("granularity", ["action_token", "node_last_token", "node_mean"])
def test_sao_advantages_follow_the_granularity(granularity):
    bt = random_batch(7)
    sao = SAOConfig(advantage_granularity=granularity, gamma=0.95, lam_policy=0.9)
    out = build(sao=sao).advantages(_inputs(bt))
    if granularity == "action_token":
        ref, ref_ret = ref_token_gae(bt, 0.95, 0.9, 1.0, True)
        vmask = bt.action_mask
    else:
        mode = "last_token" if granularity == "node_last_token" else "mean"
        ref, ref_ret, vmask = ref_node_gae(bt, 0.95, 0.9, 1.0, True, mode)
    torch.testing.assert_close(out.advantages, ref)
    assert torch.equal(out.value_mask, vmask)
    torch.testing.assert_close(out.returns[vmask], ref_ret[vmask])
    white = build(sao=sao, whiten_advantages=True).advantages(_inputs(bt))
    torch.testing.assert_close(white.advantages, masked_whiten(ref, bt.action_mask))
    with pytest.raises(ValueError, match="needs values"):
        build(sao=sao).advantages(_inputs(bt, values=False))


@pytest.mark.parametrize("name", ["grpo", "grpo_dis"])
def test_group_advantages_broadcast_to_action_tokens(name):
    bt = random_batch(8, batch=8)
    groups = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    out = build(name=name).advantages(_inputs(bt, values=False, groups=groups))
    per_row = ref_grpo(bt.node_rewards.sum(1).tolist(), groups.tolist(), True, 1e-6)
    torch.testing.assert_close(out.advantages, torch.where(bt.action_mask, per_row[:, None], 0.0))
    assert out.returns is None and out.value_mask is None
    dr = build(name=name, grpo=GRPOConfig(std_normalize=False))
    per_row = ref_grpo(bt.node_rewards.sum(1).tolist(), groups.tolist(), False, 1e-6)
    got = dr.advantages(_inputs(bt, values=False, groups=groups)).advantages
    torch.testing.assert_close(got, torch.where(bt.action_mask, per_row[:, None], 0.0))
    with pytest.raises(ValueError, match="group_ids"):
        build(name=name).advantages(_inputs(bt, values=False))


# ---------------------------------------------------------------- policy losses


def _loss(algo, lp, blp, adv, mask, old=None):
    return algo.policy_loss(
        logprobs=lp, behaviour_logprobs=blp, advantages=adv, action_mask=mask, old_logprobs=old
    )


def ref_behaviour_loss(lp, blp, adv, mask, weight, mode="token_mean"):
    """float64 loop: -w(r_t) A_t l_theta_t per action token, r_t = exp(l_theta - l_b)."""
    per = torch.zeros(lp.shape, dtype=torch.float64)
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t]:
                r = math.exp(float(lp[b, t] - blp[b, t]))
                per[b, t] = -weight(r) * float(adv[b, t]) * float(lp[b, t])
    return torch.tensor(ref_aggregate(per, mask, mode), dtype=torch.float64)


def dis_band(lo, hi):
    return lambda r: r if 1 - lo < r < 1 + hi else 0.0


@pytest.mark.parametrize("name", ["sao", "grpo_dis"])
@pytest.mark.parametrize("kind", ["dis_band", "tis", "none"])
def test_behaviour_policy_loss_of_sao_and_grpo_dis(name, kind):
    mask, lp, blp, adv = make(2)
    imp = ImportanceConfig(weighting=kind, eps_low=0.2, eps_high=0.5)
    got = _loss(build(name=name, importance=imp), lp, blp, adv, mask)
    weight = {"dis_band": dis_band(0.2, 0.5), "tis": lambda r: min(r, 2.0), "none": lambda r: 1}
    torch.testing.assert_close(got, ref_behaviour_loss(lp, blp, adv, mask, weight[kind]))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum"])
def test_grpo_dis_loss_is_dis_on_group_advantages(mode):
    """GRPO+DIS end to end on the math: group advantages of the trajectories' rewards, then the
    DIS loss on the behaviour log-probs; no old log-probs are read (passing some changes
    nothing)."""
    bt = random_batch(9, batch=6)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    algo = build(name="grpo_dis", loss_aggregation=mode)
    adv = algo.advantages(_inputs(bt, values=False, groups=groups)).advantages
    lp = torch.where(bt.action_mask, -1.0 + 0.3 * torch.rand(bt.action_mask.shape), 0.0).double()
    blp = lp + torch.where(bt.action_mask, 0.4 * torch.randn(lp.shape), 0.0).double()
    got = _loss(algo, lp, blp, adv, bt.action_mask)
    per_row = ref_grpo(bt.node_rewards.sum(1).tolist(), groups.tolist(), True, 1e-6)
    ref_adv = torch.where(bt.action_mask, per_row[:, None], 0.0)
    ref = ref_behaviour_loss(lp, blp, ref_adv, bt.action_mask, dis_band(0.3, 5.0), mode)
    torch.testing.assert_close(got, ref)
    assert torch.equal(got, _loss(algo, lp, blp, adv, bt.action_mask, old=lp - 1.0))


def test_grpo_loss_is_ppo_clip_on_old_logprobs_with_behaviour_weight():
    mask, lp, blp, adv = make(4)
    old = lp - 0.05
    algo = build(
        name="grpo",
        importance=ImportanceConfig(weighting="tis"),
        ppo=PPOClipConfig(clip_high=0.28),
    )
    got = _loss(algo, lp, blp, adv, mask, old=old)
    w = tis_weights(old, blp, mask, 2.0).weights
    ref = ref_ppo(lp, old, torch.nan_to_num(adv), mask, 0.2, 0.28, 3.0, w)
    torch.testing.assert_close(
        got, torch.tensor(ref_aggregate(ref, mask, "token_mean"), dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="old_logprobs"):
        _loss(algo, lp, blp, adv, mask)


def test_sao_ppo_clip_is_ppo_on_the_behaviour_ratio():
    """importance.weighting=ppo_clip (the DIS-vs-PPO ablation): PPO's clipped surrogate with the
    behaviour log-probs as pi_old, against the float64 loop reference."""
    mask, lp, blp, adv = make(11)
    algo = build(
        importance=ImportanceConfig(weighting="ppo_clip"),
        ppo=PPOClipConfig(clip_low=0.2, clip_high=0.3),
    )
    loss = _loss(algo, lp, blp, adv, mask)
    ref = ref_ppo(lp, blp, torch.nan_to_num(adv), mask, 0.2, 0.3, 3.0, None)
    torch.testing.assert_close(
        loss, torch.tensor(ref_aggregate(ref, mask, "token_mean"), dtype=torch.float64)
    )
    assert not torch.allclose(loss, _loss(build(), lp, blp, adv, mask))  # not the DIS band


def test_sao_decoupled_ppo_clips_at_the_trainers_old_logprobs():
    """importance.weighting=decoupled_ppo: SAO's schedule gains OLD_LOGPROBS after its value
    updates, and its loss is PPO's clip on exp(l_theta - l_old) times the capped behaviour
    weight exp(l_old - l_b), against the float64 loop reference (the cap binds on some tokens).
    Without l_old it is a clear error; with l_old = l_b it is SAO's shipped ppo_clip loss."""
    mask, lp, blp, adv = make(6)
    g = torch.Generator().manual_seed(8)
    old = lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64)
    old = torch.where(mask, old, 0.0)
    ppo = PPOClipConfig(clip_low=0.2, clip_high=0.28)
    algo = build(
        importance=ImportanceConfig(weighting="decoupled_ppo", decoupled_weight_cap=1.5), ppo=ppo
    )
    assert algo.schedule == (
        Phase.VALUE_TARGETS,
        Phase.VALUE_UPDATE,
        Phase.VALUE_UPDATE,
        Phase.OLD_LOGPROBS,
        Phase.ADVANTAGES,
        Phase.POLICY_UPDATE,
    )
    w = torch.zeros(lp.shape, dtype=torch.float64)
    for b, t in mask.nonzero().tolist():
        w[b, t] = min(math.exp(float(old[b, t] - blp[b, t])), 1.5)
    assert 0 < int((w[mask] == 1.5).sum()) < int(mask.sum())  # the cap binds on some tokens
    got = _loss(algo, lp, blp, adv, mask, old=old)
    ref = ref_ppo(lp, old, torch.nan_to_num(adv), mask, 0.2, 0.28, 3.0, w)
    torch.testing.assert_close(
        got, torch.tensor(ref_aggregate(ref, mask, "token_mean"), dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="decoupled_ppo.*needs old_logprobs"):
        _loss(algo, lp, blp, adv, mask)
    shipped = build(importance=ImportanceConfig(weighting="ppo_clip"), ppo=ppo)
    torch.testing.assert_close(
        _loss(algo, lp, blp, adv, mask, old=blp), _loss(shipped, lp, blp, adv, mask)
    )
    assert Phase.OLD_LOGPROBS not in shipped.schedule  # SAO as shipped saves the forward


def test_the_documented_fourth_algorithm_runs():
    """docs/ALGORITHM.md "Adding an algorithm": its code registers and computes what it says
    (REINFORCE on GRPO's group advantages, no importance weight) against a float64 loop."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "ALGORITHM.md").read_text()
    section = doc.split("## Adding an algorithm", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace("from .", "from sao_megatron.algorithm.")
    namespace: dict = {}
    exec(compile(code, "docs/ALGORITHM.md", "exec"), namespace)
    try:
        cfg = AlgorithmConfig(name="reinforce", grpo=GRPOConfig(group_size=3))
        algo = registry.build(cfg)
        assert algo.group_size == 3 and not algo.needs_value_model
        bt = random_batch(5, batch=6)
        groups = torch.tensor([0, 0, 0, 1, 1, 1])
        adv = algo.advantages(_inputs(bt, values=False, groups=groups)).advantages
        mask = bt.action_mask
        lp, blp = random_logprobs(mask, 5)
        got = _loss(algo, lp, blp, adv, mask)
        ref = ref_behaviour_loss(lp, blp, adv, mask, lambda r: 1.0)
        torch.testing.assert_close(got, ref)
    finally:
        registry._REGISTRY.pop("reinforce", None)


@pytest.mark.parametrize("granularity", ["action_token", "node_last_token", "node_mean"])
@pytest.mark.parametrize("bootstrap", [True, False])
def test_sao_value_targets_need_no_values(granularity, bootstrap):
    """lam_value = 1: base + coef * V_last equals the float64 loop's returns A(1) + V for any V;
    the values are never read; coef is 0 on rows that do not bootstrap."""
    bt = random_batch(11)
    sao = SAOConfig(
        advantage_granularity=granularity, gamma=0.9, lam_policy=0.8, bootstrap_truncated=bootstrap
    )
    inputs = _inputs(bt, values=False)
    tg = build(sao=sao).value_targets(inputs)
    assert inputs.values is None  # not read, not filled in
    if granularity == "action_token":
        _, ref_ret = ref_token_gae(bt, 0.9, 0.8, 1.0, bootstrap)
        vmask = bt.action_mask
    else:
        mode = "last_token" if granularity == "node_last_token" else "mean"
        _, ref_ret, vmask = ref_node_gae(bt, 0.9, 0.8, 1.0, bootstrap, mode)
    assert torch.equal(tg.value_mask, vmask)
    got = tg.base + tg.bootstrap_coef * bt.bootstrap_values[:, None]
    torch.testing.assert_close(got[vmask], ref_ret[vmask].to(torch.float64), rtol=1e-12, atol=1e-12)
    bootstraps = bt.truncated & bootstrap
    assert not tg.bootstrap_coef[~bootstraps].any()
    assert bool(tg.bootstrap_coef[bootstraps][vmask[bootstraps]].gt(0).all())


def test_value_targets_need_values_below_lam_value_one():
    bt = random_batch(11)
    assert build(sao=SAOConfig(lam_value=0.95)).value_targets(_inputs(bt)) is None
    assert build(name="grpo").value_targets(_inputs(bt)) is None
