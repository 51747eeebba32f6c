"""Reference router top-k of a Hugging Face MoE causal LM in fp32 (run with the vLLM venv's
Python): reads {"model_dir": str, "sequences": [[int]]} from stdin and prints {"topk":
[[[[int]]]]}: per sequence, position, layer, the experts of the router's top-k (transformers'
``output_router_logits``; Qwen3-MoE picks the top-k of softmax(router logits))."""

import json
import sys

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    req = json.load(sys.stdin)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    out = []
    with torch.no_grad():
        for seq in req["sequences"]:
            res = model(input_ids=torch.tensor([seq]), output_router_logits=True)
            layers = [lg.reshape(len(seq), -1).topk(k, dim=-1).indices for lg in res.router_logits]
            out.append(torch.stack(layers, dim=1).tolist())  # [T, L, k]
    json.dump({"topk": out}, sys.stdout)


if __name__ == "__main__":
    main()
