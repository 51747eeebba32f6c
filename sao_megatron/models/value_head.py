"""The value model's scalar head V(s_t) = w . h_t + b (replaces the output layer)."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer import MegatronModule, TransformerConfig


class ValueHead(MegatronModule):
    """Scalar value head V(s_t) = w . h_t + b on the final-norm hidden states.

    Replicated on every TP rank. With sequence parallel the hidden states are first gathered
    along the sequence (backward: each rank keeps its own slice, no sum, so the replicated head
    sees the full gradient exactly once).

    Call signature mirrors Megatron's output layer: ``(hidden [s(/tp), b, h], weight=None,
    runtime_gather_output=None) -> (values [s, b, 1], None)``.

    Parameters are ``weight [1, h]`` and ``bias [1]`` (state-dict keys ``output_layer.weight``
    and ``output_layer.bias``, which Megatron's ``LanguageModule.sharded_state_dict`` expects on
    the last stage; dist_checkpointing stores them replicated).
    """

    def __init__(self, config: TransformerConfig, init_std: float, seed: int = 0) -> None:
        super().__init__(config=config)
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.empty(1, dtype=dtype))
        self.init_std = init_std
        self.seed = seed
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Explicit init: weight ~ N(0, init_std^2) from a generator seeded by ``seed`` (the
        same on every rank and in every layout), bias = 0."""
        gen = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            w = torch.randn(self.weight.shape, generator=gen) * self.init_std
            self.weight.copy_(w)
            self.bias.zero_()

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        """hidden_states: [s or s/tp, b, h] -> ([s, b, 1], None)."""
        if self.config.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None
