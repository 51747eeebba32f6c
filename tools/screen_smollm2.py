"""Quick difficulty screen of an HF chat model on reasoning-gym tasks, with transformers.

    .venv/bin/python tools/screen_smollm2.py --num 64 --max-new-tokens 24 \
        --task '["chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}]'

Per task: `--num` questions (reasoning-gym seed `--seed`) + "Reply with only the final answer."
as one user message through the model's chat template (its default system message), sampled
once at temperature 1 (top_p 1) and once greedily, up to `--max-new-tokens`, cut at the first
<|im_end|>, scored with the last-number reward. Prints one JSON line per task: T1 success rate,
its standard error sqrt(p(1-p)/n), greedy success rate, seconds. A screen only: the trainer's
held-out evaluation (vLLM, `tasks.eval_seed`) is the measurement. `--show N` also prints the
first N greedy replies (question, gold, reply, reward), e.g. to read what RL changed:

    .venv/bin/python tools/screen_smollm2.py --model runs/smollm2_sao/hf_policy_final \
        --tokenizer .cache/models/SmolLM2-135M-Instruct --show 6 --task '["chain_sum", {...}]'
"""

from __future__ import annotations

import argparse
import json
import time

import reasoning_gym
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sao_megatron.envs.rewards import last_number_reward

INSTRUCTION = "\nReply with only the final answer."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=".cache/models/SmolLM2-135M-Instruct")
    ap.add_argument("--task", action="append", required=True, help='["dataset", {knobs}]')
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=12345)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokenizer", help="tokenizer folder (default: --model)")
    ap.add_argument("--show", type=int, default=0, help="print the first N greedy replies")
    args = ap.parse_args()
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for text in args.task:
        name, knobs = json.loads(text)
        ds = reasoning_gym.create_dataset(name, seed=args.seed, size=args.num, **knobs)
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": e["question"] + INSTRUCTION}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for e in ds
        ]
        t0, sampled, greedy = time.time(), [], []
        for i in range(0, args.num, args.batch):
            enc = tok(
                prompts[i : i + args.batch],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
                return_token_type_ids=False,
            )
            for do_sample, acc in ((True, sampled), (False, greedy)):
                kw = {"temperature": 1.0, "top_p": 1.0} if do_sample else {}
                with torch.no_grad():
                    out = model.generate(
                        **enc,
                        max_new_tokens=args.max_new_tokens,
                        do_sample=do_sample,
                        pad_token_id=eos,
                        eos_token_id=eos,
                        **kw,
                    )
                for j, row in enumerate(out[:, enc["input_ids"].shape[1] :]):
                    reply = tok.decode(row).split("<|im_end|>")[0]
                    gold = str(ds[i + j]["answer"])
                    acc.append(last_number_reward(reply, gold))
                    if not do_sample and i + j < args.show:
                        q = ds[i + j]["question"]
                        shown = {"question": q, "gold": gold, "reply": reply, "reward": acc[-1]}
                        print(json.dumps(shown), flush=True)
        p, n = sum(sampled) / args.num, args.num
        row = {"task": name, "difficulty": knobs, "n": n, "T1": p, "se": (p * (1 - p) / n) ** 0.5}
        row |= {"greedy": sum(greedy) / n, "seconds": round(time.time() - t0)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
