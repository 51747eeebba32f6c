"""Platform selection from torch.cuda.is_available() and Transformer Engine importability."""

from __future__ import annotations

import torch

from sao_megatron.platform import detect_platform, transformer_engine_available


def test_cpu_platform_uses_gloo_and_local_specs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = detect_platform()
    assert (p.device.type, p.backend, p.use_te, p.is_cuda) == ("cpu", "gloo", False, False)


def test_cuda_platform_uses_nccl_and_te_when_importable(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    p = detect_platform(local_rank=3)
    assert p.device == torch.device("cuda", 3) and p.backend == "nccl"
    assert p.use_te == transformer_engine_available()


_CPUINFO = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx fma {extra}\n\n" * 2


def test_native_bf16_is_read_from_the_cpuinfo_flags():
    from sao_megatron.platform import cpu_has_native_bf16

    assert cpu_has_native_bf16(_CPUINFO.format(extra="avx2")) is False
    assert cpu_has_native_bf16(_CPUINFO.format(extra="avx512f avx512_bf16")) is True
    assert cpu_has_native_bf16(_CPUINFO.format(extra="amx_tile amx_bf16")) is True
    assert cpu_has_native_bf16("processor\t: 0\nmodel name\t: Apple\n") is None  # no flags line


def test_bf16_on_a_cpu_without_bf16_instructions_warns_with_the_fix():
    import torch

    from sao_megatron.platform import Platform, slow_bf16_warning

    cpu = Platform(device=torch.device("cpu"), backend="gloo", use_te=False)
    cuda = Platform(device=torch.device("cuda", 0), backend="nccl", use_te=True)
    slow, fast = _CPUINFO.format(extra="avx2"), _CPUINFO.format(extra="avx512_bf16")
    msg = slow_bf16_warning(cpu, "bf16", slow)
    assert "precision.params_dtype=fp32" in msg and "avx512_bf16" in msg
    assert slow_bf16_warning(cpu, "fp32", slow) is None
    assert slow_bf16_warning(cpu, "bf16", fast) is None
    assert slow_bf16_warning(cuda, "bf16", slow) is None
    assert slow_bf16_warning(cpu, "bf16", "no flags here") is None  # unknown: no claim


def test_auto_dtype_is_bf16_only_where_the_hardware_computes_in_bf16(monkeypatch):
    from sao_megatron.platform import auto_params_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_params_dtype(_CPUINFO.format(extra="avx2"))[0] == "fp32"
    assert auto_params_dtype(_CPUINFO.format(extra="avx512_bf16"))[0] == "bf16"
    dtype, reason = auto_params_dtype("no flags here")
    assert dtype == "fp32" and "cannot be read" in reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "H200")
    for supported, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, s=supported: s)
        dtype, reason = auto_params_dtype(_CPUINFO.format(extra="avx2"))  # GPU decides
        assert dtype == want and "H200" in reason


def test_precision_auto_is_resolved_when_the_config_is_built(monkeypatch):
    from sao_megatron.optim import PrecisionConfig
    from sao_megatron.platform import platform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for flags, want in (("avx2", "fp32"), ("avx512_bf16", "bf16")):
        monkeypatch.setattr(
            platform, "cpu_has_native_bf16", lambda c=None, f=flags: f == "avx512_bf16"
        )
        p = PrecisionConfig(params_dtype="auto")
        assert (
            p.params_dtype == want
            and p.torch_dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[want]
        )
        assert "CPU" in p.auto_reason
    assert PrecisionConfig(params_dtype="fp32").auto_reason is None
