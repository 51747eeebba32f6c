"""Vectorised building blocks for GAE: the discounted reverse scan and masked (de)compaction.

`discounted_reverse_cumsum` solves y_t = x_t + c * y_{t+1} (y_L = 0) for every row at once with a
chunked matrix form instead of a Python loop over t: inside a chunk of K steps the solution is a
[K, K] upper-triangular Toeplitz matrix of powers c^(k-t) applied to x; the value entering each
chunk from the right is the same recurrence over chunk starts with coefficient c^K, solved by
recursion (depth log_K(L)). Powers are taken in float64, so no c^-t growth appears (only
non-negative powers of c <= 1 are formed) and underflow of c^n to 0 is exact to within the
float64 resolution of the sum. For L = 10,000 and K = 16 that is four levels of small batched
matmuls instead of 10,000 sequential steps (see docs/BENCHMARKS.md, "Advantages").
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 16


def discounted_reverse_cumsum(
    x: torch.Tensor, coef: torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """Solve y_t = x_t + coef * y_{t+1} with y_L = 0, for each row independently.

    Args:
        x: [B, L] float (any float dtype). Right-padding with zeros does not change y on the
            valid prefix, so ragged rows can be right-padded with 0.
        coef: [B] float in [0, 1], the per-row decay (gamma * lambda for GAE). 0**0 is 1.
        chunk: block size K of the matrix form (>= 2).

    Returns:
        y: [B, L], dtype of x, computed in float64.
    """
    if x.dim() != 2 or coef.shape != (x.shape[0],):
        raise ValueError(
            f"x must be [B, L] and coef [B]; got {tuple(x.shape)}, {tuple(coef.shape)}"
        )
    if chunk < 2:
        raise ValueError(f"chunk={chunk}: must be >= 2")
    out_dtype = x.dtype
    y = _scan64(x.to(torch.float64), coef.to(torch.float64), chunk)
    return y.to(out_dtype)


def _scan64(x: torch.Tensor, c: torch.Tensor, k: int) -> torch.Tensor:
    b, length = x.shape
    if length == 0:
        return x.clone()
    k = min(k, length)
    nc = -(-length // k)
    xp = torch.nn.functional.pad(x, (0, nc * k - length)).view(b, nc, k)
    i = torch.arange(k, device=x.device)
    expo = i[None, :] - i[:, None]  # expo[t, s] = s - t
    powers = c[:, None, None] ** expo.clamp(min=0).to(x.dtype)  # [B, K, K]
    tri = torch.where(expo >= 0, powers, torch.zeros((), dtype=x.dtype, device=x.device))
    local = torch.einsum("bts,bcs->bct", tri, xp)  # [B, nc, K]: in-chunk partial sums
    if nc > 1:
        starts = _scan64(local[:, :, 0], c**k, k)  # y at each chunk start, [B, nc]
        incoming = torch.nn.functional.pad(starts[:, 1:], (0, 1))  # y entering from the right
        carry = c[:, None] ** (k - i).to(x.dtype)  # [B, K]: c^(K - t)
        local = local + carry[:, None, :] * incoming[:, :, None]
    return local.reshape(b, nc * k)[:, :length]


class Packer:
    """Moves per-token tensors between the padded [B, T] layout and the packed [B, L] layout.

    Packing gathers the masked entries of each row to the left, in order, right-padded with 0
    (L = the largest row count, 0 if the mask is empty); unpacking puts packed[:, j] back on the
    j-th masked token and 0 elsewhere. The index tensors are built once per mask.

    Args: mask [B, T] bool.
    Attributes: counts [B] int64 (masked entries per row), length L.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask.to(torch.bool)
        self.counts = self.mask.sum(dim=1)
        self.length = int(self.counts.max()) if self.mask.numel() else 0
        rank = self.mask.long().cumsum(dim=1) - 1
        self._scatter_pos = torch.where(self.mask, rank, self.length)  # unmasked -> spill column
        self._gather_pos = rank.clamp(0, max(self.length - 1, 0))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T] (any dtype) -> [B, L], same dtype, zero-padded."""
        packed = x.new_zeros(x.shape[0], self.length + 1).scatter_(1, self._scatter_pos, x)
        return packed[:, : self.length]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """packed [B, L] -> [B, T], same dtype, 0 off the mask."""
        if self.length == 0:
            return packed.new_zeros(self.mask.shape)
        zero = packed.new_zeros(())
        return torch.where(self.mask, packed.gather(1, self._gather_pos), zero)


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-off `Packer(mask).pack(x)`: returns (packed [B, L], counts [B] int64)."""
    packer = Packer(mask)
    return packer.pack(x), packer.counts


def expand(packed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One-off inverse of `compact`: packed [B, L] -> [B, T], 0 off the mask."""
    packer = Packer(mask)
    if packed.shape[1] != packer.length:
        raise ValueError(f"packed has {packed.shape[1]} columns, mask needs {packer.length}")
    return packer.unpack(packed)
