"""`algorithm.whiten_advantages` whitens over the global batch: one SAO / GRPO step on 2 gloo
data-parallel ranks gives the advantages and the trained weights of the same step on 1 rank.

Each DP rank holds a share of the trajectories (`shard_for_data_parallel`); whitening its own
share alone gave advantages up to ~0.4 and weights ~1e-2 away from the 1-rank step (issues 31,
32). The runs without whitening are the control: they show the layouts agree to float rounding
when no batch statistic is involved, so the tolerance below is a real one.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import launch, tiny_moe_kwargs
from tests.golden import golden_worker
from tests.train_states import build_train_states

#: (algorithm, whiten_advantages) of every run
RUNS = [("sao", True), ("grpo", True), ("sao", False), ("grpo", False)]
ADV_TOL = 1e-5  # float32 advantages of order 1
WEIGHT_TOL = 1e-6  # one Adam step of lr 1e-3 (eps 1e-3: |step| <= lr)


def _build(parallel, algorithm: str):
    """fp32 policy (and, for SAO, value) train states, constant LR (the first step moves the
    weights). Adam's eps is 1e-3, as in tests/parallel/layout_worker.py: the first step,
    lr * g / (|g| + eps), is then smooth in g; with eps = 1e-8 it is lr * sign(g) and a
    gradient entry near 0 flips by 2 lr on float32 rounding of the DP all-reduce."""
    return build_train_states(parallel, with_value=algorithm == "sao", adam_eps=1e-3)


def _params(train_state) -> dict[str, torch.Tensor]:
    if train_state is None:
        return {}
    return {n: p.detach().clone() for c in train_state.unwrapped for n, p in c.named_parameters()}


def run_step(algorithm: str, whiten: bool) -> dict:
    """One train step in the world this process is in (1 rank, or 2 DP ranks): this rank's
    rows of the batch, their advantages [rows, T] and the weights after the update."""
    from sao_megatron.algorithm import registry
    from sao_megatron.algorithm.base import Phase
    from sao_megatron.algorithm.config import AlgorithmConfig, GRPOConfig
    from sao_megatron.data.micro_batches import shard_for_data_parallel
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from sao_megatron.trainer.rl_step import RLStep, StepConfig

    parallel = initialize_parallel(ParallelConfig())
    try:
        p_state, v_state = _build(parallel, algorithm)
        grpo = algorithm == "grpo"
        cfg = AlgorithmConfig(
            name=algorithm,
            whiten_advantages=whiten,
            **({"grpo": GRPOConfig(group_size=4)} if grpo else {}),
        )
        algo = registry.build(cfg)
        step = RLStep(algo, parallel, p_state, v_state, StepConfig(micro_batch_size=3))
        vocab = tiny_moe_kwargs()["vocab_size"]
        trajs = golden_worker._trajectories(5, 4 if grpo else 8, 4 if grpo else 1, vocab)
        batch = golden_worker._set_behaviour(p_state.model, parallel, trajs, 5)
        state = step.start(batch, train_version=0)
        for phase in algo.schedule:
            step.run(phase, state)
            if phase is Phase.ADVANTAGES:
                advantages = state.advantages[: state.num_real_rows].clone()
        metrics = step.finish(state)
        rows, _ = shard_for_data_parallel(
            batch, parallel.dp_rank, parallel.dp, by_group=algo.keeps_groups_together
        )
        return {
            "num_rows": batch.num_rows,
            "action_mask": batch.action_mask[:, 1:],  # prediction positions, as advantages
            "rows": rows,
            "advantages": advantages,
            "policy": _params(p_state),
            "value": _params(v_state),
            "loss": metrics["loss/policy"],
        }
    finally:
        destroy_parallel()


def dp2_worker(rank: int, world_size: int, out_dir: str) -> None:
    """2-rank entry (tests.conftest.launch): every run of `RUNS` at DP=2."""
    results = {f"{a}/{w}": run_step(a, w) for a, w in RUNS}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def dp2_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whiten_dp")
    launch(dp2_worker, 2, str(tmp))
    return [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)


@pytest.mark.distributed
@pytest.mark.parametrize(("algorithm", "whiten"), RUNS)
def test_step_on_two_dp_ranks_equals_one_rank(dp2_results, algorithm, whiten):
    from megatron.core import parallel_state as ps

    from sao_megatron.parallel import destroy_parallel

    if ps.model_parallel_is_initialized():
        destroy_parallel()
    ref = run_step(algorithm, whiten)  # this process: a 1-rank world
    key = f"{algorithm}/{whiten}"
    shards = [res[key] for res in dp2_results]
    # the two ranks hold disjoint shares of every trajectory row of the batch
    rows = torch.cat([s["rows"] for s in shards])
    assert sorted(rows.tolist()) == list(range(ref["num_rows"]))
    got = torch.zeros_like(ref["advantages"])
    for s in shards:
        got[s["rows"]] = s["advantages"]
    mask = ref["action_mask"]
    if whiten:  # the 1-rank advantages are whitened over the whole batch
        a = ref["advantages"][mask].double()
        assert abs(float(a.mean())) < 1e-6 and abs(float(a.std(unbiased=False)) - 1) < 1e-4
    diffs = {"advantages": float((got - ref["advantages"]).abs().max())}
    for rank, s in enumerate(shards):
        for kind in ("policy", "value"):
            diffs[f"{kind} weights, rank {rank}"] = _max_diff(s[kind], ref[kind])
    tol = {k: ADV_TOL if k == "advantages" else WEIGHT_TOL for k in diffs}
    assert all(d < tol[k] for k, d in diffs.items()), f"{key}: 2 DP ranks vs 1 rank: {diffs}"
    for s in shards:
        assert s["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
