"""``torch.dmabuf.memory``: the allocator's statistics, snapshots and history, in PyTorch's
names and formats (``torch.cuda.memory``'s functions for dmabuf devices)."""
import json
import pickle
from typing import Any, Dict, List, Optional, Union

import torch

from . import _C

_DeviceLike = Union[torch.device, str, int, None]


def _index(device: _DeviceLike = None) -> int:
    from .dmabuf import _index as index

    return index(device)


def memory_stats(device: _DeviceLike = None) -> Dict[str, Any]:
    """PyTorch's ``memory_stats()`` for the device (the same keys, sorted)."""
    return torch.accelerator.memory_stats(_index(device))


def memory_allocated(device: _DeviceLike = None) -> int:
    return torch.accelerator.memory_allocated(_index(device))


def max_memory_allocated(device: _DeviceLike = None) -> int:
    return torch.accelerator.max_memory_allocated(_index(device))


def memory_reserved(device: _DeviceLike = None) -> int:
    return torch.accelerator.memory_reserved(_index(device))


def max_memory_reserved(device: _DeviceLike = None) -> int:
    return torch.accelerator.max_memory_reserved(_index(device))


def reset_peak_memory_stats(device: _DeviceLike = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: _DeviceLike = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_index(device))


def empty_cache() -> None:
    """Returns every device's cached memory to its source (live tensors are untouched)."""
    torch.accelerator.empty_cache()


def mem_get_info(device: _DeviceLike = None) -> tuple:
    """``(free, total)``: the capacity minus this process's reserved bytes, and the capacity."""
    return torch.accelerator.get_memory_info(_index(device))


# Our block states by PyTorch's names.
_STATES = {"active_allocated": "active_allocated", "active_pending_free": "active_awaiting_free", "inactive": "inactive"}


def _segments(device: int, raw: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for seg in raw["segments"]:
        blocks = []
        allocated = active = requested = 0
        for b in seg["blocks"]:
            state = _STATES[b["state"]]
            blocks.append(
                {
                    "address": seg["address"] + b["offset"],
                    "size": b["size"],
                    "requested_size": b["requested_size"],
                    "state": state,
                    "frames": [],
                }
            )
            if state == "active_allocated":
                allocated += b["size"]
                requested += b["requested_size"]
            if state != "inactive":
                active += b["size"]
        out.append(
            {
                "device": device,
                "address": seg["address"],
                "total_size": seg["total_size"],
                "allocated_size": allocated,
                "active_size": active,
                "requested_size": requested,
                "stream": seg["stream"],
                "segment_type": seg["pool"],
                "segment_pool_id": (0, 0),
                "is_expandable": seg.get("is_expandable", False),
                "frames": [],
                "blocks": blocks,
            }
        )
    return out


def _trace(raw: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for e in raw["trace"]:
        if e["action"] == "invalid_free":
            continue  # refused frees have no PyTorch counterpart
        entry = {
            "action": e["action"],
            "addr": e["addr"],
            "size": e["size"],
            "stream": e["stream"],
            "time_us": e["t"] // 1000,
            "frames": [],
        }
        if e["action"] == "oom":
            # PyTorch's OOM entries carry the free memory in addr, and as device_free.
            entry["device_free"] = e["addr"]
        out.append(entry)
    return out


def memory_snapshot() -> List[Dict[str, Any]]:
    """Every segment of every device with its blocks (``torch.cuda.memory_snapshot()``)."""
    out = []
    for d in range(_C._device_count()):
        out.extend(_segments(d, json.loads(_C._snapshot_json(d))))
    return out


def _record_memory_history(enabled: Optional[str] = "all", context: Optional[str] = None, stacks: str = "python",
                           max_entries: int = 0, device: _DeviceLike = None, **kwargs: Any) -> None:
    """Records every allocation and free in the history of each device (``enabled=None``
    stops; segment events and OOMs are always recorded). Stack traces are not kept."""
    if enabled not in (None, "state", "all", True, False):
        raise ValueError(f"enabled must be None, 'state' or 'all', not {enabled!r}")
    on = enabled in ("all", "state", True)
    devices = range(_C._device_count()) if device is None else [_index(device)]
    for d in devices:
        _C._record_history(d, on)


def _snapshot(device: _DeviceLike = None) -> Dict[str, Any]:
    """PyTorch's snapshot: ``{"segments": [...], "device_traces": [[...] per device]}``, the
    format ``torch.cuda._memory_viz`` and the memory_viz web page read."""
    n = _C._device_count()
    segments: List[Dict[str, Any]] = []
    traces: List[List[Dict[str, Any]]] = []
    for d in range(n):
        raw = json.loads(_C._snapshot_json(d))
        segments.extend(_segments(d, raw))
        traces.append(_trace(raw))
    return {
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {},
        "external_annotations": [],
    }


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """Writes ``_snapshot()`` as a pickle, as ``torch.cuda.memory._dump_snapshot`` does."""
    with open(filename, "wb") as f:
        pickle.dump(_snapshot(), f)
