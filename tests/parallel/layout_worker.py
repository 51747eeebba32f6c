"""Worker for the 2-rank layout-equality tests (run by tests/parallel/test_layouts.py).

One launch: a 1-rank-equivalent reference (full model on every rank, plain autograd, no
collectives), then each layout in turn with the same weights sliced by ``shard_state_dict``.
Per layout and rank it records max errors of policy log-probs, entropies, values and of the
gradients (policy and value) after one forward/backward, into ``<tmp>/rank<r>.pt``.
"""

from __future__ import annotations

import os

import torch

from tests.conftest import tiny_moe_kwargs

TEMPERATURE = 0.8
LR, ADAM_EPS = 1e-3, 1e-3
LAYOUTS: dict[str, tuple[dict, dict, bool]] = {
    # name: (ParallelConfig kwargs, MoEModelConfig overrides, distributed optimizer)
    "tp2_sp": ({"tp": 2, "sequence_parallel": True}, {}, False),
    "ep2_alltoall": ({"ep": 2}, {"moe_token_dispatcher_type": "alltoall"}, True),
    "ep2_allgather": ({"ep": 2}, {"moe_token_dispatcher_type": "allgather"}, False),
    "pp2": ({"pp": 2}, {}, False),
    "dp2": ({}, {}, True),
    "pp2_vpp2": ({"pp": 2, "virtual_pp": 2}, {"num_hidden_layers": 4}, False),
    "tp2_sp_kv1": ({"tp": 2, "sequence_parallel": True}, {"num_key_value_heads": 1}, False),
}
ARCH_FIELDS = (
    "num_hidden_layers",
    "num_key_value_heads",
)  # overrides that change the reference model
# CPU workarounds that only multi-rank runs exercise: the layout must fail without them.
NEEDED = {"keep_alltoall_splits_as_numpy": "ep2_alltoall"}


def make_batch():
    """B=4, T=16: row 0 left-padded by 3, row 3 right-padded by 4; per-token weights/returns."""
    from sao_megatron.models import ModelInputs

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (4, 16), generator=g)
    am = torch.ones(4, 16, dtype=torch.long)
    am[0, :3] = 0
    am[3, 12:] = 0
    extras = {
        "weights": torch.randn(4, 15, generator=g),
        "returns": torch.randn(4, 16, generator=g),
    }
    return ModelInputs(ids, am, extras=extras)


def policy_loss(outputs, mb, num_tokens):
    """sum_t m_t (w_t * logprob_t + 0.01 * entropy_t) / N_global (N = valid targets)."""
    m = mb.attention_mask[:, 1:].float()
    lp, ent = outputs["logprobs"], outputs["entropy"]
    return (m * (mb.extras["weights"] * lp + 0.01 * ent)).sum() / num_tokens, {}


def value_loss(outputs, mb, num_tokens):
    """sum_t m_t (V_t - R_t)^2 / N_global."""
    m = mb.attention_mask.float()
    return (m * (outputs["values"] - mb.extras["returns"]) ** 2).sum() / num_tokens, {}


def _grads_as_state(model):
    state = dict(model.state_dict())
    for name, p in model.named_parameters():
        state[name] = p.grad.detach().clone()
    return state


def _maxerr(a, b):
    return float((a.double() - b.double()).abs().max())


def _reference(model_cfg, batch):
    from sao_megatron.models import (
        build_policy,
        build_value_model,
        causal_padding_mask,
        token_logprobs_and_entropy,
    )
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    state = initialize_parallel(ParallelConfig())  # dp = world size; each rank a full model
    policy = build_policy(model_cfg, state)[0]
    value = build_value_model(model_cfg, state)[0]
    weights = {"policy": policy.state_dict(), "value": value.state_dict()}
    path = os.path.join(os.environ["SAO_TEST_TMP"], "weights.pt")
    if state.rank == 0:
        torch.save(weights, path)
    torch.distributed.barrier()
    weights = torch.load(path)
    policy.load_state_dict(weights["policy"])
    value.load_state_dict(weights["value"])
    mask = causal_padding_mask(batch.attention_mask)
    n_policy = float(batch.attention_mask[:, 1:].sum())
    n_value = float(batch.attention_mask.sum())
    logits = policy(batch.input_ids, batch.position_ids, mask)
    lp, ent = token_logprobs_and_entropy(logits[:, :-1], batch.input_ids[:, 1:], TEMPERATURE)
    policy_loss({"logprobs": lp, "entropy": ent}, batch, n_policy)[0].backward()
    values = value(batch.input_ids, batch.position_ids, mask)[..., 0]
    value_loss({"values": values}, batch, n_value)[0].backward()
    ref = {
        "logprobs": lp.detach(),
        "entropy": ent.detach(),
        "values": values.detach(),
        "policy_grads": _grads_as_state(policy),
        "value_grads": _grads_as_state(value),
        "n_policy": n_policy,
        "n_value": n_value,
    }
    destroy_parallel()
    return weights, ref


def _expected_adam_step(weights, grads):
    """First AdamW step, no clipping/decay: p - lr * g / (|g| + eps) (bias-corrected moments
    are g and g^2; Loshchilov & Hutter 2019, Alg. 2)."""
    out = dict(weights)
    for k, g in grads.items():
        if torch.is_tensor(g) and g.is_floating_point() and k in weights:
            out[k] = weights[k] - LR * g / (g.abs() + ADAM_EPS)
    return out


def _check_freeze_across_stages(model_cfg, st):
    """The default value freeze patterns match nowhere on some stage (the embedding lives on
    the first), so the check must be global over the pipeline group."""
    from sao_megatron.models import VALUE_DEFAULT_FREEZE_PATTERNS, apply_freeze, build_value_model

    value = build_value_model(model_cfg, st)
    report = apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS, group=st.pg_collection.pp)
    try:
        apply_freeze(value, VALUE_DEFAULT_FREEZE_PATTERNS)
        local = "no error"
    except ValueError as e:
        local = str(e)
    try:
        apply_freeze(value, ["no_such_param"], group=st.pg_collection.pp)
        nowhere = "no error"
    except ValueError as e:
        nowhere = str(e)
    return {"frozen": len(report.frozen_names), "local": local, "nowhere": nowhere}


def _run_layout(model_cfg, pkw, weights, ref, batch, dist_opt=False, without=None):
    from sao_megatron.models import (
        build_policy,
        build_value_model,
        compute_policy_logprobs,
        compute_values,
        forward_backward,
    )
    from sao_megatron.optim import OptimizerConfig, PrecisionConfig, build_optimizer
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from sao_megatron.parallel.sharding import shard_state_dict

    st = initialize_parallel(ParallelConfig(**pkw))
    if without:
        from sao_megatron.platform import cpu_compat

        cpu_compat.disable_cpu_compat([without])
    try:
        coords = st.shard_coords()
        policy = build_policy(model_cfg, st)
        value = build_value_model(model_cfg, st)
        init_err = 0.0  # CPU init is layout-independent: same seed -> slices of the 1-rank model
        for kind, models in (("policy", policy), ("value", value)):
            for chunk in models:
                expected = shard_state_dict(weights[kind], chunk, **coords)
                for name, p in chunk.named_parameters():
                    init_err = max(init_err, _maxerr(p, expected[name]))
        for chunk in policy:
            chunk.load_state_dict(shard_state_dict(weights["policy"], chunk, **coords))
        for chunk in value:
            chunk.load_state_dict(shard_state_dict(weights["value"], chunk, **coords))
        out = {"init": init_err}
        if st.cfg.pp > 1:
            out["freeze"] = _check_freeze_across_stages(model_cfg, st)
        rows = batch.input_ids.shape[0] // st.dp
        lo, hi = st.dp_rank * rows, (st.dp_rank + 1) * rows
        local = batch.slice(lo, hi)
        lp, ent = compute_policy_logprobs(policy, st, local, TEMPERATURE, micro_batch_size=1)
        vals = compute_values(value, st, local, micro_batch_size=1)
        out["outputs"] = {"logprobs": lp, "values": vals}
        out["logprobs"] = _maxerr(lp, ref["logprobs"][lo:hi])
        out["entropy"] = _maxerr(ent, ref["entropy"][lo:hi])
        out["values"] = _maxerr(vals, ref["values"][lo:hi])
        out["logprobs_scale"] = float(ref["logprobs"].abs().max())
        out["values_scale"] = float(ref["values"].abs().max())
        for kind, models, loss, n in (
            ("policy", policy, policy_loss, ref["n_policy"]),
            ("value", value, value_loss, ref["n_value"]),
        ):
            ocfg = OptimizerConfig(
                lr=LR, adam_eps=ADAM_EPS, clip_grad=0.0, distributed_optimizer=dist_opt
            )
            ts = build_optimizer(models, st, ocfg, PrecisionConfig())
            ts.zero_grad()
            records = forward_backward(
                ts.model,
                st,
                local,
                kind=kind,
                micro_batch_size=1,
                loss_fn=lambda o, mb, loss=loss, n=n: loss(o, mb, n),
                temperature=TEMPERATURE,
            )
            out[f"{kind}_losses"] = [float(r["loss"]) for r in records]
            err, scale, count = 0.0, 0.0, 0
            # (the distributed optimiser reduce-scatters main_grad: only the step is checked)
            for chunk in [] if dist_opt else ts.unwrapped:
                expected = shard_state_dict(ref[f"{kind}_grads"], chunk, **coords)
                for name, p in chunk.named_parameters():
                    e = _maxerr(p.main_grad, expected[name])
                    if e > 1e-6:
                        g, x = p.main_grad.double(), expected[name].double()
                        ratio = float((g * x).sum() / (x * x).sum())
                        out.setdefault("bad", []).append((kind, name, e, ratio))
                    err = max(err, e)
                    scale = max(scale, float(expected[name].abs().max()))
                    count += 1
            out[f"{kind}_grad"], out[f"{kind}_grad_scale"] = err, scale
            out[f"{kind}_num_params"] = sum(1 for c in ts.unwrapped for _ in c.parameters())
            ok, _ = ts.step()
            assert ok
            stepped = _expected_adam_step(weights[kind], ref[f"{kind}_grads"])
            err = 0.0
            for chunk in ts.unwrapped:
                expected = shard_state_dict(stepped, chunk, **coords)
                for name, p in chunk.named_parameters():
                    err = max(err, _maxerr(p, expected[name]))
            out[f"{kind}_step"] = err
        return out
    finally:
        destroy_parallel()


def worker(rank: int, world_size: int, tmpdir: str) -> None:
    """Entry point for ``tests.conftest.launch``."""
    from sao_megatron.models import MoEModelConfig

    os.environ["SAO_TEST_TMP"] = tmpdir
    batch = make_batch()
    references = {}
    results = {}
    for name, (pkw, overrides, dist_opt) in LAYOUTS.items():
        model_cfg = MoEModelConfig(**{**tiny_moe_kwargs(), **overrides})
        arch = tuple(overrides.get(f) for f in ARCH_FIELDS)
        if arch not in references:
            references[arch] = _reference(model_cfg, batch)
        weights, ref = references[arch]
        try:
            results[name] = _run_layout(model_cfg, pkw, weights, ref, batch, dist_opt)
        except Exception as e:  # recorded per layout; the test reports it
            import traceback

            results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    from sao_megatron.platform import cpu_compat

    weights, ref = references[(None,) * len(ARCH_FIELDS)]
    for workaround, name in NEEDED.items():
        pkw, overrides, _ = LAYOUTS[name]
        model_cfg = MoEModelConfig(**{**tiny_moe_kwargs(), **overrides})
        try:
            results[f"without:{workaround}"] = _run_layout(
                model_cfg, pkw, weights, ref, batch, without=workaround
            )
        except Exception as e:
            results[f"without:{workaround}"] = f"{type(e).__name__}: {e}"
        finally:
            cpu_compat.enable_cpu_compat()
        torch.distributed.barrier()
    results["gather_variable_sizes"] = _check_variable_gather(rank)
    torch.save(results, os.path.join(tmpdir, f"rank{rank}.pt"))


def _check_variable_gather(rank):
    """Megatron's variable-size sequence-parallel gather on the 2-rank gloo world, with and
    without ``gather_variable_sizes_on_gloo`` (4-rank EP2xETP2 layouts hit it in the dispatcher).
    Returns (max error with the workaround, error text without it)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from sao_megatron.platform import cpu_compat

    group = torch.distributed.group.WORLD
    sizes = [2, 3]
    x = torch.arange(sizes[rank] * 4, dtype=torch.float32).reshape(-1, 4) + 100 * rank
    expected = torch.cat(
        [
            torch.arange(n * 4, dtype=torch.float32).reshape(-1, 4) + 100 * r
            for r, n in enumerate(sizes)
        ]
    )
    got = gather_from_sequence_parallel_region(x, group=group, output_split_sizes=sizes)
    err = _maxerr(got, expected)
    cpu_compat.disable_cpu_compat(["gather_variable_sizes_on_gloo"])
    try:
        gather_from_sequence_parallel_region(x, group=group, output_split_sizes=sizes)
        without = "no error"
    except Exception as e:
        without = f"{type(e).__name__}: {e}"
    finally:
        cpu_compat.enable_cpu_compat()
    return err, without
