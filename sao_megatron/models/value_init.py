"""Initialise a value model from policy weights (trunk copied, head initialised explicitly)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sao_megatron.models.value_head import ValueHead


@dataclass
class ValueInitReport:
    """What ``init_value_from_policy`` did.

    Attributes:
        loaded: value-model keys copied from the policy.
        head_initialized: value-head keys initialised explicitly (not from the policy).
        ignored_policy_keys: policy keys with no place in the value model (the LM output layer).
        missing: value-model keys that are neither in the policy nor the head (error if any).
        unexpected: policy keys that are neither used nor the known-ignored output layer.
    """

    loaded: list[str] = field(default_factory=list)
    head_initialized: list[str] = field(default_factory=list)
    ignored_policy_keys: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def init_value_from_policy(
    value: torch.nn.Module,
    policy_state_dict: dict[str, torch.Tensor],
    *,
    strict: bool = True,
) -> ValueInitReport:
    """Copy trunk weights (embedding, layers, final norm) of the same rank's policy chunk into
    ``value`` and re-initialise the value head (``ValueHead.reset_parameters``).

    Both must have the same layout (TP/PP/EP). Keys are matched by name; the policy's
    ``output_layer.*`` (LM head) is ignored; the value model's ``output_layer.weight/bias`` is
    the value head.

    Args:
        value: a ``ValueGPTModel`` chunk (unwrapped).
        policy_state_dict: the matching policy chunk's ``state_dict()``.
        strict: raise on missing/unexpected keys or shape mismatches.

    Raises:
        ValueError: (strict) missing or unexpected keys, shape mismatch; lists the keys.
    """
    report = ValueInitReport()
    own = value.state_dict()
    new_state = {}
    shape_errors = []
    for key, tensor in own.items():
        if key.startswith("output_layer."):
            report.head_initialized.append(key)
            continue
        if key not in policy_state_dict:
            report.missing.append(key)
            continue
        src = policy_state_dict[key]
        if torch.is_tensor(src) and src.shape != tensor.shape:
            shape_errors.append(f"{key}: policy {tuple(src.shape)} vs value {tuple(tensor.shape)}")
            continue
        new_state[key] = src
        report.loaded.append(key)
    for key in policy_state_dict:
        if key in own and not key.startswith("output_layer."):
            continue
        if key.startswith("output_layer."):
            report.ignored_policy_keys.append(key)
        else:
            report.unexpected.append(key)
    if strict and (report.missing or report.unexpected or shape_errors):
        raise ValueError(
            "policy -> value init failed: "
            f"missing in policy {report.missing}; unexpected policy keys {report.unexpected}; "
            f"shape mismatches {shape_errors}"
        )
    value.load_state_dict(new_state, strict=False)
    head = getattr(value, "output_layer", None)
    if isinstance(head, ValueHead):
        head.reset_parameters()
    return report
