"""dmabuf-rt as a PyTorch device.

``import torch_dmabuf`` names PyTorch's PrivateUse1 device ``dmabuf``, registers the
``torch.dmabuf`` module (``torch.cuda``'s functions for dmabuf devices) and the tensor,
module and storage methods (``t.dmabuf()``, ``t.is_dmabuf``, ``UntypedStorage.is_dmabuf``).
Devices are dmabuf-rt's runtime devices, configured by ``DMABUF_RT_DEVICES``,
``DMABUF_RT_CAPACITY`` and ``DMABUF_RT_ALLOC_CONF`` as for C and Paddle.

Ops without a kernel of their own run as CPU kernels: by default directly on the mapped
device pages (the zero-copy fallback), or, after ``set_fallback_mode("copy")``, on host
copies of the operands as PyTorch's stock CPU fallback does.
"""
import os

import torch

# Failures reach Python as exceptions carrying the C API's message; the C API's own log line
# on stderr would only repeat it (set DMABUF_RT_LOG to keep it).
os.environ.setdefault("DMABUF_RT_LOG", "off")

from . import _C  # noqa: E402  # registers the allocator, the device guard, the hooks and the kernels

torch.utils.rename_privateuse1_backend("dmabuf")

from . import dmabuf as _module  # noqa: E402

torch._register_device_module("dmabuf", _module)
torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)

from . import multiprocessing as _multiprocessing  # noqa: E402

_multiprocessing.register()

__all__ = ["set_fallback_mode", "fallback_mode"]


def set_fallback_mode(mode: str) -> None:
    """``"zero_copy"`` (CPU kernels on the device pages) or ``"copy"`` (on host copies)."""
    if mode not in ("zero_copy", "copy"):
        raise ValueError(f"fallback mode must be 'zero_copy' or 'copy', not {mode!r}")
    _C._set_zero_copy_fallback(mode == "zero_copy")


def fallback_mode() -> str:
    """The fallback mode in use."""
    return "zero_copy" if _C._zero_copy_fallback() else "copy"
