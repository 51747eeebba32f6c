"""A train step's batch and deviation bookkeeping: what `RLStep` logs besides losses and norms.

The deviation figures compare the trainer's log-probs l_theta of the policy update's forward
with the behaviour log-probs l_b the engine sampled with, on the tokens the policy loss trained
on (action tokens within the staleness bound): `off_policy_metrics` (mean |1 - r|, r =
exp(l_theta - l_b), mismatch KL, k3, ESS, fraction outside the DIS band, version lag) and their
split by cause (`deviation_causes`: version lag, routing differences), summed over DP ranks.
The batch figures include, per episode-length bucket, the share of action tokens within the
staleness bound (``rollout/staleness/*``, `sao_megatron.rollout.staleness.in_bound_by_length`).
"""

from __future__ import annotations

import torch

from sao_megatron.algorithm.config import ImportanceConfig
from sao_megatron.algorithm.deviation_causes import deviation_cause_sums, finish_deviation_causes
from sao_megatron.algorithm.metrics import off_policy_metrics
from sao_megatron.rollout.staleness import in_bound_by_length, in_bound_by_length_sums
from sao_megatron.trainer.step_context import StepContext
from sao_megatron.trainer.step_state import StepState

#: off_policy_metrics() names -> logged names (sao_megatron.trainer.metrics.STANDARD_METRICS)
DEVIATION_NAMES = {
    "mean_abs_one_minus_ratio": "deviation/abs_one_minus_ratio_mean",
    "fraction_dropped": "deviation/dropped_fraction",
    "fraction_dropped_against_advantage": "deviation/dropped_against_advantage_fraction",
}


def batch_metrics(state: StepState, ctx: StepContext) -> dict[str, float]:
    """The global batch's action tokens and rows with action tokens, the fraction of its
    action tokens beyond the staleness bound (`StepState.stale`), and per episode-length
    bucket the fraction within it and the number of episodes (``rollout/staleness/*``)."""
    rows, n_tokens = state.batch.rows, state.num_tokens
    action, num_nodes = rows.action_mask, state.batch.trajectories.num_nodes
    sums = in_bound_by_length_sums(state.stale, action, rows.row_trajectory, num_nodes)
    sums = ctx.dp_sum_dict({"stale": int((state.stale & action).sum())} | sums)  # one all-reduce
    return {
        "batch/num_action_tokens": n_tokens,
        "batch/num_rows": state.num_sequences,
        "deviation/stale_token_fraction": sums.pop("stale") / max(n_tokens, 1.0),
    } | in_bound_by_length(sums)


def policy_metrics(
    state: StepState, importance: ImportanceConfig, ctx: StepContext
) -> dict[str, float]:
    """After POLICY_UPDATE: the deviation between trainer and behaviour policy (``deviation/*``,
    DIS band from `importance`), and the policy's mean entropy and advantage over this rank's
    trained tokens (``policy/entropy``, ``policy/advantage_mean``)."""
    rows = state.batch.rows  # prediction positions, as the step's tensors
    mask = rows.action_mask & ~state.stale  # the tokens the policy loss trained on
    behaviour, versions = rows.behaviour_logprobs, rows.policy_versions
    dev = off_policy_metrics(
        state.logprobs,
        behaviour,
        mask,
        eps_low=importance.eps_low,
        eps_high=importance.eps_high,
        policy_versions=versions,
        train_version=state.train_version,
        advantages=state.advantages,
    )
    out = {DEVIATION_NAMES.get(k, f"deviation/{k}"): v for k, v in dev.items()}
    sums = deviation_cause_sums(
        state.logprobs,
        behaviour,
        mask,
        state.train_version - versions,
        state.routing_differs,
    )
    causes = finish_deviation_causes(ctx.dp_sum_dict(sums))
    out |= {f"deviation/{k}": v for k, v in causes.items()}
    n_local = max(int(mask.sum()), 1)
    out["policy/entropy"] = float(torch.where(mask, state.entropy, 0.0).sum() / n_local)
    out["policy/advantage_mean"] = float(torch.where(mask, state.advantages, 0.0).sum() / n_local)
    return out
