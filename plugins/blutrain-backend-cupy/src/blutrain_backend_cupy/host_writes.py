"""Host-to-device writes that return without waiting for the GPU: ``CupyBackend.write_from_host``.

CUDA's API synchronization rules for ``cudaMemcpyAsync`` say that a copy from *pageable* host memory may
synchronize with the stream before it starts (the driver stages the bytes into pinned memory first), so the host
would wait for every kernel queued before it: the previous step's whole graph. A copy from *page-locked* memory is
fully asynchronous, and the host must then leave that memory untouched until the copy has run. So each write goes
through a slot of :class:`PinnedStaging`: the values are copied into the slot on the host, the slot is copied to the
device on the current stream, and an event recorded after that copy marks when the slot is free again. A slot is
reused only once its event has completed; while every slot is in flight a new one is added, up to ``max_slots``,
beyond which the write waits for the oldest (the host is then that many writes ahead of the GPU).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np

from blutrain.tensor.errors import BluTrainError, TensorValueError

# A slot holds at least this many bytes, so that the few float64 of an optimizer's per-step scalars and other small
# writes share slots whatever their size.
MIN_SLOT_BYTES = 256
# Writes in flight per device before a write waits for the oldest: an optimizer writes a few arrays per step, and
# the host runs at most a few steps ahead of the GPU.
MAX_SLOTS = 256


class CaptureWriteError(BluTrainError, RuntimeError):
    """A host write was asked for while the current stream captures a CUDA graph."""


class _Slot:
    """Page-locked host bytes and the event recorded after the copy that last read them (None: never used)."""

    def __init__(self, cupy: Any, nbytes: int) -> None:
        self.memory = cupy.cuda.alloc_pinned_memory(nbytes)  # held for the slot's life: never freed while in flight
        self.bytes = np.frombuffer(self.memory, np.uint8, nbytes)
        self.ptr = int(self.memory.ptr)
        self.event = cupy.cuda.Event(block=False, disable_timing=True)
        self.used = False

    def free(self) -> bool:
        return not self.used or bool(self.event.done)


class PinnedStaging:
    """The page-locked slots of one device's host writes, in the order they were last used (oldest first)."""

    def __init__(self, cupy: Any, device: int, max_slots: int = MAX_SLOTS) -> None:
        if max_slots < 1:
            raise TensorValueError(f"PinnedStaging: max_slots must be at least 1, got {max_slots}")
        self._cp = cupy
        self.device = device
        self.max_slots = max_slots
        self._slots: deque[_Slot] = deque()
        self._lock = threading.Lock()  # two threads writing at once must not take the same slot

    @property
    def slots(self) -> int:
        """Slots allocated so far (at most ``max_slots``)."""
        return len(self._slots)

    def write(self, array: Any, host: np.ndarray[Any, Any]) -> None:
        """Queue the copy of ``host`` into ``array`` (contiguous, same shape and dtype, on this device) on the
        device's current stream; ``host`` may be reused when this returns. The caller checked the arguments."""
        nbytes = int(array.nbytes)
        if nbytes == 0:
            return
        cp = self._cp
        with cp.cuda.Device(self.device):
            stream = cp.cuda.get_current_stream()
            if _capturing(cp, stream):
                raise CaptureWriteError(
                    f"write_from_host: the current stream of cuda:{self.device} is capturing a CUDA graph; a replay "
                    "of the graph would copy from host memory that later writes reuse. Write the values before the "
                    "capture begins (a compiled step refills its per-step scalars before each replay)")
            with self._lock:
                slot = self._take(nbytes)
                staged = slot.bytes[:nbytes].view(host.dtype).reshape(host.shape)
                np.copyto(staged, host)
                cp.cuda.runtime.memcpyAsync(int(array.data.ptr), slot.ptr, nbytes,
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
                slot.event.record(stream)
                slot.used = True
                self._slots.append(slot)

    def _take(self, nbytes: int) -> _Slot:
        """A slot of at least ``nbytes`` whose last copy has completed, taken off the ring (the caller appends it
        again as the newest)."""
        slots = self._slots
        if slots and slots[0].free():
            oldest = slots.popleft()
            if len(oldest.bytes) >= nbytes:
                return oldest
            return _Slot(self._cp, max(nbytes, MIN_SLOT_BYTES))  # too small for this write: replaced by a larger one
        if len(slots) < self.max_slots:
            return _Slot(self._cp, max(nbytes, MIN_SLOT_BYTES))
        oldest = slots.popleft()
        oldest.event.synchronize()  # every slot in flight: wait for the oldest copy, not for the whole device
        if len(oldest.bytes) >= nbytes:
            return oldest
        return _Slot(self._cp, max(nbytes, MIN_SLOT_BYTES))


def _capturing(cp: Any, stream: Any) -> bool:
    """Whether ``stream`` is capturing a graph (or cannot be asked because a capture elsewhere forbids it)."""
    try:
        return bool(cp.cuda.runtime.streamIsCapturing(stream.ptr))
    except Exception:  # an invalidated capture, or the legacy stream while another stream captures globally
        return True


__all__ = ["MAX_SLOTS", "MIN_SLOT_BYTES", "CaptureWriteError", "PinnedStaging"]
