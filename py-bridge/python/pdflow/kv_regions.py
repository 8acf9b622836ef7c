"""vLLM's per-layer KV tensors as pdflow regions (seed step 3: ``register_kv_caches``).

Kept free of vLLM imports, so that the GPU test on a machine without vLLM can use it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

from pdflow import _native
from pdflow._native import RegistrationError

if TYPE_CHECKING:
    import torch


class KvRegions(NamedTuple):
    """What ``WorkerConnector.register_kv_caches`` takes."""

    regions: list[tuple[int, int]]
    """``(address, length)`` of each region, in layer order."""
    geometry: tuple[int, int, int, int, int]
    """``(num_blocks, heads, block_size, head_dim, dtype_bytes)``."""
    owners: list
    """The tensors, kept alive by the connector."""
    device: Optional[int]
    """The CUDA device the tensors are on, or ``None`` for host memory."""


def regions_of(kv_caches: dict[str, "torch.Tensor"]) -> KvRegions:
    """One region per layer in the LBHNC layout (``[num_blocks, heads, block_size, 2*head_dim]``)
    and MLA's (``[num_blocks, block_size, latent]``: one head whose slot is the latent); two per
    layer (K, V) in the split layout ``[2, num_blocks, ...]``. Every tensor is in host
    memory, or every one on the same CUDA device (a wheel built with ``--features cuda``)."""
    regions: list[tuple[int, int]] = []
    owners: list = []
    geometry: Optional[tuple[int, int, int, int, int]] = None
    device: Optional[int] = None
    first_device = None
    if not kv_caches:
        raise RegistrationError("register_kv_caches got no KV cache tensors")
    for name, t in kv_caches.items():
        if first_device is None:
            first_device = t.device
        elif t.device != first_device:
            raise RegistrationError(f"layer {name}: KV cache on {t.device}, the first layer's on {first_device}: one engine's KV lives on one device")
        if t.device.type == "cuda":
            if not _native.GPU_KV:
                raise RegistrationError(
                    f"layer {name}: KV cache on {t.device}; this pdflow wheel was built without GPU support "
                    "(build it with `maturin build --features cuda`), so it registers host memory only"
                )
            device = int(t.device.index if t.device.index is not None else 0)
        elif t.device.type != "cpu":
            raise RegistrationError(f"layer {name}: KV cache on {t.device}; pdflow registers host memory or CUDA device memory")
        if not t.is_contiguous():
            raise RegistrationError(f"layer {name}: KV cache tensor is not contiguous (shape {tuple(t.shape)})")
        if t.dim() == 4:
            num_blocks, heads, block_size, kv_dim = (int(x) for x in t.shape)
            parts = [t]
        elif t.dim() == 3:
            # MLA: one latent per token (K and V in one vector), the LBHNC layout of one "head".
            num_blocks, block_size, kv_dim = (int(x) for x in t.shape)
            heads = 1
            parts = [t]
        elif t.dim() == 5 and int(t.shape[0]) == 2:
            _, num_blocks, a, b, d = (int(x) for x in t.shape)
            heads, block_size, kv_dim = a, b, d  # each of K and V is its own region
            parts = [t[0], t[1]]
        else:
            raise RegistrationError(
                f"layer {name}: KV cache shape {tuple(t.shape)} is neither LBHNC "
                "[num_blocks, heads, block_size, 2*head_dim], split [2, num_blocks, ...] nor MLA "
                "[num_blocks, block_size, latent]"
            )
        if kv_dim % 2:
            raise RegistrationError(f"layer {name}: last dimension {kv_dim} is not K and V side by side")
        g = (num_blocks, heads, block_size, kv_dim // 2, int(t.element_size()))
        if geometry is not None and g != geometry:
            raise RegistrationError(f"layer {name}: geometry {g} differs from the first layer's {geometry}")
        geometry = g
        for p in parts:
            regions.append((int(p.data_ptr()), int(p.numel()) * int(p.element_size())))
        owners.append(t)
    assert geometry is not None
    return KvRegions(regions, geometry, owners, device)
