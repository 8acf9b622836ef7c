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
    layers: list[str]
    """The layers whose tensors the regions are, in order (an aliasing layer is left out)."""


def _device_of(name: str, t: "torch.Tensor", first: Optional["torch.device"]) -> Optional[int]:
    """The CUDA device index of layer `name`'s tensor, None for host memory; every layer's on the
    first one's device."""
    if first is not None and t.device != first:
        raise RegistrationError(f"layer {name}: KV cache on {t.device}, the first layer's on {first}: one engine's KV lives on one device")
    if t.device.type == "cuda":
        if not _native.GPU_KV:
            raise RegistrationError(
                f"layer {name}: KV cache on {t.device}; this pdflow wheel was built without GPU support "
                "(build it with `maturin build --features cuda`), so it registers host memory only"
            )
        return int(t.device.index if t.device.index is not None else 0)
    if t.device.type != "cpu":
        raise RegistrationError(f"layer {name}: KV cache on {t.device}; pdflow registers host memory or CUDA device memory")
    return None


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
    layers: list[str] = []
    if not kv_caches:
        raise RegistrationError("register_kv_caches got no KV cache tensors")
    for name, t in kv_caches.items():
        device = _device_of(name, t, first_device)
        first_device = t.device
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
        layers.append(name)
        for p in parts:
            regions.append((int(p.data_ptr()), int(p.numel()) * int(p.element_size())))
        owners.append(t)
    assert geometry is not None
    return KvRegions(regions, geometry, owners, device, layers)


def pages_of(kv_caches: dict[str, "torch.Tensor"]) -> KvRegions:
    """A hybrid model's KV cache as pages. vLLM's hybrid allocator backs every KV-cache group with
    one buffer: block `b` of a layer's tensor is the page at `b × page` bytes from the tensor's
    start (its first stride), whatever the layer keeps in it (attention's K and V, or a Mamba
    layer's conv and SSM state, padded to the page); layers of different groups overlay the same
    pages, a block id being one group's at a time. One region per distinct tensor start, of
    `num_blocks` pages, in the geometry of a one-head, one-token block: ``(num_blocks, 1, 1,
    page / 2, 1)``."""
    regions: list[tuple[int, int]] = []
    owners: list = []
    layers: list[str] = []
    starts: set[int] = set()
    first_device = None
    device: Optional[int] = None
    paging: Optional[tuple[int, int]] = None
    if not kv_caches:
        raise RegistrationError("register_kv_caches got no KV cache tensors")
    for name, t in kv_caches.items():
        device = _device_of(name, t, first_device)
        first_device = t.device
        num_blocks, page = int(t.shape[0]), int(t.stride(0)) * int(t.element_size())
        if paging is not None and (num_blocks, page) != paging:
            raise RegistrationError(
                f"layer {name}: {num_blocks} blocks of {page} B, the first layer's {paging[0]} of {paging[1]} B: "
                "vLLM's hybrid allocator gives every group one page size"
            )
        paging = (num_blocks, page)
        storage = t.untyped_storage()
        start = int(t.data_ptr())
        if page % 2:
            raise RegistrationError(f"layer {name}: a page of {page} B is not K and V halves (an odd length)")
        if start + num_blocks * page > int(storage.data_ptr()) + int(storage.nbytes()):
            raise RegistrationError(
                f"layer {name}: {num_blocks} pages of {page} B from its start do not lie in its buffer "
                f"(shape {tuple(t.shape)}, stride {tuple(t.stride())})"
            )
        owners.append(t)
        if start in starts:
            continue
        starts.add(start)
        layers.append(name)
        regions.append((start, num_blocks * page))
    assert paging is not None
    return KvRegions(regions, (paging[0], 1, 1, paging[1] // 2, 1), owners, device, layers)
