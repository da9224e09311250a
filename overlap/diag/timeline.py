"""A timeline of one run: when each kernel and communication ran, per stream.

On GPU the times come from CUDA events recorded on the stream doing the work;
a communication's span runs from its issue to the moment its stream may use
the result (the ``Wait``). On CPU they come from the host clock. Each span names
its instruction (``k2``, ``c1``), what it does (``matmul``, ``Allgather T6``) and,
inside a pipeline, its chunk.

Three views, each for one rank or several side by side (``{rank: spans}``, every
rank's times from its own first span):

- ``chrome_trace``: a Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev),
  one process per rank, one thread per lane;
- ``render_png``: a chart read without a caption: a title, a legend, lanes named
  (rank, stream, compute or communication), bars labelled (instruction and chunk), a
  time axis in µs or ms; no plotting library needed;
- ``render_text``: the same chart in characters, for a terminal.

Example::

    timeline = Timeline(device)
    executor.run(inputs, timeline=timeline)
    timeline.write_chrome_trace("trace.json", rank=communicator.rank)
    timeline.write_png("timeline.png", title="tp_mlp, 2 chunks")
    print(render_text({communicator.rank: timeline.spans()}))
"""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Span:
    lane: str  # "stream 1 compute", "main comm", ...
    name: str  # the instruction: "k2", "c1"
    start_ms: float
    end_ms: float
    detail: str = ""  # what it does: "matmul", "Allgather T6"
    chunk: int | None = None  # the pipeline chunk, None outside a pipeline

    @property
    def communication(self) -> bool:
        return self.lane.endswith("comm")

    @property
    def label(self) -> str:
        """The bar's short label: the instruction and its chunk (``k2.0``)."""
        return self.name if self.chunk is None else f"{self.name}.{self.chunk}"


class Timeline:
    """Records spans; ``spans()`` returns them in ms from the first recorded start."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._open: list[tuple[str, str, object, object, str, int | None]] = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, lane: str, name: str, detail: str = "", chunk: int | None = None) -> int:
        self._open.append((lane, name, self._mark(), None, detail, chunk))
        return len(self._open) - 1

    def stop(self, token: int) -> None:
        lane, name, begin, _, detail, chunk = self._open[token]
        self._open[token] = (lane, name, begin, self._mark(), detail, chunk)

    @contextmanager
    def span(self, lane: str, name: str, detail: str = "", chunk: int | None = None):
        token = self.start(lane, name, detail, chunk)
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

            def ms(mark) -> float:
                return origin.elapsed_time(mark)

        else:
            first = min(entry[2] for entry in done)

            def ms(mark) -> float:
                return (mark - first) * 1e3

        return [
            Span(lane, name, ms(begin), ms(end), detail, chunk)
            for lane, name, begin, end, detail, chunk in done
        ]

    def chrome_trace(self, rank: int = 0) -> dict:
        """This rank's spans as a Chrome trace (see ``chrome_trace``)."""
        return chrome_trace({rank: self.spans()})

    def write_chrome_trace(self, path: str, rank: int = 0) -> None:
        write_chrome_trace(path, {rank: self.spans()})

    def write_png(
        self, path: str, width: int = 1200, lane_height: int = 28, title: str = ""
    ) -> None:
        """A chart of this rank's spans (see ``render_png``)."""
        with open(path, "wb") as file:
            file.write(render_png(self.spans(), width, lane_height, title))


def _by_rank(spans: list[Span] | dict[int, list[Span]]) -> dict[int, list[Span]]:
    return dict(sorted(spans.items())) if isinstance(spans, dict) else {0: list(spans)}


def _lanes(by_rank: dict[int, list[Span]]) -> list[tuple[int, str]]:
    """(rank, lane) rows: by rank, then the main lanes, then streams by number."""

    def order(lane: str) -> tuple:
        words = lane.split()
        number = int(words[1]) if len(words) > 2 and words[1].isdigit() else -1
        return (number, words[-1] != "compute", lane)

    return [(rank, lane) for rank, spans in by_rank.items()
            for lane in sorted({s.lane for s in spans}, key=order)]  # fmt: skip


def _chart(spans: list[Span] | dict[int, list[Span]]) -> tuple[dict, list, list[str], float]:
    """What a chart draws: the spans by rank, the (rank, lane) rows, their names (the
    rank named where there are several) and the last span's end (ms)."""
    by_rank = _by_rank(spans)
    rows = _lanes(by_rank)
    names = [f"rank {rank} {lane}" if len(by_rank) > 1 else lane for rank, lane in rows]
    end = max((s.end_ms for spans_ in by_rank.values() for s in spans_), default=1.0) or 1.0
    return by_rank, rows, names, end


def chrome_trace(spans: list[Span] | dict[int, list[Span]]) -> dict:
    """Spans as a Chrome trace: a process per rank, a thread per lane, times in µs,
    each event's args naming what it does and its chunk."""
    by_rank = _by_rank(spans)
    rows = _lanes(by_rank)
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        for rank in by_rank
    ]
    events += [
        {"name": "thread_name", "ph": "M", "pid": rank, "tid": rows.index((rank, lane)),
         "args": {"name": lane}}
        for rank, lane in rows
    ]  # fmt: skip
    for rank, rank_spans in by_rank.items():
        for s in rank_spans:
            args = {"what": s.detail} if s.detail else {}
            if s.chunk is not None:
                args["chunk"] = s.chunk
            events.append(
                {"name": s.label if not s.detail else f"{s.label} {s.detail}",
                 "cat": "comm" if s.communication else "compute", "ph": "X", "pid": rank,
                 "tid": rows.index((rank, s.lane)), "ts": s.start_ms * 1e3,
                 "dur": max(s.end_ms - s.start_ms, 0.0) * 1e3, "args": args}
            )  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, spans: list[Span] | dict[int, list[Span]]) -> None:
    with open(path, "w") as file:
        json.dump(chrome_trace(spans), file)


def axis_ticks(end_ms: float, most: int = 8) -> tuple[list[float], str, float]:
    """Tick positions (ms) of a readable step (1, 2 or 5 times a power of ten), the unit
    ("µs" below a millisecond, else "ms") and its factor from ms."""
    end_ms = end_ms if end_ms > 0 else 1.0
    unit, factor = ("us", 1e3) if end_ms < 1.0 else ("ms", 1.0)
    raw = end_ms * factor / most
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    count = int(end_ms * factor / step + 1e-9)
    return [i * step / factor for i in range(count + 1)], unit, factor


def _number(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def render_text(spans: list[Span] | dict[int, list[Span]], width: int = 72) -> str:
    """The chart in characters: a row per (rank, lane), ``#`` where a kernel ran and
    ``=`` where a communication was in flight, each bar starting with its label (running
    on into the blank after a short bar, where there is room), a time axis under it, and
    a key naming what each instruction does."""
    by_rank, rows, names, end = _chart(spans)
    if not rows:
        return "(no spans recorded)"
    pad = max(len(n) for n in names)

    def column(ms: float) -> int:
        return min(int(ms / end * width), width - 1)

    lines = []
    for (rank, lane), name in zip(rows, names, strict=True):
        cells = [" "] * width
        bars = []
        for s in sorted(by_rank[rank], key=lambda s: s.start_ms):
            if s.lane == lane:
                left, right = column(s.start_ms), max(column(s.end_ms), column(s.start_ms) + 1)
                cells[left:right] = ("=" if s.communication else "#") * (right - left)
                bars.append((left, right, s.label))
        for left, right, label in bars:  # inside its bar (a mark left), or on into blank
            end_at = left + len(label)
            if right - left > len(label) or (
                end_at < width and all(c == " " for c in cells[right : end_at + 1])
            ):
                cells[left:end_at] = label
        lines.append(f"{name:<{pad}} |{''.join(cells)}|")
    ticks, unit, factor = axis_ticks(end, most=max(width // 12, 2))
    axis, marks = [" "] * (width + 12), ["-"] * width
    for tick in ticks:
        at = column(tick) if tick < end else width - 1
        marks[at] = "+"
        text = _number(tick * factor)
        if all(c == " " for c in axis[at : at + len(text) + 1]):
            axis[at : at + len(text)] = text
    lines.append(f"{'':<{pad}} +{''.join(marks)}+")
    lines.append(f"{'':<{pad}}  {''.join(axis).rstrip()} {unit}")
    lines.append(f"{'':<{pad}}  # kernel, = communication (issue to wait), .N chunk N")
    lines.append(f"{'':<{pad}}  {_key(by_rank)}")
    return "\n".join(lines)


def _key(by_rank: dict[int, list[Span]]) -> str:
    """What each instruction does: ``c0 Allgather T6; k0 matmul; ...``."""
    key: dict[str, str] = {}
    for spans in by_rank.values():
        for s in spans:
            key.setdefault(s.name, s.detail)
    return "; ".join(f"{n} {d}".rstrip() for n, d in sorted(key.items(), key=_natural))


def _natural(item: tuple[str, str]) -> tuple:
    name = item[0]
    digits = "".join(c for c in name if c.isdigit())
    return (name.rstrip("0123456789"), int(digits) if digits else -1)


# A 3x5 pixel font: each glyph is 5 rows of 3 bits (left bit first); text is lowercased.
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
    ".": (0, 0, 0, 0, 2), ":": (0, 2, 0, 2, 0), ";": (0, 2, 0, 2, 4), "-": (0, 0, 7, 0, 0),
    "+": (0, 2, 7, 2, 0), "/": (1, 1, 2, 4, 4), "(": (1, 2, 2, 2, 1), ")": (4, 2, 2, 2, 4),
    ",": (0, 0, 0, 2, 4), "=": (0, 7, 0, 7, 0), "%": (5, 1, 2, 4, 5), "'": (2, 2, 0, 0, 0),
    "_": (0, 0, 0, 0, 7), "<": (1, 2, 4, 2, 1), ">": (4, 2, 1, 2, 4), "*": (0, 5, 2, 5, 0),
    "#": (5, 7, 5, 7, 5), "[": (3, 2, 2, 2, 3), "]": (6, 2, 2, 2, 6), "µ": (5, 5, 5, 7, 4),
}  # fmt: skip
_SCALE = 2  # pixels per font dot
_CHAR = 4 * _SCALE  # advance per character
_LINE = 5 * _SCALE + 6  # height of a line of text
_INK = (48, 48, 48)
_COMPUTE = (66, 133, 244)
_COMM = (245, 145, 32)
_GRID = (225, 225, 225)
_RANK_RULE = (120, 120, 120)


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def box(self, left: int, top: int, right: int, bottom: int, color: tuple) -> None:
        left, right = max(left, 0), min(right, self.width)
        for y in range(max(top, 0), min(bottom, self.height)):
            self.rows[y][3 * left : 3 * right] = bytes(color) * max(right - left, 0)

    def text(self, text: str, left: int, top: int, color: tuple = _INK) -> None:
        for position, char in enumerate(text.lower()):
            for row, bits in enumerate(_GLYPHS.get(char, (0, 0, 0, 0, 0))):
                for column in range(3):
                    if bits & (4 >> column):
                        x = left + position * _CHAR + column * _SCALE
                        y = top + row * _SCALE
                        self.box(x, y, x + _SCALE, y + _SCALE, color)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)

        def chunk(kind: bytes, data: bytes) -> bytes:
            body = kind + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))  # fmt: skip


def render_png(
    spans: list[Span] | dict[int, list[Span]],
    width: int = 1200,
    lane_height: int = 28,
    title: str = "",
) -> bytes:
    """PNG bytes of the chart: the ``title`` (lines), a legend, a row per (rank, lane)
    named on the left, a bar per span labelled with its instruction and chunk where it
    fits, and a time axis with ticks in µs or ms under it."""
    by_rank, rows, names, end = _chart(spans)
    titles = [line for line in title.split("\n") if line]
    label_width = max((len(n) for n in names), default=0) * _CHAR + 2 * _SCALE
    if label_width > width // 3:
        label_width = width // 3
    labels = lane_height >= _LINE  # room to write in a lane
    if not labels:
        label_width = 0
    header = (len(titles) + 2) * _LINE + 4 if labels else 0  # the titles, legend, key
    axis = 2 * _LINE + 8 if labels else 0
    chart_left, chart_width = label_width + _SCALE, width - label_width - 3 * _SCALE
    canvas = _Canvas(width, header + max(len(rows), 1) * lane_height + axis)

    def x(ms: float) -> int:
        return chart_left + int(ms / end * (chart_width - 1))

    if labels:
        for index, line in enumerate(titles):
            canvas.text(line[: (width - 4) // _CHAR], 2 * _SCALE, index * _LINE + 4)
        top = len(titles) * _LINE + 4
        left = 2 * _SCALE
        for color, what in ((_COMPUTE, "kernel (compute)"),
                            (_COMM, "communication, issue to wait")):  # fmt: skip
            canvas.box(left, top, left + 3 * _CHAR, top + 5 * _SCALE, color)
            canvas.text(what, left + 4 * _CHAR, top)
            left += (len(what) + 7) * _CHAR
        canvas.text("bar labels: instruction.chunk", left, top)
        canvas.text(_key(by_rank)[: (width - 4) // _CHAR], 2 * _SCALE, top + _LINE)
    ticks, unit, factor = axis_ticks(end)
    bottom = header + len(rows) * lane_height
    for tick in ticks:
        canvas.box(x(tick), header, x(tick) + 1, bottom, _GRID)
    for index, ((rank, lane), name) in enumerate(zip(rows, names, strict=True)):
        top = header + index * lane_height
        if index:
            new_rank = rows[index - 1][0] != rank
            canvas.box(0, top, width, top + (2 if new_rank else 1),
                       _RANK_RULE if new_rank else _GRID)  # fmt: skip
        if labels:
            canvas.text(name[: label_width // _CHAR], _SCALE, top + (lane_height - 5 * _SCALE) // 2)
        for s in by_rank[rank]:
            if s.lane != lane:
                continue
            left, right = x(s.start_ms), max(x(s.end_ms), x(s.start_ms) + 1)
            canvas.box(left, top + 3, right, top + lane_height - 3, _COMM if s.communication
                       else _COMPUTE)  # fmt: skip
            canvas.box(left, top + 3, left + 1, top + lane_height - 3, (32, 32, 32))
            if labels and right - left >= len(s.label) * _CHAR + 2 * _SCALE:
                canvas.text(s.label, left + 2 * _SCALE, top + (lane_height - 5 * _SCALE) // 2,
                            (255, 255, 255))  # fmt: skip
    if labels:
        canvas.box(chart_left, bottom + 1, chart_left + chart_width, bottom + 2, _INK)
        last = -1
        for tick in ticks:
            text = _number(tick * factor) + (f" {unit}" if tick == ticks[-1] else "")
            at = x(tick)
            canvas.box(at, bottom + 1, at + 1, bottom + 6, _INK)
            if at > last and at + len(text) * _CHAR < width:
                canvas.text(text, at - (0 if tick == 0 else _SCALE), bottom + 8)
                last = at + (len(text) + 1) * _CHAR
        canvas.text(f"time ({unit}) from each rank's first span", chart_left, bottom + 8 + _LINE)
    return canvas.png()
