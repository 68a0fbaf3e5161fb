"""dmabuf tensors through ``torch.multiprocessing``, zero-copy.

Importing ``torch_dmabuf`` registers a reduction for tensors: a ``dmabuf`` tensor (or a view
of one) put on a ``torch.multiprocessing`` queue (or pickled by its ``ForkingPickler``)
travels as dmabuf-rt's 64-byte IPC handle of its storage's block plus the view's shape,
strides and offset; the receiving process opens the handle (one connection per producing
process, each segment's fd once) and gets a tensor on the same device index over the same
pages. Other tensors go through PyTorch's own reduction.

The rules are PyTorch's for CUDA IPC:

- The producer's block is held from the moment the tensor is pickled: freeing the tensor
  there does not let the memory be reused until the receiver's tensor is gone (or the
  receiver exits). A tensor pickled but never received stays held until the producer exits.
- Writes are seen by both sides after synchronization (the handle is made after the
  producer's queued work on the device).
- A tensor received this way cannot be shared onward (``clone()`` it first).
- Processes must be started with ``spawn`` or ``forkserver``, or forked before the parent
  first used a dmabuf device: a process forked after that cannot use the runtime it
  inherited and says so.
"""
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing.reductions as _torch_reductions

from . import _C


def rebuild_dmabuf_tensor(handle, device, nbytes, size, stride, offset, dtype, requires_grad):
    """The receiving side: a tensor over the block ``handle`` names."""
    t = _C._ipc_open(handle, device, nbytes, list(size), list(stride), offset, dtype)
    if requires_grad:
        t.requires_grad_(True)
    return t


def reduce_tensor(tensor):
    """``ForkingPickler``'s reduction for tensors: dmabuf tensors by IPC handle."""
    if tensor.device.type != "dmabuf":
        return _torch_reductions.reduce_tensor(tensor)
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, since autograd does not "
            "support crossing process boundaries; detach() it first"
        )
    storage = tensor.untyped_storage()
    handle = _C._ipc_get_handle(tensor)
    return (
        rebuild_dmabuf_tensor,
        (
            handle,
            tensor.device.index,
            storage.nbytes(),
            tuple(tensor.size()),
            tuple(tensor.stride()),
            tensor.storage_offset(),
            tensor.dtype,
            tensor.requires_grad,
        ),
    )


def register():
    """Makes ``ForkingPickler`` send dmabuf tensors by handle (done on import)."""
    from torch.nn.parameter import Parameter

    for t in (torch.Tensor, Parameter, *torch._tensor_classes):
        ForkingPickler.register(t, reduce_tensor)
