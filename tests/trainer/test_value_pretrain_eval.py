"""Value pre-training's held-out evaluation: `explained_variance` over the global batch (a
`BatchReducer` over ranks equals the concatenated batch, float64 reference), and
`RLStep.value_eval` on real Megatron: the float64 reference at 1 rank, no update of the critic,
and the same figures at DP=2 and PP=2 as at 1 rank (where this DP rank's own share,
`value_fit`, differs)."""

from __future__ import annotations

import math

import pytest
import torch

from sao_megatron.algorithm.advantages import LOCAL_BATCH
from sao_megatron.algorithm.metrics import explained_variance
from sao_megatron.models import ModelInputs, compute_values
from tests.algorithm.test_whiten_reducer import ThreadGroup
from tests.conftest import launch, tiny_moe_kwargs
from tests.trainer.test_value_fit import _critic, _episodes, _pack

# ------------------------------------------------------------------ explained_variance


def _ref_ev(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """Plain-loop float64 1 - Var[R - V] / Var[R] (population variances, math.fsum)."""
    v = [float(x) for x in values[mask].double().tolist()]
    r = [float(x) for x in returns[mask].double().tolist()]
    if not r:
        return math.nan
    d = [a - b for a, b in zip(r, v, strict=True)]
    mean_r, mean_d = math.fsum(r) / len(r), math.fsum(d) / len(d)
    var_r = math.fsum((x - mean_r) ** 2 for x in r) / len(r)
    var_d = math.fsum((x - mean_d) ** 2 for x in d) / len(d)
    return math.nan if var_r == 0 else 1.0 - var_d / var_r


def _batch(seed: int, rows: int = 12, cols: int = 9):
    g = torch.Generator().manual_seed(seed)
    returns = 3.0 + torch.randn(rows, cols, generator=g)  # |mean| > std
    values = returns + 0.7 * torch.randn(rows, cols, generator=g) - 0.2
    mask = torch.rand(rows, cols, generator=g) < 0.6
    return values.float(), returns.float(), mask


@pytest.mark.parametrize("cuts", [[12], [5, 12], [3, 4, 12], [0, 7, 12]])
def test_explained_variance_of_shares_is_that_of_the_whole_batch(cuts):
    """Rows dealt to len(cuts) ranks (the first share empty in the last case): every rank gets
    the whole batch's EV (float64 loop reference)."""
    values, returns, mask = _batch(0)
    ref = _ref_ev(values, returns, mask)
    assert 0.2 < ref < 0.9
    assert math.isclose(explained_variance(values, returns, mask), ref, rel_tol=1e-12)
    bounds = [0, *cuts]
    shares = [
        (values[a:b], returns[a:b], mask[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    group = ThreadGroup(len(shares))
    got = group.run(lambda share, reducer: explained_variance(*share, reducer=reducer), shares)
    assert all(math.isclose(g, ref, rel_tol=1e-12) for g in got), (got, ref)
    assert group.calls == [2] * len(shares)  # two reductions on every rank
    if len(shares) > 1:  # a share's own figure is not the batch's
        own = [explained_variance(*s) for s in shares if s[2].any()]
        assert max(abs(o - ref) for o in own) > 1e-3


def test_explained_variance_undefined_cases_agree_across_ranks():
    values, returns, mask = _batch(1, rows=4)
    empty = torch.zeros_like(mask)
    group = ThreadGroup(2)
    shares = [(values[:2], returns[:2], empty[:2]), (values[2:], returns[2:], empty[2:])]
    got = group.run(lambda s, red: explained_variance(*s, reducer=red), shares)
    assert all(math.isnan(g) for g in got) and group.calls == [1, 1]  # no second reduction
    const = torch.full_like(returns, 2.0)
    shares = [(values[:2], const[:2], mask[:2]), (values[2:], const[2:], mask[2:])]
    assert all(
        math.isnan(g)
        for g in ThreadGroup(2).run(lambda s, red: explained_variance(*s, reducer=red), shares)
    )
    assert math.isnan(explained_variance(values, const, mask, reducer=LOCAL_BATCH))


# ------------------------------------------------------------------ value_eval, 1 rank


def _reference_fit(value_chunks, parallel, trajs) -> tuple[float, float, int]:
    """float64 (EV, MSE, tokens) over the action tokens: V read at the state before each action
    token (an independent forward), R the reward-to-go of its node (gamma = lam = 1) plus the
    bootstrap V of the state after the last action token for a truncated episode."""
    batch = _pack(trajs)
    raw = compute_values(
        value_chunks, parallel, ModelInputs(batch.token_ids, batch.loss_mask, batch.position_ids)
    ).double()
    vs, rs = [], []
    for r, traj in enumerate(trajs):
        pos, positions, node_of = 0, [], []
        for n, node in enumerate(traj.nodes):
            pos += len(node.observation_token_ids)
            for _ in node.action_token_ids:
                positions.append(pos)
                node_of.append(n)
                pos += 1
        boot = float(raw[r, positions[-1]]) if traj.truncated else 0.0
        for p, n in zip(positions, node_of, strict=True):
            vs.append(float(raw[r, p - 1]))
            rs.append(math.fsum(x.reward for x in traj.nodes[n:]) + boot)
    v, r = torch.tensor(vs, dtype=torch.float64), torch.tensor(rs, dtype=torch.float64)
    mask = torch.ones(len(vs), dtype=torch.bool)
    mse = math.fsum(((v - r) ** 2).tolist()) / len(vs)
    return _ref_ev(v, r, mask), mse, len(vs)


def test_value_eval_is_the_float64_reference_and_updates_nothing(tiny_moe, parallel_1rank):
    step, value = _critic(tiny_moe, parallel_1rank)
    trajs = _episodes(12, seed=4, truncate_every=3)
    ref_ev, ref_mse, n = _reference_fit(value, parallel_1rank, trajs)
    params = {k: p.detach().clone() for k, p in value[0].named_parameters()}
    got = step.value_eval(_pack(trajs))
    assert math.isclose(got["value/explained_variance"], ref_ev, rel_tol=1e-5, abs_tol=1e-6)
    assert math.isclose(got["value/mse"], ref_mse, rel_tol=1e-5)
    assert got["value/num_tokens"] == n
    # at 1 rank this rank's share is the whole batch: value_fit agrees
    fit = step.value_fit(_pack(trajs))
    assert math.isclose(
        fit["value/explained_variance"], got["value/explained_variance"], rel_tol=1e-9
    )
    assert math.isclose(fit["value/mse"], got["value/mse"], rel_tol=1e-9)
    for k, p in value[0].named_parameters():
        assert torch.equal(p.detach(), params[k]), k
        assert p.grad is None


# ------------------------------------------------------------------ value_eval across layouts

LAYOUTS = {"dp2": {}, "pp2": {"pp": 2}}


def run_eval(pkw: dict) -> dict:
    """In the world of this process (1 rank, or 2 ranks in layout `pkw`): the held-out figures
    of the golden SAO critic before and after one value pre-training step, and this rank's own
    share's (`value_fit`)."""
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from tests.golden import golden_worker

    parallel = initialize_parallel(ParallelConfig(**pkw))
    try:
        p_state, v_state = golden_worker._build(parallel, "sao")
        step = golden_worker._step_fn("sao", parallel, p_state, v_state)
        vocab = tiny_moe_kwargs()["vocab_size"]
        train = golden_worker._pack(golden_worker._trajectories(0, 8, 1, vocab))
        held = golden_worker._pack(golden_worker._trajectories(7, 9, 1, vocab))  # 5 + 4 at DP=2
        before = step.value_eval(held)
        step.value_step(train)
        return {"before": before, "after": step.value_eval(held), "fit": step.value_fit(held)}
    finally:
        destroy_parallel()


def layouts_worker(rank: int, world_size: int, out_dir: str) -> None:
    """2-rank entry (tests.conftest.launch): `run_eval` in every layout of `LAYOUTS`."""
    torch.save({name: run_eval(pkw) for name, pkw in LAYOUTS.items()}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.distributed
def test_value_eval_is_the_global_figure_in_every_layout(tmp_path):
    from megatron.core import parallel_state as ps

    from sao_megatron.parallel import destroy_parallel

    launch(layouts_worker, 2, str(tmp_path))
    if ps.model_parallel_is_initialized():
        destroy_parallel()
    ref = run_eval({})  # this process: a 1-rank world
    assert ref["after"]["value/explained_variance"] != ref["before"]["value/explained_variance"]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in LAYOUTS:
        for rank, res in enumerate(ranks):
            for when in ("before", "after"):
                got, want = res[name][when], ref[when]
                assert got.keys() == want.keys()
                for k in want:
                    assert math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-5), (
                        name,
                        rank,
                        when,
                        k,
                        got[k],
                        want[k],
                    )
    # at DP=2 each rank's own share gives another figure: the reduction is what makes it global
    own = [res["dp2"]["fit"]["value/explained_variance"] for res in ranks]
    want = ref["after"]["value/explained_variance"]
    assert max(abs(o - want) for o in own) > 1e-3, (own, want)
