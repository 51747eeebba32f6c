"""The routing-replay test case: routing is the only difference between trainer and reference.

The recorded experts come from a model whose routers are perturbed (as an engine's different
kernels or precision would flip near-ties), the reference log-probs from the *unperturbed*
weights forced to route as recorded (`tests.routing.reference.forward64`, float64). A trainer
with the unperturbed weights then differs from the reference only where its own top-k differs
from the recorded one.
"""

from __future__ import annotations

import torch

from tests.routing.reference import forward64, logprobs64

SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
B, T = 4, 16


def hf_weights(chunk, model_cfg) -> dict[str, torch.Tensor]:
    """HF-named tensors of a full (1-rank) Megatron policy chunk."""
    from sao_megatron.convert.model_io import megatron_to_hf_tensors
    from sao_megatron.convert.spec import ConversionSpec

    spec = ConversionSpec.from_hf_config(model_cfg.to_hf_config(**SPECIAL_IDS))
    return {k: v.detach().clone() for k, v in megatron_to_hf_tensors(chunk, spec)}


def make_case(hf: dict[str, torch.Tensor], model_cfg, noise_scale: float = 0.5) -> dict:
    """ids [B, T]; recorded [B, T, L, k] uint8 and mask [B, T] (last position unrecorded, as the
    engine never forwards the last sampled token); ref_lp / natural_lp [B, T-1] float64 (forced
    to the recorded / the model's own routing); flip_frac: share of recorded (token, layer)
    decisions that differ from the unperturbed model's own."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, model_cfg.vocab_size, (B, T), generator=g)
    noise = {}
    for layer in range(model_cfg.num_hidden_layers):
        gate = hf[f"model.layers.{layer}.mlp.gate.weight"]
        noise[layer] = noise_scale * gate.std() * torch.randn(gate.shape, generator=g)
    with torch.no_grad():
        _, recorded, _ = forward64(hf, model_cfg, ids, router_noise=noise)
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[:, -1] = False
        logits_r, _, own_replayed = forward64(hf, model_cfg, ids, routing=(recorded, mask))
        logits_n, natural, _ = forward64(hf, model_cfg, ids)

    def flips(a, b):  # [B, T, L] where the expert sets differ
        return (a.sort(-1).values != b.sort(-1).values).any(-1)

    differs = flips(recorded, natural)
    flip = float(differs[mask].double().mean())
    return {
        "ids": ids,
        "recorded": recorded.to(torch.uint8),
        "mask": mask,
        "ref_lp": logprobs64(logits_r, ids),
        "natural_lp": logprobs64(logits_n, ids),
        "flip_frac": flip,
        "num_flips": int(differs[mask].sum()),
        "differs_any": differs.any(-1) & mask,  # [B, T]: some layer's experts differ
        # the routers' own choice on the inputs of the replayed forward vs the recorded one
        "num_flips_replayed": int(flips(recorded, own_replayed)[mask].sum()),
    }
