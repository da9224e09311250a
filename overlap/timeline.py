"""A timeline of one run: when each kernel and communication ran, per stream.

On GPU the times come from CUDA events recorded on the stream doing the work;
a communication's span runs from its issue to the moment its stream may use
the result (the ``Wait``). On CPU they come from the host clock. Export it as a
Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev) or as a PNG chart
with one lane per stream and kind (compute in blue, communication in orange).

Example::

    timeline = Timeline(device)
    executor.run(inputs, timeline=timeline)
    timeline.write_chrome_trace("trace.json", rank=communicator.rank)
    timeline.write_png("timeline.png")
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start_ms: float
    end_ms: float


class Timeline:
    """Records spans; ``spans()`` returns them in ms from the first recorded start."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._open: list[tuple[str, str, object, object]] = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, lane: str, name: str) -> int:
        self._open.append((lane, name, self._mark(), None))
        return len(self._open) - 1

    def stop(self, token: int) -> None:
        lane, name, begin, _ = self._open[token]
        self._open[token] = (lane, name, begin, self._mark())

    @contextmanager
    def span(self, lane: str, name: str):
        token = self.start(lane, name)
        try:
            yield
        finally:
            self.stop(token)

    def spans(self) -> list[Span]:
        done = [entry for entry in self._open if entry[3] is not None]
        if not done:
            return []
        if self.cuda:
            torch.cuda.synchronize()
            origin = done[0][2]
            return [
                Span(lane, name, origin.elapsed_time(begin), origin.elapsed_time(end))
                for lane, name, begin, end in done
            ]
        origin = min(entry[2] for entry in done)
        return [
            Span(lane, name, (begin - origin) * 1e3, (end - origin) * 1e3)
            for lane, name, begin, end in done
        ]

    def chrome_trace(self, rank: int = 0) -> dict:
        """The spans as a Chrome trace: one thread per lane, times in microseconds."""
        spans = self.spans()
        lanes = sorted({s.lane for s in spans})
        events = [
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": lanes.index(lane),
             "args": {"name": lane}}
            for lane in lanes
        ]  # fmt: skip
        events += [
            {
                "name": s.name,
                "cat": "comm" if s.lane.endswith("comm") else "compute",
                "ph": "X",
                "pid": rank,
                "tid": lanes.index(s.lane),
                "ts": s.start_ms * 1e3,
                "dur": max(s.end_ms - s.start_ms, 0.0) * 1e3,
            }
            for s in spans
        ]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write_chrome_trace(self, path: str, rank: int = 0) -> None:
        with open(path, "w") as file:
            json.dump(self.chrome_trace(rank), file)

    def write_png(self, path: str, width: int = 1200, lane_height: int = 28) -> None:
        """A chart: a row per lane, a bar per span, time left to right."""
        with open(path, "wb") as file:
            file.write(render_png(self.spans(), width, lane_height))


_COMPUTE = (66, 133, 244)
_COMM = (245, 145, 32)
_GRID = (225, 225, 225)


def render_png(spans: list[Span], width: int = 1200, lane_height: int = 28) -> bytes:
    """PNG bytes of the chart (no plotting library needed)."""
    lanes = sorted({s.lane for s in spans})
    height = max(len(lanes), 1) * lane_height
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    end = max((s.end_ms for s in spans), default=1.0) or 1.0
    for index in range(1, len(lanes)):
        row = pixels[index * lane_height]
        for x in range(width):
            row[3 * x : 3 * x + 3] = bytes(_GRID)
    for span in spans:
        color = bytes(_COMM if span.lane.endswith("comm") else _COMPUTE)
        top = lanes.index(span.lane) * lane_height + 3
        left = int(span.start_ms / end * (width - 1))
        right = max(int(span.end_ms / end * (width - 1)), left + 1)
        for y in range(top, top + lane_height - 6):
            row = pixels[y]
            row[3 * left : 3 * right] = color * (right - left)
            row[3 * left : 3 * left + 3] = b"\x20\x20\x20"  # a dark edge between bars
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )
