"""Process memory for the CPU benchmarks: RSS now, and its peak while a block runs."""

from __future__ import annotations

import gc
import os
import threading
import time


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples RSS every `period` seconds inside the block: `peak`, and `growth` over the RSS
    at entry (after a garbage collection)."""

    def __init__(self, period: float = 0.002):
        self.period = period

    def __enter__(self):
        gc.collect()
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())

    @property
    def growth(self) -> int:
        return self.peak - self.base
