"""Worker of the 2-rank routing-replay test (tests/routing/test_replay_multirank.py).

Every rank builds the 1-rank model (same seed) for the float64 reference case, then each layout
in turn (CPU init is layout-independent: the same weights, sliced), and records per layout the
max error of replayed and plain log-probs against the reference and the global mismatch counts.
"""

from __future__ import annotations

import os

import torch

from tests.conftest import tiny_moe_kwargs

LAYOUTS = {  # name: ParallelConfig kwargs
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "ep2": {"ep": 2},
    "pp2": {"pp": 2},
    "dp2": {},
}


def _run(cfg, pkw, case):
    import torch.distributed as dist

    from sao_megatron.models import ModelInputs, build_policy, compute_policy_logprobs
    from sao_megatron.models.routing_replay import RoutingReplay
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from tests.routing.replay_case import B

    st = initialize_parallel(ParallelConfig(**pkw))
    try:
        chunks = build_policy(cfg, st)
        rows = B // st.dp
        lo, hi = st.dp_rank * rows, (st.dp_rank + 1) * rows
        ids, rec, mask = case["ids"][lo:hi], case["recorded"][lo:hi], case["mask"][lo:hi]
        inputs = ModelInputs(ids, torch.ones_like(ids))
        rr = RoutingReplay.for_parallel(chunks, st)
        out = {}
        for replay in (True, False):
            with rr.session(ids, rec, mask, micro_batch_size=1, replay=replay):
                lp, _ = compute_policy_logprobs(chunks, st, inputs, micro_batch_size=1)
            counts = torch.tensor(rr.take_counts(), dtype=torch.float64)
            dist.all_reduce(counts)
            key = "replay" if replay else "plain"
            differs = rr.last_differs.to(torch.int32)
            for group in (st.pg_collection.tp, st.pg_collection.pp):
                dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
            out[f"{key}_differs_ok"] = bool(torch.equal(differs.bool(), case["differs_any"][lo:hi]))
            out[key] = float((lp.double() - case["ref_lp"][lo:hi]).abs().max())
            out[f"{key}_counts"] = counts.tolist()
        out["local_layers"] = rr.num_local_layers
        return out
    finally:
        destroy_parallel()


def worker(rank: int, world_size: int, tmpdir: str) -> None:
    from sao_megatron.models import MoEModelConfig, build_policy
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from tests.routing.replay_case import hf_weights, make_case

    cfg = MoEModelConfig(**tiny_moe_kwargs())
    st = initialize_parallel(ParallelConfig())  # dp = 2: the full model on each rank
    (chunk,) = build_policy(cfg, st)
    case = make_case(hf_weights(chunk, cfg), cfg)
    destroy_parallel()
    keys = ("flip_frac", "num_flips", "num_flips_replayed")
    results = {"case": {k: case[k] for k in keys}}
    for name, pkw in LAYOUTS.items():
        try:
            results[name] = _run(cfg, pkw, case)
        except Exception as e:  # recorded per layout; the test reports it
            import traceback

            results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    torch.save(results, os.path.join(tmpdir, f"rank{rank}.pt"))
