"""Reference log-probs of a Hugging Face causal LM in fp32 (run with the vLLM venv's Python).

Reads JSON from stdin: {"model_dir": str, "weights": str | null, "temperature": float,
"items": [{"prompt": [int], "completion": [int]}]} and prints {"logprobs": [[float]]}: for each
item, log softmax(logits / temperature)[completion token] at each completion position, computed
by transformers in float32 from the checkpoint in model_dir (optionally with the tensors of the
safetensors file `weights` loaded over it). Used by the vLLM integration tests as the trainer-side
recomputation the behaviour log-probs must match.
"""

import json
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main() -> None:
    req = json.load(sys.stdin)
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(req["model_dir"], dtype=torch.float32).eval()
    if req.get("weights"):
        missing, unexpected = model.load_state_dict(load_file(req["weights"]), strict=False)
        assert not unexpected, unexpected
    temperature = float(req.get("temperature", 1.0))
    out = []
    with torch.no_grad():
        for item in req["items"]:
            prompt, completion = item["prompt"], item["completion"]
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0].double()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
            out.append(logp[pos, torch.tensor(completion)].tolist())
    json.dump({"logprobs": out}, sys.stdout)


if __name__ == "__main__":
    main()
