"""``torch.dmabuf``: ``torch.cuda``'s device, stream, event, random and memory functions for
dmabuf devices."""
import contextlib
import threading
from typing import Any, Optional, Union

import torch

from . import _C
from . import memory
from .memory import (  # noqa: F401
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
)

_DeviceLike = Union[torch.device, str, int, None]


def _index(device: _DeviceLike = None, optional: bool = True) -> int:
    """A device argument as a checked index (None: the current device)."""
    if device is None:
        if not optional:
            raise ValueError("a dmabuf device is required")
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "dmabuf":
            raise ValueError(f"expected a dmabuf device, got {device}")
        if device.index is None:
            return current_device()
        device = device.index
    if not isinstance(device, int):
        raise TypeError(f"a device is an int, a str or a torch.device, not {type(device).__name__}")
    _C._check_device(device)
    return device


def is_available() -> bool:
    """Whether dmabuf-rt has at least one device."""
    try:
        return _C._device_count() > 0
    except RuntimeError:
        return False


def is_initialized() -> bool:
    return True


def init() -> None:
    _C._device_count()


def device_count() -> int:
    return _C._device_count()


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device: _DeviceLike) -> None:
    torch.accelerator.set_device_index(_index(device))


def get_device_name(device: _DeviceLike = None) -> str:
    """The device's memory source, as dmabuf-rt names it (``shmem``, ``heap:system``...)."""
    return _C._device_name(_index(device))


def synchronize(device: _DeviceLike = None) -> None:
    """Waits for every stream of the device."""
    torch.accelerator.synchronize(_index(device))


class device:
    """Context manager that changes the current device."""

    def __init__(self, device: _DeviceLike):
        self.idx = -1 if device is None else _index(device)
        self.prev = -1

    def __enter__(self):
        if self.idx >= 0:
            self.prev = current_device()
            set_device(self.idx)

    def __exit__(self, *exc: Any) -> bool:
        if self.idx >= 0:
            set_device(self.prev)
        return False


class _OnDmabuf(type):
    """Instances are torch's own stream or event objects on a dmabuf device: torch's C++
    checks of stream and event arguments accept nothing else."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._torch_type) and obj.device.type == "dmabuf"


class Stream(metaclass=_OnDmabuf):
    """A dmabuf stream (a ``torch.Stream``): an asynchronous queue of copies, event records
    and waits. Streams come from a small pool per device, as CUDA's do."""

    _torch_type = torch.Stream

    def __new__(cls, device: _DeviceLike = None, priority: int = 0) -> torch.Stream:
        return torch.Stream(device=torch.device("dmabuf", _index(device)), priority=priority)


class Event(metaclass=_OnDmabuf):
    """A point in a dmabuf stream (a ``torch.Event``) that other streams and the host can
    wait for; with ``enable_timing``, ``elapsed_time`` between two in milliseconds."""

    _torch_type = torch.Event

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:
        return torch.Event(device="dmabuf", enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def current_stream(device: _DeviceLike = None) -> torch.Stream:
    """The calling thread's current stream of the device (the default stream until set)."""
    return torch.accelerator.current_stream(_index(device))


def default_stream(device: _DeviceLike = None) -> torch.Stream:
    """The device's default stream: synchronous, and ordered after its other streams."""
    return torch.Stream(stream_id=0, device_index=_index(device), device_type=_PRIVATEUSE1)


# c10::DeviceType::PrivateUse1, as torch.Stream(stream_id=, device_index=, device_type=) takes it.
_PRIVATEUSE1 = 20


def set_stream(stream: torch.Stream) -> None:
    """Makes `stream` the calling thread's current stream of its device."""
    if stream is None:
        return
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def stream(stream: Optional[torch.Stream]):
    """Context manager that makes `stream` current (and its device) for its body."""
    if stream is None:
        yield
        return
    prev_dev = current_device()
    prev = current_stream(stream.device_index)
    set_device(stream.device_index)
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(prev)
        set_device(prev_dev)


def manual_seed(seed: int) -> None:
    """Seeds the current device's default generator."""
    _C._default_generator(current_device()).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for i in range(device_count()):
        _C._default_generator(i).manual_seed(int(seed))


def seed() -> None:
    _C._default_generator(current_device()).seed()


def initial_seed() -> int:
    return _C._default_generator(current_device()).initial_seed()


def get_rng_state(device: _DeviceLike = None) -> torch.Tensor:
    return _C._default_generator(_index(device)).get_state()


def set_rng_state(state: torch.Tensor, device: _DeviceLike = None) -> None:
    _C._default_generator(_index(device)).set_state(state)


def _is_in_bad_fork() -> bool:
    # torch.manual_seed seeds a device module's generators through manual_seed_all if it has
    # this. dmabuf-rt's runtime holds no state a fork breaks for the CPU side.
    return False


# Used by torch.random.fork_rng and torch's checkpointing.
_lock = threading.Lock()
