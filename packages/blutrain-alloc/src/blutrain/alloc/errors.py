"""The exceptions of blutrain.alloc: one hierarchy under AllocatorError, raised by the native core too."""

from __future__ import annotations

from blutrain.alloc.units import format_bytes

__all__ = ["AllocatorError", "CupyUnavailableError", "InvalidPointerError", "OutOfMemoryError"]


class AllocatorError(Exception):
    """Base of every error blutrain.alloc raises on purpose."""


class OutOfMemoryError(AllocatorError, MemoryError):
    """The provider could not supply a segment, even after the allocator returned its cached memory.

    The attributes hold the numbers of the message, in bytes; ``provider_free`` and ``provider_total``
    are None when the provider cannot tell.
    """

    def __init__(
        self,
        *,
        requested: int,
        rounded: int,
        allocated: int,
        reserved: int,
        largest_free_block: int,
        provider_free: int | None = None,
        provider_total: int | None = None,
    ) -> None:
        self.requested = requested
        self.rounded = rounded
        self.allocated = allocated
        self.reserved = reserved
        self.largest_free_block = largest_free_block
        self.provider_free = provider_free
        self.provider_total = provider_total
        if provider_free is None or provider_total is None:
            provider = "the provider does not report its free memory"
        else:
            provider = (
                f"the provider has {format_bytes(provider_free)} free of {format_bytes(provider_total)}"
            )
        super().__init__(
            f"out of memory: tried to allocate {format_bytes(requested)}"
            f" ({requested:,} bytes, a block of {format_bytes(rounded)}); {provider}; this allocator holds"
            f" {format_bytes(allocated)} allocated and {format_bytes(reserved)} reserved,"
            f" {format_bytes(reserved - allocated)} reserved but unallocated"
            f" (largest free block {format_bytes(largest_free_block)})."
            " Free or reuse tensors, or allocate less;"
            " reserved-but-unallocated memory that no request fits is fragmentation."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_out_of_memory, (self.__dict__.copy(),))


def _rebuild_out_of_memory(fields: dict[str, int | None]) -> OutOfMemoryError:
    return OutOfMemoryError(**fields)  # type: ignore[arg-type]


class InvalidPointerError(AllocatorError, ValueError):
    """A pointer passed to free() or record_stream() is not a live allocation of this allocator."""

    def __init__(self, operation: str, ptr: int) -> None:
        self.operation = operation
        self.ptr = ptr
        super().__init__(
            f"{operation}(ptr): expected a pointer returned by malloc() of this allocator and not yet freed,"
            f" got {ptr:#x}"
        )


class CupyUnavailableError(AllocatorError, ImportError):
    """blutrain.alloc.cupy needs CuPy (and a CUDA device), and it could not be imported."""
