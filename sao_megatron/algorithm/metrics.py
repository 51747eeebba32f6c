"""Off-policy deviation and value-model metrics, logged every train step (no gradients).

All statistics are over the action tokens of the batch given (pass the global batch, or
all-reduce the sums yourself). With r_t = exp(l_theta_t - l_b_t) and tokens sampled by pi_b:

* ``mean_abs_one_minus_ratio``  mean |1 - r|               (SAO's target: < 0.05)
* ``mean_abs_logprob_diff``     mean |l_theta - l_b|
* ``mismatch_kl``               mean (l_b - l_theta)       k1 estimate of KL(pi_b || pi_theta)
* ``k3``                        mean (r - 1 - log r)       k3 estimate of KL(pi_b || pi_theta)
* ``chi_square``                mean (r - 1)^2             estimate of chi^2(pi_theta || pi_b)
* ``ess``                       (sum r)^2 / (n sum r^2)    normalised effective sample size
* ``fraction_dropped``          share of action tokens outside the DIS band
* ``fraction_dropped_against_advantage``  (with advantages A) share of action tokens outside
  the band on the side their advantage pushes away from: A > 0 and r <= 1 - eps_low (a good
  token the policy has since made rarer), A < 0 and r >= 1 + eps_high (a bad token made more
  likely). DIS gives these no gradient; PPO's clipped objective keeps it and pulls them back.
* ``version_lag_mean/max``      train_version - policy_version over action tokens

Sources: Schulman 2020, "Approximating KL Divergence" (k1, k3); Kong 1992 / Owen 2013, "Monte
Carlo theory, methods and examples" ch. 9 (ESS); SAO (arXiv 2607.07508) for the band.
A metric with no action token to average over is NaN (nothing to report, never a fake 0).
"""

from __future__ import annotations

import torch

from .advantages import LOCAL_BATCH, BatchReducer
from .importance import log_ratio


def off_policy_metrics(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    policy_versions: torch.Tensor | None = None,
    train_version: int | None = None,
    advantages: torch.Tensor | None = None,
) -> dict[str, float]:
    """Deviation between trainer and behaviour policy on the batch's action tokens.

    Args:
        logprobs: [B, T] float, trainer log-probs l_theta (nats). behaviour_logprobs: [B, T].
        action_mask: [B, T] bool.
        eps_low, eps_high: the DIS band used for ``fraction_dropped``.
        policy_versions: [B, T] int64 version that sampled each token (read on action tokens);
            with train_version (the trainer's current version) adds version_lag_mean/max.
        advantages: [B, T] float A_t (read on action tokens); adds
            fraction_dropped_against_advantage.
    Returns: dict name -> float (see module docstring), computed in float64.
    """
    mask = action_mask.to(torch.bool)
    n = int(mask.sum())
    lr = log_ratio(logprobs, behaviour_logprobs, mask).to(torch.float64)[mask]
    r = torch.exp(lr)
    out: dict[str, float] = {"num_action_tokens": float(n)}
    if n == 0:
        nan = float("nan")
        out.update(
            mean_abs_one_minus_ratio=nan,
            mean_abs_logprob_diff=nan,
            mismatch_kl=nan,
            k3=nan,
            chi_square=nan,
            ess=nan,
            fraction_dropped=nan,
        )
        if advantages is not None:
            out["fraction_dropped_against_advantage"] = nan
    else:
        out["mean_abs_one_minus_ratio"] = float((1.0 - r).abs().mean())
        out["mean_abs_logprob_diff"] = float(lr.abs().mean())
        out["mismatch_kl"] = float((-lr).mean())
        out["k3"] = float((torch.expm1(lr) - lr).mean())
        out["chi_square"] = float((r - 1.0).pow(2).mean())
        out["ess"] = float(r.sum() ** 2 / (n * r.pow(2).sum()))
        kept = (r > 1.0 - eps_low) & (r < 1.0 + eps_high)
        out["fraction_dropped"] = float(1.0 - kept.double().mean())
        if advantages is not None:
            adv = advantages[mask]
            against = ((adv > 0) & (r <= 1.0 - eps_low)) | ((adv < 0) & (r >= 1.0 + eps_high))
            out["fraction_dropped_against_advantage"] = float(against.double().mean())
    if policy_versions is not None:
        if train_version is None:
            raise ValueError("policy_versions given without train_version (the trainer's version)")
        lag = (train_version - policy_versions[mask]).to(torch.float64)
        out["version_lag_mean"] = float(lag.mean()) if n else float("nan")
        out["version_lag_max"] = float(lag.max()) if n else float("nan")
    return out


def explained_variance(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    reducer: BatchReducer = LOCAL_BATCH,
) -> float:
    """1 - Var[R - V] / Var[R] over masked positions (population variances), as a float.

    1 is a perfect value model, 0 no better than a constant, < 0 worse. NaN when Var[R] = 0 or
    the mask is empty (undefined). values, returns: [B, T] float; mask: [B, T] bool (the
    value_mask of AdvantageOutput). Source: OpenAI baselines `explained_variance`.

    The batch is the union of every rank's tensors under `reducer` (`BatchReducer`; the default
    `LOCAL_BATCH`: these tensors alone), so a DP rank passing its share with the trainer's
    reducer gets the figure of the global batch. Two passes in float64, two reductions (as
    `masked_whiten`): n and the sums of R and of D = R - V give the means, then the sums of
    squared deviations from them; the ratio of those sums is Var[D] / Var[R] (the 1/n cancel).
    A collective with a non-local `reducer`: every rank calls it.
    """
    m = mask.to(torch.bool)
    y = torch.where(m, returns.detach().to(torch.float64), 0.0)
    d = torch.where(m, y - values.detach().to(torch.float64), 0.0)
    n, sum_y, sum_d = reducer.sum(torch.stack([m.sum().to(torch.float64), y.sum(), d.sum()]))
    if float(n) == 0:  # the same on every rank: no rank skips the second reduction alone
        return float("nan")
    sq_y = torch.where(m, (y - sum_y / n) ** 2, 0.0).sum()
    sq_d = torch.where(m, (d - sum_d / n) ** 2, 0.0).sum()
    sq_y, sq_d = reducer.sum(torch.stack([sq_y, sq_d]))
    if float(sq_y) == 0.0:
        return float("nan")
    return float(1.0 - sq_d / sq_y)
