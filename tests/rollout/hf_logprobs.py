"""Reference log-probs of a Hugging Face causal LM in fp32 (run with the vLLM venv's Python).

Reads JSON from stdin: {"model_dir": str, "temperature": float,
"top_p": float, "items": [{"prompt": [int], "completion": [int]}]} and prints
{"logprobs": [[float]]}: for each item, the log-prob of each completion token under the sampling
distribution — softmax(logits / temperature) restricted to the top-p nucleus (the smallest set of
most likely tokens whose probability reaches top_p, as vLLM's sampler keeps it) and renormalised —
with logits from transformers in float32 for the checkpoint in model_dir, softmax in
float64.
The vLLM integration tests use it as the trainer-side recomputation.
"""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    req = json.load(sys.stdin)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32).eval()
    temperature = float(req.get("temperature", 1.0))
    top_p = float(req.get("top_p", 1.0))
    out = []
    with torch.no_grad():
        for item in req["items"]:
            prompt, completion = item["prompt"], item["completion"]
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0].double()
            scaled = logits / temperature
            if top_p < 1.0:  # vLLM: drop the ascending-sorted prefix whose mass is <= 1 - top_p
                srt, idx = scaled.sort(dim=-1)
                drop = srt.softmax(-1).cumsum(-1) <= 1 - top_p
                drop[:, -1] = False
                scaled = scaled.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
            logp = torch.log_softmax(scaled, dim=-1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
            out.append(logp[pos, torch.tensor(completion)].tolist())
    json.dump({"logprobs": out}, sys.stdout)


if __name__ == "__main__":
    main()
