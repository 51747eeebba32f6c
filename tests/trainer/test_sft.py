"""SFT warm-up step on real Megatron (1 rank): loss equals the float64 reference and falls."""

import torch

from sao_megatron.data.trajectory import TokenSequence
from sao_megatron.models import ModelInputs, build_policy, compute_policy_logprobs
from sao_megatron.optim.builder import build_optimizer
from sao_megatron.optim.config import OptimizerConfig, PrecisionConfig
from sao_megatron.trainer.sft import SequenceSampler, sft_step


def _seq(ids, mask):
    n = len(ids)
    return TokenSequence(
        token_ids=torch.tensor(ids),
        action_mask=torch.tensor(mask, dtype=torch.bool),
        node_index=torch.zeros(n, dtype=torch.long),
        behaviour_logprobs=torch.zeros(n),
        policy_versions=torch.full((n,), -1),
    )


def test_sft_loss_matches_reference_and_decreases(tiny_moe, parallel_1rank):
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (5, 9, 7):
        ids = torch.randint(1, 128, (n,), generator=g).tolist()
        mask = [0, 0] + [1] * (n - 2)
        seqs.append(_seq(ids, mask))
    prec = PrecisionConfig()
    chunks = build_policy(tiny_moe, parallel_1rank, prec)
    state = build_optimizer(chunks, parallel_1rank, OptimizerConfig(lr=3e-3), prec)
    # float64 reference of the first loss from the model's own log-probs
    ref_num, ref_den = 0.0, 0
    for s in seqs:
        lp, _ = compute_policy_logprobs(
            state.model,
            parallel_1rank,
            ModelInputs(input_ids=s.token_ids[None], attention_mask=torch.ones(1, len(s))),
        )
        m = s.action_mask[1:]
        ref_num += float(lp[0][m].double().sum())
        ref_den += int(m.sum())
    losses = []
    for _ in range(8):
        m = sft_step(state, parallel_1rank, seqs, pad_token_id=0, micro_batch_size=2)
        losses.append(m["sft/loss"])
    assert abs(losses[0] - (-ref_num / ref_den)) < 1e-5
    assert m["sft/num_action_tokens"] == ref_den
    assert losses[-1] < 0.7 * losses[0]  # 8 steps memorise part of 3 random sequences


def test_sampler_is_seeded_and_resumable():
    a = SequenceSampler(10, seed=3)
    first = a.next(7) + a.next(7)  # crosses an epoch
    assert sorted(first[:10]) == list(range(10))
    b = SequenceSampler(10, seed=3)
    b.next(7)
    c = SequenceSampler(10, seed=3, **{k: v for k, v in b.state_dict().items() if k != "seed"})
    assert c.next(7) == first[7:]
