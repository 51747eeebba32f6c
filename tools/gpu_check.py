"""GPU check: one short run (< 8 minutes on one H200) of what the CPU machines cannot test.

Checks, in order, each timed and recorded in one JSON (``--out``); a failing check records its
error and the next one still runs (exit code 1 if any failed):

1. ``environment``: torch / CUDA / NCCL / Transformer Engine / Megatron-Core versions, the GPU
   and its compute capability.
2. ``nccl_1gpu``: the trainer's own process-group set-up (``initialize_parallel``, NCCL backend
   on CUDA) with one rank, then ``all_reduce`` and ``broadcast`` of a CUDA tensor checked exactly.
3. ``te_bf16``: the policy built from the Transformer Engine specs in bf16 (fp32 master weights),
   one forward/backward of a right-padded batch: finite log-probs/entropy, loss, gradient norm,
   tokens per second.
4. ``te_fp8`` (compute capability >= 9.0, Hopper): the same with ``precision.fp8=true``
   (hybrid E4M3/E5M2, delayed scaling); the log-probs against the bf16 run's (max/mean
   absolute difference in nats) on the same weights and batch.
5. ``sao_step``: one SAO ``RLStep.train_step`` (policy + critic, bf16) on a synthetic on-policy
   batch: the step's metrics (ratio deviation must be ~0 on on-policy data), seconds per step,
   peak CUDA memory.
6. ``mfu_bench``: ``tools/bench_mfu.py`` in a subprocess (bf16, the quickstart model; its JSON is
   embedded), with a time limit.

Usage (on the GPU machine, from the repository root):

    python tools/gpu_check.py --out runs/gpu_check.json

``--dry-run`` checks the prerequisites (CUDA, imports) and prints the plan without running the
checks. Without CUDA both modes stop at once with exit code 2 and one line on stderr
("gpu_check: ..."), never a traceback (tests/tools/test_gpu_check.py runs it on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_NO_CUDA = 2
CHECKS = ("environment", "nccl_1gpu", "te_bf16", "te_fp8", "sao_step", "mfu_bench")


class CheckUnavailable(RuntimeError):
    """A prerequisite is missing: the script cannot run here (exit code 2, one line)."""


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
        raise CheckUnavailable(f"megatron.core does not import ({e})") from e
    try:
        import transformer_engine as te

        te_version = te.__version__
    except ImportError as e:
        te_version = f"not importable ({e})"
    cap = torch.cuda.get_device_capability(0)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "megatron_core": mcore.__version__,
        "transformer_engine": te_version,
        "gpu": torch.cuda.get_device_name(0),
        "num_gpus": torch.cuda.device_count(),
        "compute_capability": f"{cap[0]}.{cap[1]}",
        "fp8_capable": cap >= (9, 0),
    }


def _job(overrides: list[str]):
    """The quickstart job config (model, precision, algorithm) with `overrides`."""
    from sao_megatron.configs import load_config
    from sao_megatron.trainer.job import JobConfig

    job = load_config(JobConfig, str(ROOT / "examples/configs/quickstart.yaml"), overrides)
    return job


def _batch(vocab: int, rows: int, seq_len: int, seed: int = 0):
    import torch

    from sao_megatron.models import ModelInputs

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, seq_len), generator=g)
    mask = torch.ones(rows, seq_len, dtype=torch.bool)
    mask[rows // 2 :, seq_len - seq_len // 4 :] = False  # right padding on half the rows
    return ModelInputs(input_ids=ids, attention_mask=mask)


def _policy_pass(parallel, precision: str, fp8: bool, rows: int, seq_len: int, state=None):
    """Build (or reuse `state`'s weights) a TE-spec policy, one forward/backward; figures."""
    import torch

    from sao_megatron.models import build_policy, compute_policy_logprobs, forward_backward
    from sao_megatron.optim.config import PrecisionConfig

    job = _job([f"precision.params_dtype={precision}", f"precision.fp8={str(fp8).lower()}"])
    prec = PrecisionConfig(params_dtype=precision, fp8=fp8)
    prec.check_platform(parallel.platform.is_cuda, parallel.platform.use_te)
    if not parallel.platform.use_te:
        raise RuntimeError("Transformer Engine does not import: the TE specs cannot be built")
    torch.manual_seed(0)
    model = build_policy(job.model, parallel, prec)
    if state is not None:
        for chunk, sd in zip(model, state, strict=True):
            chunk.load_state_dict(sd, strict=False)
    batch = _batch(job.model.vocab_size, rows, seq_len)
    mask = batch.attention_mask[:, 1:].to(parallel.platform.device)

    def loss_fn(outputs, mb):
        m = mb.attention_mask[:, 1:].bool()
        return -(outputs["logprobs"] * m).sum() / m.sum().clamp(min=1), {}

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    recs = forward_backward(
        model, parallel, batch, kind="policy", loss_fn=loss_fn, micro_batch_size=rows // 2
    )
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    grads = [p.grad for c in model for p in c.parameters() if p.grad is not None]
    main = [getattr(p, "main_grad", None) for c in model for p in c.parameters()]
    gsq = sum(float(g.float().pow(2).sum()) for g in grads + [m for m in main if m is not None])
    lp, ent = compute_policy_logprobs(model, parallel, batch, 1.0, rows // 2)
    finite = bool(torch.isfinite(lp[mask]).all() and torch.isfinite(ent[mask]).all())
    if not finite:
        raise RuntimeError(f"{precision}{' fp8' if fp8 else ''}: non-finite log-probs")
    out = {
        "params_dtype": str(next(model[0].parameters()).dtype),
        "loss": sum(float(r["loss"]) for r in recs),
        "grad_norm": gsq**0.5,
        "fwd_bwd_seconds": secs,
        "tokens_per_second": rows * seq_len / secs,
        "mean_logprob": float(lp[mask].mean()),
    }
    return out, lp[mask].float().cpu(), [c.state_dict() for c in model]


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
    ok = bool(torch.equal(x.cpu(), torch.arange(1024, dtype=torch.float32)))
    if not ok:
        raise RuntimeError("all_reduce/broadcast over 1 rank changed the tensor")
    return {
        "backend": "nccl",
        "world_size": dist.get_world_size(),
        "seconds": time.perf_counter() - t0,
    }


def check_sao_step(parallel, rows: int, seq_len: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tools"))
    import bench_mfu

    job = _job(["precision.params_dtype=bf16"])
    _, _, step, batch = bench_mfu.build_trainer(job, parallel, rows, seq_len, rows // 2)
    step.train_step(batch, train_version=0)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = step.train_step(batch, train_version=1)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    dev = m["deviation/abs_one_minus_ratio_mean"]
    if not dev < 0.05:  # behaviour = the policy before the step: the ratio is ~1 (bf16)
        raise RuntimeError(f"on-policy |1 - r| = {dev}: trainer log-probs disagree with themselves")
    keep = ("loss/", "grad_norm/", "deviation/", "value/", "time/")
    return {
        "seconds_per_step": secs,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "metrics": {k: float(v) for k, v in m.items() if k.startswith(keep)},
    }


def check_mfu(out_dir: Path, timeout_s: int) -> dict:
    path = out_dir / "gpu_check_bench_mfu.json"
    cmd = [
        sys.executable,
        str(ROOT / "tools/bench_mfu.py"),
        "--config",
        str(ROOT / "examples/configs/quickstart.yaml"),
        "--rows",
        "16",
        "--seq-len",
        "256",
        "--steps",
        "3",
        "--min-run-time",
        "0.2",
        "--json",
        str(path),
        "precision.params_dtype=bf16",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if proc.returncode:
        raise RuntimeError(f"bench_mfu exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    res = json.loads(path.read_text())
    return {"command": " ".join(cmd), "trainer": res["trainer"], "aggregate": res["aggregate"]}


def run(args) -> int:
    """All checks; writes args.out after each one. Returns the exit code (0 all passed)."""
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"checks": {}, "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}

    def record(name: str, fn) -> object:
        t0 = time.perf_counter()
        try:
            value = fn()
            entry = {"ok": True, "result": value}
        except Exception as e:  # noqa: BLE001 - a check's failure is data, the next one runs
            value = None
            entry = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            entry["traceback"] = traceback.format_exc(limit=8)
        entry["seconds"] = time.perf_counter() - t0
        report["checks"][name] = entry
        out_path.write_text(json.dumps(report, indent=2, default=str))
        status = "ok" if entry["ok"] else f"FAILED ({entry['error'][:200]})"
        print(f"gpu_check: {name}: {status} [{entry['seconds']:.1f} s]", flush=True)
        return value

    env = record("environment", _prerequisites)
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    parallel = record("nccl_1gpu_init", lambda: initialize_parallel(ParallelConfig()))
    try:
        if parallel is not None:
            record("nccl_1gpu", lambda: check_nccl(parallel))
            kept: dict = {}

            def bf16():
                out, kept["logprobs"], kept["state"] = _policy_pass(parallel, "bf16", False, 8, 512)
                return out

            record("te_bf16", bf16)
            if env and env["fp8_capable"] and kept:

                def fp8():
                    out, lp8, _ = _policy_pass(parallel, "bf16", True, 8, 512, kept["state"])
                    diff = (lp8 - kept["logprobs"]).abs()
                    return out | {
                        "logprob_vs_bf16_max_abs": float(diff.max()),
                        "logprob_vs_bf16_mean_abs": float(diff.mean()),
                    }

                record("te_fp8", fp8)
            else:
                reason = "compute capability < 9.0" if kept else "te_bf16 failed"
                report["checks"]["te_fp8"] = {"ok": bool(kept), "skipped": reason}
            record("sao_step", lambda: check_sao_step(parallel, 16, 256))
    finally:
        if parallel is not None:
            destroy_parallel()
    record("mfu_bench", lambda: check_mfu(out_path.parent, args.bench_timeout))
    out_path.write_text(json.dumps(report, indent=2, default=str))
    failed = [k for k, v in report["checks"].items() if not v["ok"]]
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all passed'} -> {out_path}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/gpu_check.json", help="JSON of the figures")
    ap.add_argument("--dry-run", action="store_true", help="prerequisites and plan only")
    ap.add_argument(
        "--bench-timeout", type=int, default=240, help="seconds allowed to tools/bench_mfu.py"
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    try:
        env = _prerequisites()
    except CheckUnavailable as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return EXIT_NO_CUDA
    if args.dry_run:
        print(json.dumps({"environment": env, "plan": list(CHECKS), "out": args.out}, indent=2))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
