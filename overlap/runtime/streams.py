"""CUDA streams for stream-parallel loops; no-ops on CPU, where results are the same."""

from __future__ import annotations

import torch


class StreamPool:
    """The streams of one executor: loop iteration ``i`` runs on stream ``i % count``."""

    def __init__(self, device: torch.device, count: int = 4) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.count = count
        self._streams: dict[int, torch.cuda.Stream] = {}

    def current(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def get(self, index: int):
        if not self.cuda:
            return None
        slot = index % self.count
        if slot not in self._streams:
            self._streams[slot] = torch.cuda.Stream(self.device)
        return self._streams[slot]

    def set(self, stream) -> None:
        if self.cuda:
            torch.cuda.set_stream(stream)

    def wait(self, stream) -> None:
        """Make the current stream wait for the work queued on ``stream`` so far."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)
