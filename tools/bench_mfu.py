"""Training MFU of the SAO trainer: model FLOP/s of policy/value steps against a matmul roofline.

Two measurements, then a markdown table (for docs/BENCHMARKS.md) and optional raw JSON:

1. Roofline: ``torch.matmul`` FLOP/s on the GEMM shapes one micro-batch forward of the model runs
   (QKV, attention scores/context, output projection, router, expert fc1 (SwiGLU: 2 x ffn
   columns) and fc2 at tokens*top_k/experts rows per expert, shared expert / dense MLP if any,
   LM head, value head), fp32 and bf16 on this machine's CPU; with CUDA also fp32 and bf16 on
   the GPU and, if Transformer Engine imports, FP8 through ``te.Linear`` under ``fp8_autocast``
   (FP8 casts included). A missing backend or a refused shape is printed "n/a (reason)", never
   an error. Each shape is timed with ``torch.utils.benchmark.Timer.blocked_autorange`` (one
   warm-up call, then the median over timed blocks; the fastest block is kept in the JSON). The
   aggregate is the FLOP-weighted rate of a whole forward, sum(flops_i * n_i) /
   sum(seconds_i * n_i) with n_i the uses per forward pass: the best FLOP/s a GEMM-bound forward
   of this model reaches here ("roofline"), for the policy mix (LM head) and the value mix
   (value head). Only forward shapes are timed; backward GEMMs are their transposes.
2. Achieved: the real Megatron policy and value models on 1 rank (gloo on CPU; the trainer's
   device and precision from the config), a synthetic packed ``TrainBatch`` of ``--rows`` rows
   of exactly ``--seq-len`` tokens (4 action nodes per row, half observation and half action
   tokens, no padding), behaviour log-probs from the policy itself. ``RLStep.train_step`` (SAO)
   is timed whole and by the phases it reports itself (``time/value``: value forward, K value
   updates, value forward, advantages; ``time/policy``: one policy update), and
   ``RLStep.value_step`` (value pre-training: the value phase alone). Optimiser steps are inside
   the timed phases; their FLOPs are not counted.

MFU = achieved model FLOP/s / roofline FLOP/s (PaLM, Chowdhery et al. 2022, appendix B: "model
FLOPs utilization", model FLOPs not counting recomputation or optimiser work). The roofline of a
phase is the aggregate of its forward mix in the trainer's own dtype (fp32 on CPU): the policy
mix for the policy update, the value mix for value phases, the time-weighted blend of both for
the whole step; MFU against the bf16 roofline is printed for reference. Both halves are
sensitive to other load on the machine (the table records the load average before and after):
run it on an idle machine; an MFU above 100% means the roofline run was disturbed.

FLOP conventions (counted exactly, per processed token position, by `forward_flops`):
- A matmul [M, K] x [K, N] is 2*M*K*N FLOPs (multiply + add). Only matmuls are counted:
  norms, RoPE, softmax, SwiGLU, routing permutations, log-softmax/entropy and the embedding
  lookup are not (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1,
  C_forward ~ 2N + 2 n_layer n_ctx d_attn: 2 FLOPs per active weight per token).
- Active weights per token: QKV [h, (heads + 2 kv_heads) head_dim], output projection, router
  [h, experts], top_k experts' fc1 [h, 2 ffn] and fc2 [ffn, h] (plus shared expert and dense
  layers when configured), and the LM head [h, vocab] (policy) or value head [h, 1] (critic).
- Attention: 2 * 2 * seq * heads * head_dim per token per layer (QK^T and scores x V) over the
  FULL seq x seq square, not the causal half: the convention of PaLM appendix B (6N + 12 L H Q T
  per token for training) and Narayanan et al. 2021 ("Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", eq. 3), and what Megatron's unfused CPU attention
  (``DotProductAttention``: baddbmm + bmm on the masked square) executes. A causal flash kernel
  runs about half of it.
- Training = forward + backward. Backward of a linear layer = activation gradient (1x its
  forward FLOPs) + weight gradient (1x, only for trainable weights: Megatron's
  ``LinearWithFrozenWeight`` skips it for frozen ones); attention scores/context have no weights
  and cost 2x forward (gradients of both operands). The policy trains everything: 3x forward
  (the "6N" rule, Kaplan et al. 2020 section 2.1). The critic freezes embeddings and attention
  QKV/projection (``value.freeze_patterns``): those matmuls cost 2x forward (activation
  gradients still flow through them to the trainable norms and experts below); everything else
  3x. Activation gradients of layer 0's QKV are counted only if a parameter below it trains
  (embedding or layer-0 input norm; true for both models by default).
- What each phase executes (K = algorithm.sao.value_updates_per_policy_update):
  value phase = (K + 1) value forwards + K value backwards (K updates, the first of which
  gives V_old and the returns need no values at algorithm.sao.lam_value = 1; then a no-grad
  forward for the fresh values); with lam_value != 1 one more no-grad forward for V_old
  before the updates, (K + 2) in all; policy phase = 1 policy forward + backward
  (SAO uses the rollout's behaviour log-probs, no extra "old" forward).
  Not counted either: the advantage scan's small matmuls (GAE, a few kFLOPs per step).
  tests/tools/test_bench_mfu.py checks every count here against ``torch.utils.flop_counter``
  on the real models and on whole ``RLStep.train_step``/``value_step`` calls.

Reproduce (the command in docs/BENCHMARKS.md; about 2-3 minutes on an idle 2-core CPU; 16 rows
= rollout.trajectories_per_batch and micro-batch 8 = rl.micro_batch_size of the quickstart;
vocabulary 512 = the quickstart's trained tokenizer):

    python tools/bench_mfu.py --config examples/configs/quickstart.yaml --rows 16 --seq-len 256 \
        --steps 3 --json runs/bench_mfu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ FLOP counting
@dataclass(frozen=True)
class Gemm:
    """One GEMM shape of a forward pass: [m, k] x [k, n] (``batch`` independent products),
    run ``uses`` times per forward (layers x experts)."""

    name: str
    m: int
    k: int
    n: int
    uses: int
    batch: int = 1

    @property
    def flops(self) -> float:
        """FLOPs of one product: 2 * batch * m * k * n."""
        return 2.0 * self.batch * self.m * self.k * self.n


def model_gemms(model, num_rows: int, seq_len: int, head: str) -> list[Gemm]:
    """The matmuls of one forward pass over ``num_rows`` rows of ``seq_len`` tokens.

    Args:
        model: a ``MoEModelConfig``.
        head: "policy" (LM head [h, vocab]) or "value" (value head [h, 1]).
    Returns: one `Gemm` per distinct shape; expert GEMMs assume even routing
        (tokens * top_k / experts rows each), which leaves their total FLOPs exact.
    Raises: ValueError for an unknown head.
    """
    if head not in ("policy", "value"):
        raise ValueError(f"head={head!r}: must be 'policy' or 'value'")
    t, h, hd = num_rows * seq_len, model.hidden_size, model.head_dim
    nh, nkv, e, k = (
        model.num_attention_heads,
        model.num_key_value_heads,
        model.num_experts,
        model.num_experts_per_tok,
    )
    layers = model.num_hidden_layers
    dense = len(model.mlp_only_layers)
    moe = layers - dense
    f, fs = model.moe_intermediate_size, model.shared_expert_intermediate_size
    fd = model.intermediate_size
    rows_per_expert = t * k / e
    out = [
        Gemm("attn_qkv", t, h, (nh + 2 * nkv) * hd, layers),
        Gemm("attn_scores", seq_len, hd, seq_len, layers, batch=num_rows * nh),
        Gemm("attn_context", seq_len, seq_len, hd, layers, batch=num_rows * nh),
        Gemm("attn_proj", t, nh * hd, h, layers),
    ]
    if moe:
        out += [
            Gemm("router", t, h, e, moe),
            Gemm("expert_fc1", rows_per_expert, h, 2 * f, moe * e),
            Gemm("expert_fc2", rows_per_expert, f, h, moe * e),
        ]
        if fs:
            out += [Gemm("shared_fc1", t, h, 2 * fs, moe), Gemm("shared_fc2", t, fs, h, moe)]
            if model.shared_expert_gate:
                out.append(Gemm("shared_gate", t, h, 1, moe))
    if dense:
        out += [Gemm("dense_fc1", t, h, 2 * fd, dense), Gemm("dense_fc2", t, fd, h, dense)]
    if head == "policy":
        out.append(Gemm("lm_head", t, h, model.vocab_size, 1))
    else:
        out.append(Gemm("value_head", t, h, 1, 1))
    return out


def forward_flops(model, num_rows: int, seq_len: int, head: str) -> dict[str, float]:
    """FLOPs of one forward pass by component (see the module docstring for the convention)."""
    return {g.name: g.flops * g.uses for g in model_gemms(model, num_rows, seq_len, head)}


#: weight parameter of each weighted component (names of the unwrapped Megatron modules)
COMPONENT_WEIGHTS = {
    "attn_qkv": r"self_attention\.linear_qkv\.weight$",
    "attn_proj": r"self_attention\.linear_proj\.weight$",
    "router": r"mlp\.router\.weight$",
    "expert_fc1": r"mlp\.experts\..*linear_fc1\.weight",
    "expert_fc2": r"mlp\.experts\..*linear_fc2\.weight",
    "shared_fc1": r"mlp\.shared_experts\.linear_fc1\.weight$",
    "shared_fc2": r"mlp\.shared_experts\.linear_fc2\.weight$",
    "shared_gate": r"mlp\.shared_experts\.gate_weight$",
    "dense_fc1": r"layers\.\d+\.mlp\.linear_fc1\.weight$",
    "dense_fc2": r"layers\.\d+\.mlp\.linear_fc2\.weight$",
    "lm_head": r"^output_layer\.weight$",
    "value_head": r"^output_layer\.weight$",
}
#: parameters below layer 0's QKV: if any trains, its activation gradient is computed
_BELOW_LAYER0 = (
    r"^embedding\.|^decoder\.layers\.0\.(input_layernorm|self_attention\.linear_qkv\.layer_norm)"
)


def trainable_fractions(named_params, tied_embeddings: bool = False) -> dict[str, float]:
    """Fraction (by element count) of each component's weights that train, from the model.

    Args:
        named_params: ``(name, parameter)`` pairs of the unwrapped model chunk(s).
        tied_embeddings: the LM head uses the input embedding's weight.
    Returns: {component: fraction in [0, 1]} plus "_layer0_input_grad" (1.0 if a parameter
        below layer 0's QKV trains, else 0.0).
    """
    params = list(named_params)
    out = {}
    for comp, pat in COMPONENT_WEIGHTS.items():
        if comp == "lm_head" and tied_embeddings:
            pat = r"^embedding\.word_embeddings\.weight$"
        sel = [p for n, p in params if re.search(pat, n)]
        total = sum(p.numel() for p in sel)
        out[comp] = sum(p.numel() for p in sel if p.requires_grad) / total if total else 1.0
    out["_layer0_input_grad"] = float(
        any(p.requires_grad for n, p in params if re.search(_BELOW_LAYER0, n))
    )
    return out


def backward_flops(
    model, num_rows: int, seq_len: int, head: str, fractions: dict[str, float]
) -> dict[str, float]:
    """FLOPs of one backward pass by component: activation gradients (1x forward; 2x for the
    weightless attention products) + weight gradients (1x forward x trainable fraction)."""
    fwd = forward_flops(model, num_rows, seq_len, head)
    out = {}
    for name, f in fwd.items():
        if name in ("attn_scores", "attn_context"):
            out[name] = 2.0 * f
        else:
            out[name] = f * (1.0 + fractions.get(name, 1.0))
    if not fractions.get("_layer0_input_grad", 1.0):
        out["attn_qkv"] -= fwd["attn_qkv"] / model.num_hidden_layers  # no dgrad into layer 0
    return out


def step_flops(
    model,
    num_rows: int,
    seq_len: int,
    k_value: int,
    policy_frac,
    value_frac,
    targets_forward: bool = False,
):
    """Model FLOPs of the SAO phases RLStep runs on ``num_rows`` x ``seq_len`` tokens.

    Returns {"policy_update", "value_phase", "train_step", "value_step"} in FLOPs: policy
    forward + backward; (k_value + 1) value forwards + k_value value backwards, one forward more
    with ``targets_forward`` (the VALUE_TARGETS forward of lam_value != 1); their sum; and a
    value pre-training step (`RLStep.value_step`): the value phase without the forward after
    the updates (the ADVANTAGES phase's).
    """
    fp = sum(forward_flops(model, num_rows, seq_len, "policy").values())
    bp = sum(backward_flops(model, num_rows, seq_len, "policy", policy_frac).values())
    fv = sum(forward_flops(model, num_rows, seq_len, "value").values())
    bv = sum(backward_flops(model, num_rows, seq_len, "value", value_frac).values())
    num_fwd = k_value + (2 if targets_forward else 1)
    pol, val = fp + bp, num_fwd * fv + k_value * bv
    return {
        "policy_update": pol,
        "value_phase": val,
        "train_step": pol + val,
        "value_step": val - fv,
    }


def grpo_step_flops(model, num_rows: int, seq_len: int, policy_frac) -> float:
    """Model FLOPs of a GRPO ``RLStep.train_step`` (PPO-clip) on ``num_rows`` x ``seq_len``
    tokens: one no-grad policy forward (OLD_LOGPROBS) + one policy forward and backward."""
    fp = sum(forward_flops(model, num_rows, seq_len, "policy").values())
    bp = sum(backward_flops(model, num_rows, seq_len, "policy", policy_frac).values())
    return 2 * fp + bp


# ------------------------------------------------------------------------------ roofline
def _time_matmul(g: Gemm, dtype: torch.dtype, device: str, min_run_time: float):
    """(median, best) seconds of one product of shape ``g`` over ``blocked_autorange`` blocks
    (rows rounded to an integer, the time scaled back to the fractional row count)."""
    from torch.utils.benchmark import Timer

    m = max(round(g.m), 1)
    shape_a = (g.batch, m, g.k) if g.batch > 1 else (m, g.k)
    shape_b = (g.batch, g.k, g.n) if g.batch > 1 else (g.k, g.n)
    a = torch.randn(shape_a, dtype=dtype, device=device)
    b = torch.randn(shape_b, dtype=dtype, device=device)
    torch.matmul(a, b)  # warm-up (kernel selection, allocation)
    timer = Timer(
        "torch.matmul(a, b)",
        globals={"torch": torch, "a": a, "b": b},
        num_threads=torch.get_num_threads(),
    )
    meas = timer.blocked_autorange(min_run_time=min_run_time)
    return meas.median * (g.m / m), min(meas.times) * (g.m / m)


def _time_te_fp8(g: Gemm, min_run_time: float):
    """(median, best) seconds of ``te.Linear`` (bf16 params, FP8 GEMM) on [m, k] inputs,
    including TE's casts to FP8."""
    import transformer_engine.pytorch as te
    from torch.utils.benchmark import Timer
    from transformer_engine.common.recipe import DelayedScaling

    if g.batch > 1:
        raise ValueError("batched attention products are not a te.Linear")
    lin = te.Linear(g.k, g.n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(max(round(g.m), 1), g.k, dtype=torch.bfloat16, device="cuda")
    stmt = "with te.fp8_autocast(enabled=True, fp8_recipe=recipe):\n    lin(x)"
    glb = {"te": te, "lin": lin, "x": x, "recipe": DelayedScaling()}
    exec(stmt, glb)  # warm-up; raises for shapes FP8 GEMMs refuse (dims % 16)
    meas = Timer(stmt, globals=glb).blocked_autorange(min_run_time=min_run_time)
    return meas.median, min(meas.times)


def roofline(gemms: list[Gemm], min_run_time: float) -> tuple[dict, dict]:
    """FLOP/s per backend and shape, {backend: {shape: FLOP/s or "n/a (reason)"}}, where a
    backend is missing or refuses a shape: (from the median block, from the fastest block)."""
    cuda = torch.cuda.is_available()
    backends = {
        "cpu_fp32": lambda g: _time_matmul(g, torch.float32, "cpu", min_run_time),
        "cpu_bf16": lambda g: _time_matmul(g, torch.bfloat16, "cpu", min_run_time),
        "cuda_fp32": lambda g: _time_matmul(g, torch.float32, "cuda", min_run_time),
        "cuda_bf16": lambda g: _time_matmul(g, torch.bfloat16, "cuda", min_run_time),
        "cuda_te_fp8": lambda g: _time_te_fp8(g, min_run_time),
    }
    med: dict[str, dict[str, float | str]] = {}
    best: dict[str, dict[str, float | str]] = {}
    for name, fn in backends.items():
        med[name], best[name] = {}, {}
        for g in gemms:
            if name.startswith("cuda") and not cuda:
                med[name][g.name] = best[name][g.name] = "n/a (no CUDA)"
                continue
            try:
                t_med, t_best = fn(g)
                med[name][g.name], best[name][g.name] = g.flops / t_med, g.flops / t_best
            except Exception as exc:  # a missing TE or a refused shape is a table entry
                med[name][g.name] = best[name][g.name] = f"n/a ({type(exc).__name__})"
    return med, best


def aggregate(gemms: list[Gemm], rates: dict[str, float | str]) -> float | str:
    """FLOP-weighted FLOP/s of a whole forward: sum(flops*uses) / sum(seconds*uses)."""
    if any(isinstance(rates[g.name], str) for g in gemms):
        return "n/a"
    flops = sum(g.flops * g.uses for g in gemms)
    return flops / sum(g.flops * g.uses / rates[g.name] for g in gemms)


# ------------------------------------------------------------------------------ trainer
def synthetic_trajectories(
    num_rows: int, seq_len: int, vocab: int, seed: int, nodes: int = 4, group_size: int = 1
):
    """``num_rows`` full-history trajectories of exactly ``seq_len`` tokens: ``nodes`` action
    nodes, each half observation, half action tokens; random ids in [1, vocab); rewards 0/1.
    ``group_size`` > 1: consecutive rows share a task id (GRPO groups, ``group_index`` 0..G-1)."""
    from sao_megatron.data.trajectory import ActionNode, Trajectory

    g = torch.Generator().manual_seed(seed)
    cuts = [round(i * seq_len / nodes) for i in range(nodes + 1)]
    out = []
    for r in range(num_rows):
        node_list = []
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            n_obs = max((b - a) // 2, 1)
            ids = torch.randint(1, vocab, (b - a,), generator=g).tolist()
            node_list.append(
                ActionNode(
                    observation_token_ids=ids[:n_obs],
                    action_token_ids=ids[n_obs:],
                    behaviour_logprobs=[-1.0] * (b - a - n_obs),
                    policy_versions=[0] * (b - a - n_obs),
                    reward=float(torch.rand((), generator=g) < 0.5),
                )
            )
        out.append(
            Trajectory(
                task_id=f"bench{r // group_size}",
                group_index=r % group_size,
                nodes=node_list,
            )
        )
    return out


def build_trainer(
    job, parallel, num_rows: int, seq_len: int, micro_batch_size: int, group_size: int = 1
):
    """Policy/value train states, an SAO ``RLStep`` and an on-policy synthetic batch (rows in
    GRPO groups of ``group_size`` consecutive rows, which SAO ignores)."""
    from sao_megatron.algorithm import registry
    from sao_megatron.data.batch import pack_trajectories
    from sao_megatron.models import ModelInputs, compute_policy_logprobs
    from sao_megatron.trainer.rl_step import RLStep, StepConfig
    from sao_megatron.trainer.runtime import build_policy_state, build_value_state

    policy = build_policy_state(job, parallel, job.policy_optim)
    value = build_value_state(job, parallel, policy.unwrapped)
    trajs = synthetic_trajectories(
        num_rows, seq_len, job.model.vocab_size, job.seed, group_size=group_size
    )
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=seq_len)
    inputs = ModelInputs(batch.token_ids, batch.loss_mask, batch.position_ids)
    lp, _ = compute_policy_logprobs(policy.model, parallel, inputs, 1.0, micro_batch_size)
    for r, traj in enumerate(trajs):  # behaviour = the policy itself (on-policy data)
        flat = lp[r, torch.nonzero(batch.action_mask[r]).flatten() - 1].tolist()
        for node in traj.nodes:
            n = len(node.action_token_ids)
            node.behaviour_logprobs, flat = flat[:n], flat[n:]
    batch = pack_trajectories(trajs, pad_token_id=0, max_seq_len=seq_len)
    step = RLStep(
        registry.build(job.algorithm),
        parallel,
        policy,
        value,
        StepConfig(micro_batch_size=micro_batch_size),
    )
    return policy, value, step, batch


def build_grpo_step(job, parallel, policy, micro_batch_size: int):
    """A GRPO ``RLStep`` (its defaults: PPO-clip on recomputed old log-probs, G of
    ``algorithm.grpo``) on the same policy train state."""
    from sao_megatron.algorithm import registry
    from sao_megatron.algorithm.config import AlgorithmConfig
    from sao_megatron.trainer.rl_step import RLStep, StepConfig

    algo = registry.build(AlgorithmConfig(name="grpo", grpo=job.algorithm.grpo))
    return RLStep(algo, parallel, policy, None, StepConfig(micro_batch_size=micro_batch_size))


def time_trainer(step, batch, steps: int, warmup: int, grpo=None) -> dict[str, list[float]]:
    """Seconds per repeat: SAO train_step (whole, value phase, policy update), value_step and,
    with ``grpo`` (an RLStep), a GRPO train_step, interleaved in each repeat so that load drifts
    hit SAO and GRPO alike."""
    out = {"train_step": [], "value_phase": [], "policy_update": [], "value_step": []}
    if grpo is not None:
        out["grpo_step"] = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        m = step.train_step(batch, train_version=i)
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        step.value_step(batch)
        vs = time.perf_counter() - t0
        t0 = time.perf_counter()
        if grpo is not None:
            grpo.train_step(batch, train_version=i)
        gs = time.perf_counter() - t0
        if i >= warmup:
            out["train_step"].append(total)
            out["value_phase"].append(m["time/value"] + m["time/advantages"])
            out["policy_update"].append(m["time/policy"])
            out["value_step"].append(vs)
            if grpo is not None:
                out["grpo_step"].append(gs)
    return out


# ------------------------------------------------------------------------------ report
def machine_info() -> dict[str, str | int | float]:
    """nproc, CPU model, torch version, threads, load average, UTC date, git commit."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/, for benchlib
    from benchlib import cpu_model

    cpu = cpu_model()
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu,
        "nproc": os.cpu_count() or 0,
        "gpu": gpu,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_1_5_15": _load(),
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "commit": commit,
    }


def _rel(path: str) -> str:
    """``path`` relative to the repository when inside it (for the docs)."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _g(x: float | str) -> str:
    """FLOP/s or FLOPs as GFLOP(/s) with 3 significant digits; strings pass through."""
    return x if isinstance(x, str) else f"{x / 1e9:.3g}"


def markdown(res: dict) -> str:
    """The tables for docs/BENCHMARKS.md."""
    mi, cfg = res["machine"], res["setup"]
    lines = [
        "| machine | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in mi.items()],
        "",
        f"Model: {cfg['model']}. GEMM tokens per micro-batch: {cfg['tokens']} "
        f"({cfg['micro_batch_size']} rows x {cfg['seq_len']} tokens).",
        "",
        "| GEMM (forward) | [m x k] x [k x n] | uses/fwd | GFLOP/fwd | CPU fp32 GFLOP/s "
        "| CPU bf16 GFLOP/s | CUDA fp32 GFLOP/s | CUDA bf16 GFLOP/s | CUDA TE FP8 GFLOP/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rf = res["roofline"]
    for g in res["gemms"]:
        shape = f"{g['batch']} x " if g["batch"] > 1 else ""
        shape += f"[{g['m']:g} x {g['k']}] x [{g['k']} x {g['n']}]"
        rates = " | ".join(_g(rf[b][g["name"]]) for b in rf)
        gf = g["flops"] * g["uses"]
        lines.append(f"| {g['name']} | {shape} | {g['uses']} | {_g(gf)} | {rates} |")
    for mix in ("policy", "value"):
        rates = " | ".join(_g(res["aggregate"][mix][b]) for b in rf)
        lines.append(f"| **aggregate, {mix} forward mix** | | | | {rates} |")
    if not res["trainer"]:
        return "\n".join(lines)
    dt = cfg["trainer_dtype"]
    lines += [
        "",
        f"Trainer: {cfg['trainer_device']} {dt}, 1 rank, SAO with "
        f"K={cfg['value_updates']} value updates per policy update, {cfg['rows']} rows x "
        f"{cfg['seq_len']} tokens, micro-batch {cfg['micro_batch_size']}; seconds: median "
        f"[min, max] of {cfg['steps']} steps after {cfg['warmup']} warm-up. Roofline: the "
        f"{cfg['trainer_device']} {dt} aggregate above of the phase's forward mix (policy mix "
        "for the policy update, value mix for value phases, both time-weighted for the step); "
        "MFU = achieved / roofline, and against the bf16 roofline for reference.",
        "",
        f"| phase | what runs | model GFLOP | seconds | achieved GFLOP/s | {dt} roofline "
        "GFLOP/s | MFU | MFU vs bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in res["trainer"].items():
        t = r["seconds"]
        mfu = "n/a" if isinstance(r["mfu"], str) else f"{100 * r['mfu']:.1f}%"
        mfu16 = "n/a" if isinstance(r["mfu_bf16"], str) else f"{100 * r['mfu_bf16']:.1f}%"
        lines.append(
            f"| {name} | {r['what']} | {_g(r['flops'])} | {t['median']:.3f} "
            f"[{t['min']:.3f}, {t['max']:.3f}] | {_g(r['flops_per_s'])} | "
            f"{_g(r['roofline_flops_per_s'])} | {mfu} | {mfu16} |"
        )
    ratio = res.get("sao_over_grpo")
    if ratio:
        lines += [
            "",
            f"SAO step / GRPO step: {ratio['seconds']:.2f}x in seconds (medians), "
            f"{ratio['flops']:.2f}x in model FLOPs (the floor if both ran at the same FLOP/s).",
        ]
    return "\n".join(lines)


def _ratio(a: float, b: float | str) -> float | str:
    return "n/a" if isinstance(b, str) else a / b


def phase_roofline(phase: str, flops: dict[str, float], policy_rate, value_rate) -> float | str:
    """The roofline FLOP/s of a trainer phase: the policy forward mix for the policy update, the
    value mix for value phases, and for the whole step the time-weighted mix of both,
    total / (policy FLOPs / policy rate + value FLOPs / value rate)."""
    if isinstance(policy_rate, str) or isinstance(value_rate, str):
        return "n/a"
    if phase in ("policy_update", "grpo_step"):
        return policy_rate
    if phase in ("value_phase", "value_step"):
        return value_rate
    secs = flops["policy_update"] / policy_rate + flops["value_phase"] / value_rate
    return (flops["policy_update"] + flops["value_phase"]) / secs


def main(argv: list[str] | None = None) -> dict:
    """Parse arguments, measure, print the markdown tables; returns the raw results."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config",
        default=str(ROOT / "examples/configs/quickstart.yaml"),
        help="job YAML (model, precision, algorithm, optimisers); default quickstart",
    )
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_experts=16")
    ap.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="model vocabulary; default min(model.vocab_size, tokenizer.vocab_size): "
        "the trained tokenizer's size, as the trainer shrinks the model to it",
    )
    ap.add_argument("--rows", type=int, default=16, help="rows (trajectories) per train step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per row (no padding)")
    ap.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="rows per micro-batch; default rl.micro_batch_size of the config",
    )
    ap.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="GEMM rows (tokens per micro-batch) of the roofline shapes; default "
        "micro-batch-size x seq-len",
    )
    ap.add_argument("--steps", type=int, default=3, help="timed train steps (after warm-up)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up train steps")
    ap.add_argument(
        "--min-run-time",
        type=float,
        default=0.5,
        help="seconds of blocked_autorange per GEMM shape and backend",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-trainer", action="store_true", help="only the roofline")
    ap.add_argument(
        "--count-targets-forward",
        action="store_true",
        help="count the no-grad value forward before the value updates (the SAO step of code "
        "before issue 16 ran it at every lam_value; timing that code, pass this)",
    )
    ap.add_argument(
        "--no-grpo",
        action="store_true",
        help="do not time a GRPO step (PPO-clip, groups of algorithm.grpo.group_size rows) "
        "next to the SAO step",
    )
    ap.add_argument("--json", default=None, metavar="OUT", help="write the raw figures here")
    args = ap.parse_args(argv)

    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    job = load_config(JobConfig, args.config, args.overrides)
    vocab = args.vocab_size or min(job.model.vocab_size, job.tokenizer.vocab_size)
    if vocab != job.model.vocab_size:
        import dataclasses

        job.model = dataclasses.replace(job.model, vocab_size=vocab)
    mbs = args.micro_batch_size or job.rl.micro_batch_size
    for name, v in (("--rows", args.rows), ("--seq-len", args.seq_len), ("--steps", args.steps)):
        if v < 1:
            raise ValueError(f"{name}={v}: must be >= 1")
    if args.rows % mbs:
        raise ValueError(
            f"--rows={args.rows} is not a multiple of the micro-batch size {mbs}: RLStep would "
            "add dummy rows; pick --rows as a multiple of --micro-batch-size"
        )
    if args.seq_len > job.model.max_position_embeddings:
        raise ValueError(
            f"--seq-len={args.seq_len} exceeds model.max_position_embeddings="
            f"{job.model.max_position_embeddings}"
        )
    m = job.model
    tokens = args.tokens or mbs * args.seq_len
    if tokens % args.seq_len:
        raise ValueError(f"--tokens={tokens} must be a multiple of --seq-len={args.seq_len}")
    setup = {
        "config": _rel(args.config),
        "overrides": args.overrides,
        "model": (
            f"hidden {m.hidden_size}, {m.num_hidden_layers} layers, {m.num_attention_heads} "
            f"heads x {m.head_dim} ({m.num_key_value_heads} kv), {m.num_experts} experts top-"
            f"{m.num_experts_per_tok} x ffn {m.moe_intermediate_size}, vocab {m.vocab_size}"
        ),
        "tokens": tokens,
        "rows": args.rows,
        "seq_len": args.seq_len,
        "micro_batch_size": mbs,
        "steps": args.steps,
        "warmup": args.warmup,
        "value_updates": job.algorithm.sao.value_updates_per_policy_update,
    }
    res: dict = {"machine": machine_info(), "setup": setup}

    rows_mb = tokens // args.seq_len
    mixes = {h: model_gemms(m, rows_mb, args.seq_len, h) for h in ("policy", "value")}
    gemms = mixes["policy"] + [mixes["value"][-1]]
    print(f"timing {len(gemms)} GEMM shapes ...", file=sys.stderr)
    rf, rf_best = roofline(gemms, args.min_run_time)
    res["gemms"] = [{**g.__dict__, "flops": g.flops} for g in gemms]
    res["roofline"] = rf
    res["roofline_best_block"] = rf_best
    res["aggregate"] = {h: {b: aggregate(gs, rf[b]) for b in rf} for h, gs in mixes.items()}
    res["aggregate_best_block"] = {
        h: {b: aggregate(gs, rf_best[b]) for b in rf_best} for h, gs in mixes.items()
    }

    res["trainer"] = {}
    if not args.skip_trainer:
        res["trainer"] = _trainer_section(job, args, mbs, res)
    res["machine"]["load_avg_at_end"] = _load()
    text = markdown(res)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**res, "markdown": text}, indent=2))
    return res


def _trainer_section(job, args, mbs: int, res: dict) -> dict:
    """Build the models on 1 rank, time the SAO phases, return the trainer rows."""
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    parallel = initialize_parallel(ParallelConfig(seed=job.parallel.seed))
    try:
        print("building models and a synthetic batch ...", file=sys.stderr)
        group = 1 if args.no_grpo else job.algorithm.grpo.group_size
        if args.rows % group:
            raise ValueError(
                f"--rows={args.rows} is not a multiple of algorithm.grpo.group_size={group}: "
                "pick --rows as a multiple of it, or --no-grpo"
            )
        policy, value, step, batch = build_trainer(
            job, parallel, args.rows, args.seq_len, mbs, group_size=group
        )
        grpo = None if args.no_grpo else build_grpo_step(job, parallel, policy, mbs)
        what_runs = "SAO" if grpo is None else "SAO and GRPO"
        print(f"timing {args.warmup}+{args.steps} {what_runs} steps ...", file=sys.stderr)
        times = time_trainer(step, batch, args.steps, args.warmup, grpo=grpo)
    finally:
        destroy_parallel()
    pf = trainable_fractions(
        [(n, p) for c in policy.unwrapped for n, p in c.named_parameters()],
        job.model.tie_word_embeddings,
    )
    vf = trainable_fractions([(n, p) for c in value.unwrapped for n, p in c.named_parameters()])
    k = job.algorithm.sao.value_updates_per_policy_update
    # synthetic rows: none truncated, so only lam_value != 1 needs the targets forward
    targets_fwd = job.algorithm.sao.lam_value != 1.0 or args.count_targets_forward
    fl = step_flops(job.model, args.rows, args.seq_len, k, pf, vf, targets_fwd)
    fl["grpo_step"] = grpo_step_flops(job.model, args.rows, args.seq_len, pf)
    device = parallel.platform.device.type
    dtype = job.precision.params_dtype
    ref_name = f"{device}_{dtype}"
    setup = res["setup"]
    setup.update(trainer_device=device, trainer_dtype=dtype, trainer_roofline=ref_name)
    what = {
        "train_step": "SAO RLStep.train_step (value phase + policy update)",
        "value_phase": (
            f"time/value + time/advantages: {k + 1 + targets_fwd} value fwd + {k} value bwd"
        ),
        "policy_update": "time/policy: 1 policy fwd + bwd + optimiser step",
        "value_step": (
            f"RLStep.value_step (value pre-training step): {k + targets_fwd} value fwd + "
            f"{k} value bwd"
        ),
        "grpo_step": "GRPO RLStep.train_step: 1 policy fwd (old log-probs) + policy update",
    }
    agg = res["aggregate"]
    out = {}
    for name, secs in times.items():
        med = statistics.median(secs)
        rate = fl[name] / med
        refs = {}
        for dt in (dtype, "bf16"):
            rp, rv = (agg[mix].get(f"{device}_{dt}", "n/a") for mix in ("policy", "value"))
            refs[dt] = phase_roofline(name, fl, rp, rv)
        out[name] = {
            "what": what[name],
            "flops": fl[name],
            "seconds": {"median": med, "min": min(secs), "max": max(secs), "all": secs},
            "flops_per_s": rate,
            "roofline_flops_per_s": refs[dtype],
            "mfu": _ratio(rate, refs[dtype]),
            "mfu_bf16": _ratio(rate, refs["bf16"]),
        }
    res["trainable_fractions"] = {"policy": pf, "value": vf}
    if "grpo_step" in out:
        res["sao_over_grpo"] = {
            "seconds": out["train_step"]["seconds"]["median"]
            / out["grpo_step"]["seconds"]["median"],
            "flops": fl["train_step"] / fl["grpo_step"],
        }
    return out


if __name__ == "__main__":
    main()
