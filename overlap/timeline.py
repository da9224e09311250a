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


# A 3x5 pixel font for lane labels: each glyph is 5 rows of 3 bits (left bit first).
_GLYPHS = {
    "a": (2, 5, 7, 5, 5), "b": (6, 5, 6, 5, 6), "c": (3, 4, 4, 4, 3), "d": (6, 5, 5, 5, 6),
    "e": (7, 4, 6, 4, 7), "f": (7, 4, 6, 4, 4), "g": (3, 4, 5, 5, 3), "h": (5, 5, 7, 5, 5),
    "i": (7, 2, 2, 2, 7), "j": (1, 1, 1, 5, 2), "k": (5, 5, 6, 5, 5), "l": (4, 4, 4, 4, 7),
    "m": (5, 7, 7, 5, 5), "n": (6, 5, 5, 5, 5), "o": (2, 5, 5, 5, 2), "p": (6, 5, 6, 4, 4),
    "q": (2, 5, 5, 6, 3), "r": (6, 5, 6, 5, 5), "s": (3, 4, 2, 1, 6), "t": (7, 2, 2, 2, 2),
    "u": (5, 5, 5, 5, 7), "v": (5, 5, 5, 5, 2), "w": (5, 5, 7, 7, 5), "x": (5, 5, 2, 5, 5),
    "y": (5, 5, 2, 2, 2), "z": (7, 1, 2, 4, 7), "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7),
    "2": (6, 1, 2, 4, 7), "3": (6, 1, 2, 1, 6), "4": (5, 5, 7, 1, 1), "5": (7, 4, 6, 1, 6),
    "6": (3, 4, 7, 5, 7), "7": (7, 1, 2, 2, 2), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 6),
}  # fmt: skip
_LABEL_SCALE = 2
_COMPUTE = (66, 133, 244)
_COMM = (245, 145, 32)
_GRID = (225, 225, 225)


def _draw_text(pixels: list[bytearray], text: str, left: int, top: int) -> None:
    for position, char in enumerate(text.lower()):
        for row, bits in enumerate(_GLYPHS.get(char, (0, 0, 0, 0, 0))):
            for column in range(3):
                if bits & (4 >> column):
                    for dy in range(_LABEL_SCALE):
                        line = pixels[top + row * _LABEL_SCALE + dy]
                        x = left + (position * 4 + column) * _LABEL_SCALE
                        line[3 * x : 3 * x + 3 * _LABEL_SCALE] = b"\x30" * (3 * _LABEL_SCALE)


def render_png(spans: list[Span], width: int = 1200, lane_height: int = 28) -> bytes:
    """PNG bytes of the chart (no plotting library needed): lane names on the left, then
    one bar per span, time running left to right from the first span's start."""
    lanes = sorted({s.lane for s in spans})
    height = max(len(lanes), 1) * lane_height
    pixels = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    label_width = (max((len(lane) for lane in lanes), default=0) * 4 + 2) * _LABEL_SCALE
    if label_width > width // 3 or lane_height < 5 * _LABEL_SCALE + 2:
        label_width = 0  # too small for labels
    chart = width - label_width
    end = max((s.end_ms for s in spans), default=1.0) or 1.0
    for index, lane in enumerate(lanes):
        if label_width:
            top = index * lane_height + (lane_height - 5 * _LABEL_SCALE) // 2
            _draw_text(pixels, lane, _LABEL_SCALE, top)
        if index:
            row = pixels[index * lane_height]
            for x in range(width):
                row[3 * x : 3 * x + 3] = bytes(_GRID)
    for span in spans:
        color = bytes(_COMM if span.lane.endswith("comm") else _COMPUTE)
        top = lanes.index(span.lane) * lane_height + 3
        left = label_width + int(span.start_ms / end * (chart - 1))
        right = max(label_width + int(span.end_ms / end * (chart - 1)), left + 1)
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
