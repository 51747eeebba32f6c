"""GPU check: one short run (<= 8 minutes on one H200) of what the CPU machines cannot test.

Checks, in order, each timed, limited to its budget (`BUDGET_S`) and recorded in one JSON
(``--out``, rewritten after every check); a failing check records its error and the next one
still runs:

1. ``environment``: Python, glibc, torch / CUDA / NCCL / Megatron-Core versions, the GPU and its
   compute capability, which optional packages (Transformer Engine, vLLM) are installed, and
   the import of every module the later checks use (a missing carried wheel fails here).
2. ``nccl_1gpu``: the trainer's own process-group set-up (``initialize_parallel``, NCCL on CUDA)
   with one rank, then ``all_reduce`` and ``broadcast`` of a CUDA tensor checked exactly.
3. ``vllm``: vLLM imports and reports its version and platform (skipped when not installed).
4. ``policy_bf16``: the quickstart policy on Megatron-Core's local (non-TE) specs in bf16, one
   forward/backward of a right-padded batch: finite log-probs and entropy, loss, gradient norm,
   tokens per second, peak memory.
5. ``critic_bf16``: the value model from the policy's trunk, frozen as the trainer freezes it,
   one forward/backward: finite values, no gradient on frozen weights, one on the others.
6. ``te_bf16``, 7. ``te_fp8``: the policy on the Transformer Engine specs in bf16, then with
   ``precision.fp8=true`` (compute capability >= 9.0) against the bf16 log-probs on the same
   weights. Skipped, with the reason recorded, when Transformer Engine is not installed.
8. ``sao_step``: SAO ``RLStep.train_step`` (policy + critic, local specs, bf16) on a synthetic
   on-policy batch of the quickstart model: the first step's metrics (ratio deviation ~0 on
   on-policy data), seconds of a second step, peak memory.
9. ``mfu``: SAO steps of a larger model (`MFU_MODEL`), local specs, bf16: model FLOPs
   (``tools/bench_mfu.py``'s counts) per second against the GPU's bf16 dense spec peak
   (`SPEC_BF16_PEAK`: the H200's 989 TFLOP/s; field ``mfu``) and against a bf16 matmul measured
   here (8192^3, field ``mfu_vs_measured_matmul``; ~790 TFLOP/s seen on the lent H200).

A check is skipped, not run, when its optional package is absent (``skipped``, with the reason),
or when its budget no longer fits before the overall deadline (``--deadline``, from the start of
the script; ``skipped_for_time``). A check that outruns its budget is stopped (``timed_out``).
Exit code: 0 when every check that ran passed and none was skipped for time, 1 when one failed
or timed out, 3 when none failed but some were skipped for time.

Usage (on the GPU machine, from the repository root; Megatron-Core and this package's other
missing dependencies carried as wheels: ``tools/gpu_check_prepare.sh`` prints the whole call):

    python tools/gpu_check.py --out runs/gpu_check.json

``--dry-run`` checks the prerequisites (CUDA, Megatron-Core) and prints the plan without running
the checks. Without CUDA both modes stop at once with exit code 2 and one line on stderr
("gpu_check: ..."), never a traceback (tests/tools/test_gpu_check.py runs it on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "tools")) if p not in sys.path]

from gpu_check_runner import Runner  # noqa: E402

EXIT_NO_CUDA = 2
CHECKS = (
    "environment",
    "nccl_1gpu",
    "vllm",
    "policy_bf16",
    "critic_bf16",
    "te_bf16",
    "te_fp8",
    "sao_step",
    "mfu",
)
#: seconds each check may take on one H200 (first CUDA use and imports included); a check that
#: outruns its budget is stopped, one whose budget no longer fits before the deadline is skipped
BUDGET_S = {
    "environment": 60,
    "nccl_1gpu": 60,
    "vllm": 60,
    "policy_bf16": 60,
    "critic_bf16": 60,
    "te_bf16": 60,
    "te_fp8": 60,
    "sao_step": 90,
    "mfu": 120,
}
#: default overall deadline (s from the start): 7 minutes, inside the 8 the lent machine allows
DEADLINE_S = 420
#: optional packages: import name -> distribution name (its version is read from the latter)
OPTIONAL = {"transformer_engine": "transformer-engine", "vllm": "vllm"}
#: what the checks import beyond torch (``environment`` imports them all, so a missing carried
#: wheel fails there, with its name, before anything else runs)
GPU_PATH_MODULES = (
    "megatron.core",
    "omegaconf",
    "sao_megatron.configs",
    "sao_megatron.trainer.job",
    "sao_megatron.trainer.runtime",
    "sao_megatron.trainer.rl_step",
    "sao_megatron.models.builders",
    "sao_megatron.models.forward",
    "sao_megatron.parallel",
    "sao_megatron.data.batch",
    "bench_mfu",
)
#: bf16 dense tensor-core peak (FLOP/s) by a substring of the GPU's name: NVIDIA's H200
#: datasheet gives 1,979 TFLOP/s for bf16 with 2:4 sparsity, half of it dense
SPEC_BF16_PEAK = {"H200": 989e12}
#: the model of the ``mfu`` check (quickstart overrides): ~0.3B parameters, GEMM-sized layers
MFU_MODEL = (
    "model.hidden_size=1024",
    "model.num_hidden_layers=8",
    "model.num_attention_heads=16",
    "model.num_key_value_heads=4",
    "model.head_dim=64",
    "model.num_experts=8",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=1024",
    "model.vocab_size=32768",
    "model.max_position_embeddings=2048",
)
MFU_SHAPE = {"rows": 16, "seq_len": 1024, "micro_batch_size": 8, "steps": 3}


class CheckUnavailable(RuntimeError):
    """A prerequisite is missing: the script cannot run here (exit code 2, one line)."""


# ------------------------------------------------------------------------------ environment
def optional_dependency(module: str) -> dict:
    """``{"version": ...}`` when `module` is installed, ``{"absent": reason}`` when it is not.

    Presence is ``importlib.util.find_spec`` (nothing is imported here); an installed package
    that then fails to import fails its check instead of being skipped.
    """
    if importlib.util.find_spec(module) is None:
        return {"absent": f"{module} is not installed (importlib.util.find_spec is None)"}
    try:
        return {"version": importlib.metadata.version(OPTIONAL.get(module, module))}
    except importlib.metadata.PackageNotFoundError:
        return {"version": "unknown (no distribution metadata)"}


def _prerequisites() -> dict:
    """Versions and the device; raises CheckUnavailable without CUDA or Megatron-Core."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - the project needs torch
        raise CheckUnavailable(f"torch does not import ({e})") from e
    if not torch.cuda.is_available():
        raise CheckUnavailable(
            "CUDA is not available (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}): run tools/gpu_check.py on a machine with an NVIDIA GPU"
        )
    try:
        import megatron.core as mcore
    except ImportError as e:
        raise CheckUnavailable(
            f"megatron.core does not import ({e}): carry its wheel (tools/gpu_check_prepare.sh)"
        ) from e
    cap = torch.cuda.get_device_capability(0)
    return {
        "python": platform.python_version(),
        "glibc": "-".join(platform.libc_ver()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "megatron_core": mcore.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "num_gpus": torch.cuda.device_count(),
        "compute_capability": f"{cap[0]}.{cap[1]}",
        "fp8_capable": cap >= (9, 0),
        "optional": {m: optional_dependency(m) for m in OPTIONAL},
    }


def check_environment() -> dict:
    """`_prerequisites` and the import of `GPU_PATH_MODULES` (seconds)."""
    env = _prerequisites()
    t0 = time.perf_counter()
    for name in GPU_PATH_MODULES:
        importlib.import_module(name)
    return env | {"import_seconds": time.perf_counter() - t0}


def skip_reason(name: str, env: dict | None, statuses: dict[str, str]) -> str | None:
    """Why check `name` does not run on this machine (None: it runs).

    Args:
        env: the ``environment`` check's result (None if that check failed).
        statuses: status of each check run so far (``passed``, ``failed``, ...).
    """
    optional = (env or {}).get("optional") or {m: optional_dependency(m) for m in OPTIONAL}
    if name == "vllm" and "absent" in optional.get("vllm", {}):
        return f"vLLM is absent: {optional['vllm']['absent']}"
    if name in ("te_bf16", "te_fp8") and "absent" in optional.get("transformer_engine", {}):
        absent = optional["transformer_engine"]["absent"]
        return f"Transformer Engine is absent: {absent}; its specs and FP8 cannot be built"
    if name == "te_fp8":
        if env and not env["fp8_capable"]:
            return f"compute capability {env['compute_capability']} < 9.0: no FP8 GEMMs"
        if statuses.get("te_bf16") != "passed":
            return f"te_bf16 did not pass ({statuses.get('te_bf16', 'not run')})"
    return None


def _release_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ checks
def _job(overrides: list[str] | tuple[str, ...]):
    """The quickstart job config (model, precision, algorithm) with `overrides`."""
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    return load_config(JobConfig, str(ROOT / "examples/configs/quickstart.yaml"), list(overrides))


def _batch(vocab: int, rows: int, seq_len: int, seed: int = 0):
    import torch

    from sao_megatron.models import ModelInputs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq_len), generator=g)
    mask = torch.ones(rows, seq_len, dtype=torch.bool)
    mask[rows // 2 :, seq_len - seq_len // 4 :] = False  # right padding on half the rows
    return ModelInputs(input_ids=ids, attention_mask=mask)


def local_specs(parallel):
    """`parallel` with Transformer Engine off: models build from Megatron-Core's local specs."""
    return dataclasses.replace(
        parallel, platform=dataclasses.replace(parallel.platform, use_te=False)
    )


def _sync(parallel) -> None:
    import torch

    if parallel.platform.is_cuda:
        torch.cuda.synchronize()


def _peak_gib(parallel) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if parallel.platform.is_cuda else None


def check_nccl(parallel) -> dict:
    import torch
    import torch.distributed as dist

    if parallel.platform.backend != "nccl":
        raise RuntimeError(f"backend is {parallel.platform.backend!r}, expected 'nccl'")
    x = torch.arange(1024, dtype=torch.float32, device=parallel.platform.device)
    t0 = time.perf_counter()
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    torch.cuda.synchronize()
    if not torch.equal(x.cpu(), torch.arange(1024, dtype=torch.float32)):
        raise RuntimeError("all_reduce/broadcast over 1 rank changed the tensor")
    return {
        "backend": "nccl",
        "world_size": dist.get_world_size(),
        "seconds": time.perf_counter() - t0,
    }


def check_vllm() -> dict:
    import vllm
    from vllm.platforms import current_platform

    return {"version": vllm.__version__, "platform": type(current_platform).__name__}


def _grad_sq(chunks) -> tuple[float, int, int]:
    """(sum of squared gradients, trainable params with a gradient, frozen params with one)."""
    total, trained, frozen_with_grad = 0.0, 0, 0
    for c in chunks:
        for p in c.parameters():
            g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            if p.requires_grad:
                trained += g is not None
                total += float(g.float().pow(2).sum()) if g is not None else 0.0
            elif g is not None:
                frozen_with_grad += 1
    return total, trained, frozen_with_grad


def model_pass(
    parallel,
    kind: str,
    dtype: str = "bf16",
    fp8: bool = False,
    rows: int = 8,
    seq_len: int = 512,
    overrides=(),
    state: dict | None = None,
) -> dict:
    """Build the policy (or the critic from `state`'s policy) and run one forward/backward.

    Args:
        kind: "policy" or "value" (the critic: trunk from ``state["policy"]``, frozen per
            ``value.freeze_patterns``, squared loss against targets of 1: the quickstart's
            value head starts at V = 0).
        state: shared between calls: a policy pass leaves its chunks (``policy``) and masked
            log-probs (``logprobs``) there; a policy pass given ``policy`` loads its weights.
    Returns: the figures (loss, gradient norm, seconds, tokens per second, peak memory).
    Raises: RuntimeError on non-finite outputs or a gradient where none (or no) should be.
    """
    import torch

    from sao_megatron.models import (
        apply_freeze,
        build_policy,
        build_value_model,
        compute_policy_logprobs,
        compute_values,
        forward_backward,
        init_value_from_policy,
    )

    state = {} if state is None else state
    job = _job([f"precision.params_dtype={dtype}", f"precision.fp8={str(fp8).lower()}", *overrides])
    torch.manual_seed(0)
    if kind == "policy":
        model = build_policy(job.model, parallel, job.precision)
        for chunk, old in zip(model, state.get("policy", ()), strict=False):
            chunk.load_state_dict(old.state_dict(), strict=False)
    else:
        model = build_value_model(job.model, parallel, job.precision, job.value.head_init_std)
        for v, p in zip(model, state["policy"], strict=True):
            init_value_from_policy(v, p.state_dict())
        apply_freeze(model, job.value.freeze_patterns, group=parallel.pg_collection.pp)
    batch = _batch(job.model.vocab_size, rows, seq_len)
    mbs = rows // 2
    mask = batch.attention_mask.to(parallel.platform.device)

    def loss_fn(outputs, mb):
        if kind == "policy":
            m = mb.attention_mask[:, 1:].bool()
            return -(outputs["logprobs"] * m).sum() / m.sum().clamp(min=1), {}
        m = mb.attention_mask.bool()
        return ((outputs["values"] - 1.0).pow(2) * m).sum() / m.sum().clamp(min=1), {}

    _sync(parallel)
    t0 = time.perf_counter()
    recs = forward_backward(
        model, parallel, batch, kind=kind, loss_fn=loss_fn, micro_batch_size=mbs
    )
    _sync(parallel)
    secs = time.perf_counter() - t0
    gsq, trained, frozen_with_grad = _grad_sq(model)
    if kind == "policy":
        lp, ent = compute_policy_logprobs(model, parallel, batch, 1.0, mbs)
        out_mask = mask[:, 1:]
        outputs = {"logprobs": lp[out_mask], "entropy": ent[out_mask]}
    else:
        outputs = {"values": compute_values(model, parallel, batch, mbs)[mask]}
    bad = [k for k, v in outputs.items() if not bool(torch.isfinite(v).all())]
    if bad or not gsq > 0 or frozen_with_grad or not trained:  # (not gsq > 0: also NaN)
        raise RuntimeError(
            f"{kind} {dtype}{' fp8' if fp8 else ''}: non-finite {bad}, squared grad norm {gsq}, "
            f"{trained} trained params with a gradient, {frozen_with_grad} frozen with one"
        )
    if kind == "policy":
        state.update(policy=model, logprobs=outputs["logprobs"].float().cpu())
    return {
        "specs": "transformer_engine" if parallel.platform.use_te else "local",
        "params_dtype": str(next(model[0].parameters()).dtype),
        "loss": sum(float(r["loss"]) for r in recs),
        "grad_norm": gsq**0.5,
        "params_with_grad": trained,
        "frozen_params": sum(not p.requires_grad for c in model for p in c.parameters()),
        "fwd_bwd_seconds": secs,
        "tokens_per_second": rows * seq_len / secs,
        "peak_memory_gib": _peak_gib(parallel),
        **{f"mean_{k}": float(v.float().mean()) for k, v in outputs.items()},
    }


def check_te_fp8(parallel, state: dict) -> dict:
    """The TE policy with FP8 on `state`'s bf16 weights; log-probs against the bf16 ones."""
    bf16_lp = state["logprobs"]
    out = model_pass(parallel, "policy", fp8=True, state=state)
    diff = (state["logprobs"] - bf16_lp).abs()
    return out | {
        "logprob_vs_bf16_max_abs": float(diff.max()),
        "logprob_vs_bf16_mean_abs": float(diff.mean()),
    }


def _trainer(parallel, overrides, rows: int, seq_len: int, mbs: int, dtype: str):
    import bench_mfu

    job = _job([f"precision.params_dtype={dtype}", *overrides])
    return job, *bench_mfu.build_trainer(job, parallel, rows, seq_len, mbs)


def check_sao_step(
    parallel, rows: int = 16, seq_len: int = 256, dtype: str = "bf16", overrides=()
) -> dict:
    """One on-policy SAO step (its metrics), then a second one timed."""
    import torch

    _, _, _, step, batch = _trainer(parallel, overrides, rows, seq_len, rows // 2, dtype)
    m = step.train_step(batch, train_version=0)  # behaviour = this policy: the ratio is ~1
    dev = float(m["deviation/abs_one_minus_ratio_mean"])
    if not dev < 0.05:
        raise RuntimeError(f"on-policy |1 - r| = {dev}: trainer log-probs disagree with themselves")
    bad = {k: float(v) for k, v in m.items() if not torch.isfinite(torch.as_tensor(float(v)))}
    if bad:
        raise RuntimeError(f"non-finite step metrics: {bad}")
    _sync(parallel)
    if parallel.platform.is_cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step.train_step(batch, train_version=1)
    _sync(parallel)
    keep = ("loss/", "grad_norm/", "deviation/", "value/", "time/")
    return {
        "rows": rows,
        "seq_len": seq_len,
        "seconds_per_step": time.perf_counter() - t0,
        "peak_memory_gib": _peak_gib(parallel),
        "metrics": {k: float(v) for k, v in m.items() if k.startswith(keep)},
    }


def measured_matmul_flops(device, n: int = 8192, warmup: int = 3, repeats: int = 10) -> float:
    """bf16 ``torch.matmul`` FLOP/s of an n x n x n product on `device`: the mean of `repeats`
    timed products after `warmup` (random data; how the lent H200's ~790 TFLOP/s was read)."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(warmup):
        a @ b
    if a.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if a.is_cuda:
        torch.cuda.synchronize()
    return 2.0 * n**3 * repeats / (time.perf_counter() - t0)


def spec_peak(gpu_name: str) -> tuple[float | None, str]:
    """(bf16 dense spec peak FLOP/s, its name) for `gpu_name`; (None, why) when not known."""
    for key, peak in SPEC_BF16_PEAK.items():
        if key in gpu_name:
            return peak, f"{key} bf16 dense spec peak, {peak / 1e12:g} TFLOP/s (NVIDIA datasheet)"
    return None, f"no bf16 spec peak known for {gpu_name!r} (SPEC_BF16_PEAK)"


def check_mfu(
    parallel,
    overrides=MFU_MODEL,
    rows: int = MFU_SHAPE["rows"],
    seq_len: int = MFU_SHAPE["seq_len"],
    mbs: int = MFU_SHAPE["micro_batch_size"],
    steps: int = MFU_SHAPE["steps"],
    dtype: str = "bf16",
    matmul_n: int = 8192,
) -> dict:
    """SAO train-step model FLOP/s of the `overrides` model; MFU against the spec peak (``mfu``)
    and against a bf16 matmul measured on this device (``mfu_vs_measured_matmul``)."""
    import bench_mfu
    import torch

    job, policy, value, step, batch = _trainer(parallel, overrides, rows, seq_len, mbs, dtype)
    step.train_step(batch, train_version=0)  # warm-up
    secs = []
    for i in range(steps):
        _sync(parallel)
        t0 = time.perf_counter()
        step.train_step(batch, train_version=i + 1)
        _sync(parallel)
        secs.append(time.perf_counter() - t0)
    pf = bench_mfu.trainable_fractions(
        [(n, p) for c in policy.unwrapped for n, p in c.named_parameters()],
        job.model.tie_word_embeddings,
    )
    vf = bench_mfu.trainable_fractions(
        [(n, p) for c in value.unwrapped for n, p in c.named_parameters()]
    )
    k = job.algorithm.sao.value_updates_per_policy_update
    flops = bench_mfu.step_flops(
        job.model, rows, seq_len, k, pf, vf, targets_forward=job.algorithm.sao.lam_value != 1.0
    )["train_step"]
    achieved = flops / statistics.median(secs)
    device = parallel.platform.device
    gpu = torch.cuda.get_device_name(device) if parallel.platform.is_cuda else "cpu"
    peak, peak_name = spec_peak(gpu)
    matmul = measured_matmul_flops(device, n=matmul_n)
    return {
        "model": list(overrides),
        "rows": rows,
        "seq_len": seq_len,
        "micro_batch_size": mbs,
        "seconds_per_step": {"median": statistics.median(secs), "all": secs},
        "model_flops_per_step": flops,
        "achieved_flops_per_s": achieved,
        "mfu": achieved / peak if peak else f"n/a ({peak_name})",
        "mfu_uses": peak_name,
        "measured_matmul_flops_per_s": matmul,
        "mfu_vs_measured_matmul": achieved / matmul,
        "measured_matmul": f"torch.matmul bf16 {matmul_n}^3 on this device, mean of 10 after 3",
        "peak_memory_gib": _peak_gib(parallel),
    }


# ------------------------------------------------------------------------------ driver
def run(args, start: float | None = None) -> int:
    """All checks; writes args.out after each one. Returns the exit code (`Runner.exit_code`)."""
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    runner = Runner(out_path, args.deadline, BUDGET_S, start=start, after_each=_release_memory)
    env = runner.run("environment", check_environment)
    ctx: dict = {}

    def nccl():
        from sao_megatron.parallel import ParallelConfig, initialize_parallel

        ctx["parallel"] = initialize_parallel(ParallelConfig())
        return check_nccl(ctx["parallel"])

    if env is not None:
        runner.run("nccl_1gpu", nccl)
    runner.run("vllm", check_vllm, skip_reason("vllm", env, runner.statuses()))
    parallel = ctx.get("parallel")
    try:
        if parallel is not None:
            local, te_state, state = local_specs(parallel), {}, {}
            runner.run("policy_bf16", lambda: model_pass(local, "policy", state=state))
            if "policy" in state:
                runner.run("critic_bf16", lambda: model_pass(local, "value", state=state))
            state.clear()
            runner.run(
                "te_bf16",
                lambda: model_pass(parallel, "policy", state=te_state),
                skip_reason("te_bf16", env, runner.statuses()),
            )
            runner.run(
                "te_fp8",
                lambda: check_te_fp8(parallel, te_state),
                skip_reason("te_fp8", env, runner.statuses()),
            )
            te_state.clear()
            runner.run("sao_step", lambda: check_sao_step(local))
            runner.run("mfu", lambda: check_mfu(local))
    finally:
        if parallel is not None:
            from sao_megatron.parallel import destroy_parallel

            destroy_parallel()
    for name in CHECKS:  # checks that could not start (a prerequisite check failed)
        if name not in runner.report["checks"]:
            why = skip_reason(name, env, runner.statuses()) or "a check it needs did not pass"
            runner.run(name, lambda: None, skip=why)
    runner.write()
    summary = runner.summary()
    bad = summary["failed"] + summary["timed_out"]
    word = {0: "all passed", 1: f"FAILED: {', '.join(bad)}"}.get(
        runner.exit_code(),
        f"INCOMPLETE, skipped for time: {', '.join(summary['skipped_for_time'])}",
    )
    print(f"gpu_check: {word} -> {out_path}", flush=True)
    return runner.exit_code()


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/gpu_check.json", help="JSON of the figures")
    ap.add_argument("--dry-run", action="store_true", help="prerequisites and plan only")
    ap.add_argument(
        "--deadline",
        type=float,
        default=DEADLINE_S,
        help="seconds from the start after which no check starts (each needs its whole budget)",
    )
    args = ap.parse_args(argv)
    try:
        env = _prerequisites()
    except CheckUnavailable as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return EXIT_NO_CUDA
    if args.dry_run:
        would = {"te_bf16": "passed"}  # the plan assumes te_bf16 passes before te_fp8
        plan = {n: skip_reason(n, env, would) or f"runs (budget {BUDGET_S[n]} s)" for n in CHECKS}
        print(
            json.dumps(
                {"environment": env, "plan": plan, "deadline_s": args.deadline, "out": args.out},
                indent=2,
            )
        )
        return 0
    return run(args, start=start)


if __name__ == "__main__":
    sys.exit(main())
