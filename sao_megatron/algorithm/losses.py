"""Loss terms: DIS / importance-weighted policy gradient, PPO-clip with dual clip, clipped value
loss, entropy bonus, KL penalty (k1/k2/k3, importance-weighted k3), and their aggregation.

Every loss takes per-token tensors [B, T] and the action mask [B, T] bool and returns a scalar,
aggregated by `aggregate` so that micro-batches can be summed: with ``token_mean`` the caller
passes ``num_tokens`` = the number of action tokens in the *global* batch (all micro-batches and
data-parallel ranks); with the seq-mean modes ``num_sequences`` = the global number of rows that
have at least one action token. Summing the micro-batch losses (and their gradients) then gives
exactly the full-batch loss. Masked-out tokens never contribute NaN: they are selected away with
torch.where before any sum.
"""

from __future__ import annotations

import torch

from .importance import _MAX_LOG_RATIO, dis_band_weights


def _zero_off(mask: torch.Tensor, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Replace off-mask entries by 0 so padding garbage (NaN/inf) cannot reach values or grads."""
    m = mask.to(torch.bool)
    return [torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device)) for x in xs]


def aggregate(
    per_token: torch.Tensor,
    action_mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    token_mean: sum_bt m x / N, N = num_tokens (default: action tokens in this tensor).
    seq_mean_token_mean: sum_b (sum_t m x / n_b) / S, n_b = action tokens of row b.
    seq_mean_token_sum: sum_b (sum_t m x) / S. S = num_sequences (default: rows with n_b > 0).
    Rows with n_b = 0 contribute 0. Denominators are clamped to >= 1, so an empty batch gives 0.
    Sources: token-mean (DAPO, Yu et al. 2025, arXiv 2503.14476, eq. 8); seq-mean-token-sum with a
    constant denominator (Dr.GRPO, Liu et al. 2025, arXiv 2503.20783).
    Raises ValueError for an unknown mode.
    """
    mask = action_mask.to(torch.bool)
    x = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=mask.device))
    n_b = mask.sum(dim=1)
    if mode == "token_mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return x.sum() / torch.as_tensor(denom, dtype=x.dtype, device=x.device).clamp(min=1)
    if mode in ("seq_mean_token_mean", "seq_mean_token_sum"):
        rows = x.sum(dim=1)
        if mode == "seq_mean_token_mean":
            rows = rows / n_b.clamp(min=1).to(x.dtype)
        denom = (n_b > 0).sum() if num_sequences is None else num_sequences
        return rows.sum() / torch.as_tensor(denom, dtype=x.dtype, device=x.device).clamp(min=1)
    raise ValueError(
        f"loss aggregation {mode!r}: use token_mean, seq_mean_token_mean or seq_mean_token_sum"
    )


def policy_gradient_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    action_mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Importance-weighted REINFORCE: L = aggregate(-sg(w_t) * A_t * l_theta_t).

    logprobs [B, T] (with grad), advantages [B, T] (treated as constants), weights [B, T]
    (detached here). With token_mean the gradient w.r.t. l_theta_t is -m_t w_t A_t / N.
    """
    logprobs, coef = _zero_off(action_mask, logprobs, weights.detach() * advantages.detach())
    per_token = -coef * logprobs
    return aggregate(
        per_token, action_mask, mode, num_tokens=num_tokens, num_sequences=num_sequences
    )


def dis_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    mode: str = "token_mean",
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """SAO direct importance sampling loss: L = -sum_t m_t sg(f(r_t)) A_t l_theta_t / N.

    r_t = exp(l_theta_t - l_b_t) with l_theta the trainer's current log-prob (no recomputed old
    log-probs); f(r) = r inside (1 - eps_low, 1 + eps_high), 0 outside (dropped tokens stay in N).
    Source: SAO (arXiv 2607.07508), DIS objective; docs/ARCHITECTURE.md.
    Shapes: logprobs, behaviour_logprobs, advantages [B, T] float; action_mask [B, T] bool.
    """
    w = dis_band_weights(logprobs, behaviour_logprobs, action_mask, eps_low, eps_high).weights
    return policy_gradient_loss(
        logprobs,
        advantages,
        w,
        action_mask,
        mode,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
    )


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    mode: str = "token_mean",
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO clipped surrogate with optional dual clip and behaviour weights.

    rho = exp(l_theta - l_old) (log-ratio clamped to +-20); per token
    l = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)); with dual clip c > 1, tokens with
    A < 0 use min(l, -c A); then l *= sg(w) (TIS / masked IS / decoupled-PPO weight, default 1).
    Sources: Schulman et al. 2017, PPO (arXiv 1707.06347) eq. 7; dual clip: Ye et al. 2020
    (arXiv 1912.09729) eq. 5; asymmetric clip-higher: DAPO (arXiv 2503.14476).
    Shapes: all [B, T]; old_logprobs and advantages are treated as constants.
    """
    logprobs, old, adv = _zero_off(
        action_mask, logprobs, old_logprobs.detach(), advantages.detach()
    )
    rho = torch.exp((logprobs - old).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    per_token = torch.maximum(-adv * rho, -adv * rho.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -dual_clip * adv), per_token)
    if weights is not None:
        per_token = per_token * _zero_off(action_mask, weights.detach())[0]
    return aggregate(
        per_token, action_mask, mode, num_tokens=num_tokens, num_sequences=num_sequences
    )


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    value_mask: torch.Tensor,
    *,
    clip: float | None = 0.2,
    mode: str = "token_mean",
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Clipped (pessimistic) value loss 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-eps) - R)^2).

    With clip=None: 0.5 (V - R)^2. value_mask [B, T] bool selects the positions (action tokens or
    node positions, from AdvantageOutput.value_mask); num_tokens counts that mask globally.
    Source: PPO2 value clipping (OpenAI baselines, Dhariwal et al. 2017); docs/ARCHITECTURE.md.
    """
    values, old, ret = _zero_off(value_mask, values, old_values.detach(), returns.detach())
    unclipped = (values - ret) ** 2
    if clip is None:
        per_token = 0.5 * unclipped
    else:
        clipped = old + (values - old).clamp(-clip, clip)
        per_token = 0.5 * torch.maximum(unclipped, (clipped - ret) ** 2)
    return aggregate(
        per_token, value_mask, mode, num_tokens=num_tokens, num_sequences=num_sequences
    )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy H = logsumexp(z) - sum softmax(z) z over the last dim. [..., V] -> [...].

    Half-precision logits are upcast to float32 first.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def entropy_loss(
    entropy: torch.Tensor,
    action_mask: torch.Tensor,
    coef: float,
    mode: str = "token_mean",
    *,
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Entropy bonus as a loss term: -coef * aggregate(H_t). entropy [B, T] float (with grad)."""
    (entropy,) = _zero_off(action_mask, entropy)
    return -coef * aggregate(
        entropy, action_mask, mode, num_tokens=num_tokens, num_sequences=num_sequences
    )


def kl_per_token(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    behaviour_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by the behaviour policy.

    With x = l_ref - l_theta (clamped to +-20): k1 = -x, k2 = x^2 / 2, k3 = exp(x) - 1 - x;
    k3_is = exp(l_theta - l_b) * k3, where the ratio keeps its gradient, so the loss is an
    unbiased estimate of KL(pi_theta || pi_ref) with an unbiased gradient when tokens come from
    pi_b != pi_theta. Sources: Schulman 2020, "Approximating KL Divergence" (k1, k2, k3);
    DeepSeek-AI 2025, DeepSeek-V3.2 report ("unbiased KL estimate", k3_is).
    Shapes: [B, T] -> [B, T]. Raises ValueError for an unknown estimator or missing behaviour.
    """
    x = (ref_logprobs.detach() - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x**2
    k3 = torch.expm1(x) - x
    if estimator == "k3":
        return k3
    if estimator == "k3_is":
        if behaviour_logprobs is None:
            raise ValueError("KL estimator k3_is needs behaviour_logprobs (the sampling policy)")
        lr = (logprobs - behaviour_logprobs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(lr) * k3
    raise ValueError(f"KL estimator {estimator!r}: use k1, k2, k3 or k3_is")


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    coef: float,
    estimator: str = "k3",
    behaviour_logprobs: torch.Tensor | None = None,
    mode: str = "token_mean",
    *,
    num_tokens: int | torch.Tensor | None = None,
    num_sequences: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """KL penalty term: coef * aggregate(kl_per_token(...)) over the action tokens.

    Shapes [B, T]; off-mask entries are zeroed first. See `kl_per_token` for the estimators.
    """
    lp, ref = _zero_off(action_mask, logprobs, ref_logprobs)
    blp = None if behaviour_logprobs is None else _zero_off(action_mask, behaviour_logprobs)[0]
    per_token = kl_per_token(lp, ref, estimator, blp)
    return coef * aggregate(
        per_token, action_mask, mode, num_tokens=num_tokens, num_sequences=num_sequences
    )
