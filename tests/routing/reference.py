"""A float64 Qwen3-MoE forward in plain torch (the Hugging Face ``Qwen3MoeForCausalLM`` math,
transformers 4.57 ``modeling_qwen3_moe.py``) whose top-k routing can be forced per token.

Independent of Megatron: the routing-replay tests compare the trainer's log-probs with it.
"""

from __future__ import annotations

import torch


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[..., None].double() * inv  # [B, T, d/2]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos()[:, :, None, :], emb.sin()[:, :, None, :]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def forward64(hf: dict[str, torch.Tensor], cfg, ids: torch.Tensor, routing=None, router_noise=None):
    """Logits [B, T, V] float64, the routing used and each router's own top-k on its input
    ([B, T, L, k] int64 both; they differ only where `routing` forced other experts).

    Args:
        hf: HF-named weights of a Qwen3-MoE (`megatron_to_hf_tensors` of the model).
        cfg: `MoEModelConfig` (no dense layers, no shared expert).
        ids: [B, T] token ids, positions 0..T-1, causal attention, no padding.
        routing: None (each router picks its own top-k) or ([B, T, L, k] experts, [B, T] bool
            where to force them); gate weights are always softmax(router logits) over the
            chosen experts (norm_topk_prob).
        router_noise: {layer: [E, H] tensor} added to the router weights (to make a differently
            routing model).
    """
    w = {k: v if v.dtype == torch.float64 else v.double() for k, v in hf.items()}
    b, t = ids.shape
    h = w["model.embed_tokens.weight"][ids]
    pos = torch.arange(t).expand(b, t)
    nh, nkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    hd = cfg.head_dim or cfg.hidden_size // nh
    k_top = cfg.num_experts_per_tok
    used = torch.zeros(b, t, cfg.num_hidden_layers, k_top, dtype=torch.long)
    own = torch.zeros_like(used)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        x = _rms(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).view(b, t, nh, hd)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).view(b, t, nkv, hd)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, t, nkv, hd)
        q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd**0.5
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, nh * hd)
        h = h + o @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = w[p + "mlp.gate.weight"]
        if router_noise is not None:
            gate = gate + router_noise[layer].double()
        logits = x @ gate.T  # [B, T, E]
        top = logits.topk(k_top, dim=-1).indices
        own[:, :, layer] = top
        if routing is not None:
            forced, where = routing
            top = torch.where(where[..., None], forced[:, :, layer, :].long(), top)
        used[:, :, layer] = top
        gw = logits.gather(-1, top).softmax(-1)  # softmax over the chosen experts
        y = torch.zeros_like(x)
        for j in range(k_top):
            for e in range(cfg.num_experts):
                sel = top[..., j] == e
                if not sel.any():
                    continue
                q_ = p + f"mlp.experts.{e}."
                xe = x[sel]
                fe = torch.nn.functional.silu(xe @ w[q_ + "gate_proj.weight"].T) * (
                    xe @ w[q_ + "up_proj.weight"].T
                )
                y[sel] += gw[..., j][sel][:, None] * (fe @ w[q_ + "down_proj.weight"].T)
        h = h + y
    h = _rms(h, w["model.norm.weight"], eps)
    return h @ w["lm_head.weight"].T, used, own


def logprobs64(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0):
    """[B, T-1] log pi(ids[:, t+1] | ids[:, :t+1]) in float64."""
    lp = (logits[:, :-1] / temperature).log_softmax(-1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]
