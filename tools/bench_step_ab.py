"""A/B timing of the SAO train step, interleaved so that load drifts hit both sides alike.

Variants, each an ``RLStep.train_step`` on the same synthetic batch as ``tools/bench_mfu.py``:

* ``targets_forward``: the step as before issue 16 -- a no-grad value forward for V_old before
  the value updates (forced by ``algorithm.value_targets -> None``; bit-identical results, see
  tests/trainer/test_rl_step.py);
* ``no_targets_forward``: V_old from the first value update's forward (the default at
  ``algorithm.sao.lam_value = 1``);

each in every ``--dtypes`` precision (one trainer per precision). Repeat r runs every variant
once, in rotated order; the table gives the median [min, max] seconds per phase over the repeats
and the ratio of medians to the first variant. On a loaded machine only the interleaved
ratios mean something; absolute seconds do not.

    python tools/bench_step_ab.py --repeats 7 --dtypes fp32 bf16 --json runs/step_ab.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "examples/configs/quickstart.yaml"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tools"))
    sys.path.insert(0, str(ROOT))
    import bench_mfu

    from sao_megatron.configs import load_config
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel
    from sao_megatron.trainer.job import JobConfig

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    parallel = initialize_parallel(ParallelConfig())
    steps = {}
    for dt in args.dtypes:
        job = load_config(JobConfig, args.config, [f"precision.params_dtype={dt}"])
        vocab = min(job.model.vocab_size, job.tokenizer.vocab_size)

        job.model = dataclasses.replace(job.model, vocab_size=vocab)
        mbs = job.rl.micro_batch_size
        _, _, step, batch = bench_mfu.build_trainer(job, parallel, args.rows, args.seq_len, mbs)
        steps[dt] = (step, batch)
    variants = [(dt, fwd) for dt in args.dtypes for fwd in (True, False)]
    times: dict[str, dict[str, list[float]]] = {}
    load_before = os.getloadavg()
    for r in range(args.repeats + 1):  # repeat 0 is the warm-up
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for dt, fwd in order:
            step, batch = steps[dt]
            original = step.algorithm.value_targets
            if fwd:
                step.algorithm.value_targets = lambda inputs: None
            try:
                t0 = time.perf_counter()
                m = step.train_step(batch, train_version=r)
                total = time.perf_counter() - t0
            finally:
                step.algorithm.value_targets = original
            if r == 0:
                continue
            name = f"{dt}/{'targets_forward' if fwd else 'no_targets_forward'}"
            rec = times.setdefault(name, {"train_step": [], "value_phase": [], "policy": []})
            rec["train_step"].append(total)
            rec["value_phase"].append(m["time/value"] + m["time/advantages"])
            rec["policy"].append(m["time/policy"])
    destroy_parallel()
    names = [f"{dt}/{'targets_forward' if f else 'no_targets_forward'}" for dt, f in variants]
    first = names[0]
    lines = [
        f"| variant | train_step s | value phase s | policy update s | step vs {first} |",
        "|---|---|---|---|---|",
    ]

    def fmt(xs):
        return f"{statistics.median(xs):.3f} [{min(xs):.3f}, {max(xs):.3f}]"

    for name in names:
        rec = times[name]
        ratio = statistics.median(rec["train_step"]) / statistics.median(times[first]["train_step"])
        lines.append(
            f"| {name} | {fmt(rec['train_step'])} | {fmt(rec['value_phase'])} | "
            f"{fmt(rec['policy'])} | {ratio:.3f} |"
        )
    load = f"load average before {load_before}, after {os.getloadavg()}"
    text = "\n".join(lines) + f"\n\n{args.repeats} interleaved repeats; {load}"
    print(text)
    res = {"times": times, "markdown": text, "args": vars(args)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
