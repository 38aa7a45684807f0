"""Reading a run's scalars back from its event files, without TensorBoard: TFRecord framing (length, masked
CRC-32C of the length, the record, masked CRC-32C of the record), each record an ``Event`` protocol buffer."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c


def _record(data: bytes, at: int, path: Path) -> bytes:
    """The record framed at byte ``at``; ValueError where it is cut short or its checksums do not match."""
    header, length_crc = data[at:at + 8], data[at + 8:at + 12]
    length = struct.unpack("<Q", header)[0] if len(header) == 8 else -1
    record = data[at + 12:at + 12 + length] if length >= 0 else b""
    footer = data[at + 12 + length:at + 16 + length] if length >= 0 else b""
    intact = (length >= 0 and len(length_crc) == 4 and len(record) == length and len(footer) == 4
              and struct.unpack("<I", length_crc)[0] == masked_crc32c(header)
              and struct.unpack("<I", footer)[0] == masked_crc32c(record))
    if not intact:
        raise ValueError(f"{path}: the record at byte {at} is damaged or cut short (its checksums do not match)")
    return record


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``logdir``: tag → [(step, value)], in file order (values are
    float32, as TensorBoard stores them). Raises ValueError on a damaged record."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            record = _record(data, at, path)
            at += 16 + len(record)
            event = event_pb2.Event.FromString(record)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars
