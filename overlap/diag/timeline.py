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
- ``render_png``: a chart read without a caption, drawn with matplotlib (``timeline_figure``
  is the figure): a title, a legend, lanes named (rank, stream, compute or
  communication), bars labelled (instruction and chunk), a time axis in µs or ms;
- ``render_text``: the same chart in characters, for a terminal.

Example::

    timeline = Timeline(device)
    executor.run(inputs, timeline=timeline)
    timeline.write_chrome_trace("trace.json", rank=communicator.rank)
    timeline.write_png("timeline.png", title="tp_mlp, 2 chunks")
    print(render_text({communicator.rank: timeline.spans()}))
"""

from __future__ import annotations

import io
import json
import math
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # matplotlib loads only when a chart is drawn
    from matplotlib.figure import Figure


# the lane of the gradients' all-reduces over data-parallel replicas
# (``overlap.train.data_parallel``), which the roof meter measures against the backward
DATA_PARALLEL_LANE = "data parallel comm"


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
        return span_name(self.name, chunk=self.chunk)


def span_name(name: str, detail: str = "", chunk: int | None = None) -> str:
    """A span's full name as traces and profilers show it: the instruction, its chunk
    and what it does (``k2.0 matmul``, ``c1 Allgather T6``)."""
    label = name if chunk is None else f"{name}.{chunk}"
    return f"{label} {detail}" if detail else label


class SpanRecorder:
    """What records a run's spans: ``start`` opens one and returns what ``stop`` takes;
    ``span`` wraps a ``with`` block in them."""

    def start(self, lane: str, name: str, detail: str = "", chunk: int | None = None):
        raise NotImplementedError

    def stop(self, token) -> None:
        raise NotImplementedError

    @contextmanager
    def span(self, lane: str, name: str, detail: str = "", chunk: int | None = None):
        token = self.start(lane, name, detail, chunk)
        try:
            yield
        finally:
            self.stop(token)


class Timeline(SpanRecorder):
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

    def write_png(self, path: str, title: str = "", width_in: float = 12.0) -> None:
        """A chart of this rank's spans (see ``render_png``)."""
        with open(path, "wb") as file:
            file.write(render_png(self.spans(), title, width_in))


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
                {"name": span_name(s.name, s.detail, s.chunk),
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


_COMPUTE_COLOR = "#3b6fc4"
_COMM_COLOR = "#f0953a"
_LANE_IN = 0.32  # a lane's height in inches: room for a bar and its 8 pt label


def timeline_figure(
    spans: list[Span] | dict[int, list[Span]], title: str = "", width_in: float = 12.0
) -> Figure:
    """The chart as a matplotlib ``Figure`` on an Agg canvas (pyplot and the user's
    backend untouched): the ``title`` (lines), a legend, a key naming what each
    instruction does, a row per (rank, lane) named on the left, a bar per span coloured
    by kernel or communication and labelled with its instruction and chunk where the
    label fits, and a time axis in µs or ms. ``render_png`` saves it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    by_rank, rows, names, end = _chart(spans)
    ticks, unit, factor = axis_ticks(end)
    unit = "µs" if unit == "us" else unit
    titles = [line for line in title.split("\n") if line]
    height_in = 1.9 + 0.25 * len(titles) + _LANE_IN * max(len(rows), 1)
    figure = Figure(figsize=(width_in, height_in), layout="constrained")
    FigureCanvasAgg(figure)
    if titles:
        figure.suptitle("\n".join(titles))
    figure.legend(
        handles=[Patch(color=_COMPUTE_COLOR, label="kernel (compute)"),
                 Patch(color=_COMM_COLOR, label="communication, issue to wait")],
        loc="outside lower center", ncols=2, frameon=False,
    )  # fmt: skip
    axes = figure.add_subplot()
    key = "bar labels: instruction.chunk"
    if any(s.detail for spans_ in by_rank.values() for s in spans_):
        key += " — " + _key(by_rank)  # what each instruction does
    # wrapped at about 13 characters of 9 pt text per inch of width
    axes.set_title(textwrap.fill(key, int(width_in * 13)), loc="left", fontsize=9)
    bars = [(index, s) for index, (rank, lane) in enumerate(rows)
            for s in by_rank[rank] if s.lane == lane]  # fmt: skip
    axes.barh(
        [index for index, _ in bars],
        [(s.end_ms - s.start_ms) * factor for _, s in bars],
        left=[s.start_ms * factor for _, s in bars],
        height=0.7,
        color=[_COMM_COLOR if s.communication else _COMPUTE_COLOR for _, s in bars],
        edgecolor="#202020",
        linewidth=0.5,
    )
    axes.set_yticks(range(len(rows)), names)
    axes.set_ylim(max(len(rows), 1) - 0.5, -0.5)  # the first lane on top
    if not rows:
        axes.text(0.5, 0.5, "(no spans recorded)", ha="center", transform=axes.transAxes)
    for index in range(1, len(rows)):
        if rows[index - 1][0] != rows[index][0]:  # a rule between ranks
            axes.axhline(index - 0.5, color="#555555", linewidth=1.2)
    axes.set_xlim(0.0, end * factor)
    axes.set_xticks([tick * factor for tick in ticks], [_number(t * factor) for t in ticks])
    axes.set_xlabel(f"time ({unit}) from each rank's first span")
    axes.grid(axis="x", color="#dddddd")
    axes.set_axisbelow(True)
    # The layout is fixed before the labels are placed: a label is kept only where the
    # bar is wider than it, which needs the bars' final width on the canvas.
    figure.draw_without_rendering()
    figure.set_layout_engine("none")
    renderer = figure.canvas.get_renderer()
    for index, s in bars:
        left, right = axes.transData.transform([(s.start_ms * factor, index),
                                                (s.end_ms * factor, index)])  # fmt: skip
        text = axes.text((s.start_ms + s.end_ms) / 2 * factor, index, s.label, fontsize=8,
                         ha="center", va="center", clip_on=True,
                         color="black" if s.communication else "white")  # fmt: skip
        if text.get_window_extent(renderer).width + 4 > right[0] - left[0]:
            text.remove()
    return figure


def render_png(
    spans: list[Span] | dict[int, list[Span]],
    title: str = "",
    width_in: float = 12.0,
    dpi: int = 120,
) -> bytes:
    """PNG bytes of the chart (``timeline_figure``), ``width_in`` inches wide at ``dpi``."""
    buffer = io.BytesIO()
    timeline_figure(spans, title, width_in).savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()
