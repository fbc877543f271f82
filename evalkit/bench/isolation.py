"""Measuring in isolation: a fresh process per measurement, clocks on the device's timeline, true peaks.

Time. On CPU, `time.perf_counter`; on CUDA, `torch.cuda.Event`s read after a synchronize (`Clock`).

Memory (`PeakMemory`). The peak resident set of a long-lived process never goes down, so each
measurement gets its own process (`Isolated`). Before memory is read the process switches glibc to
exact allocation (every block of 1 MiB or more its own mapping, returned to the kernel when freed),
returns free heap pages (`malloc_trim`) and resets the kernel's high-water mark
(`/proc/self/clear_refs`, "5"). The peak (VmHWM, tracked by the kernel, no sampling) is then the
true peak of what ran after `reset()`, and `working` is the peak minus the resident set just before
it. Without clear_refs, `ru_maxrss` of the fresh process is used and the method recorded. On CUDA,
`torch.cuda.max_memory_allocated` after a reset as well. Why and what it costs: evalkit.bench.generations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import multiprocessing
import re
import resource
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging


class Isolated:
    """Runs each call in a fresh process, forked from a server that has already imported torch,
    transformers and the model's module (`preload`).

    Forking from a preloaded server saves seconds of imports per measurement, and a process used
    once has no allocator state or peak left over from the one before.
    """

    def __init__(self, preload: tuple[str, ...] = ()):
        self.preload = ["evalkit.bench.generations", "evalkit.bench.components", *preload]

    def __enter__(self) -> "Isolated":
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(self.preload)
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1)
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def run(self, threads: int, fn, *args):
        """fn(*args) in a fresh process using `threads` torch threads (0: torch's default)."""
        return self._pool.submit(_in_child, threads, fn, *args).result()


def _in_child(threads: int, fn, *args):
    hf_logging.disable_progress_bar()  # the parent's progress bar owns the terminal
    if threads:
        torch.set_num_threads(threads)
    return fn(*args)


def model_module(config) -> str | None:
    """The transformers module of a config's architecture (slow to import: worth preloading), if any."""
    name = f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    try:
        return name if importlib.util.find_spec(name) else None
    except ModuleNotFoundError:
        return None


class Clock:
    """Marks on the device's timeline: perf_counter on CPU, CUDA events on CUDA."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start, stop) -> float:
        if self.cuda:
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        return stop - start


class PeakMemory:
    """Peak resident set (and CUDA allocation) of this process from `reset()` on.

    `reset()` switches the process to exact allocation for good: call it after any timing.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.method = "VmHWM after clear_refs" if _can_reset_peak() else "ru_maxrss of a fresh process"

    def reset(self) -> None:
        _exact_allocation()
        if self.method.startswith("VmHWM"):
            Path("/proc/self/clear_refs").write_text("5")
        self.base_rss = _rss_now()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base_cuda = torch.cuda.memory_allocated()

    def read(self) -> dict:
        peak = _status_kib("VmHWM") * 1024 if self.method.startswith("VmHWM") else _ru_maxrss_bytes()
        result = {"peak_rss_bytes": peak, "base_rss_bytes": self.base_rss,
                  "working_bytes": max(0, peak - self.base_rss), "memory_method": self.method}
        if self.cuda:
            torch.cuda.synchronize()
            cuda_peak = torch.cuda.max_memory_allocated()
            result.update(cuda_peak_bytes=cuda_peak, cuda_working_bytes=cuda_peak - self.base_cuda)
        return result


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_EXACT_THRESHOLD = 1 << 20


def _exact_allocation() -> None:
    """glibc: blocks >= 1 MiB mapped on their own and unmapped when freed (a fixed threshold also
    stops glibc from raising it as blocks are freed), and free heap pages returned now, so the
    resident set follows live memory. Elsewhere nothing changes and peaks may include free heap."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(_M_MMAP_THRESHOLD, _EXACT_THRESHOLD)
        libc.malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1))


def _rss_now() -> int:
    try:
        return _status_kib("VmRSS") * 1024
    except OSError:
        return _ru_maxrss_bytes()  # no /proc: the best available lower bound of the baseline


def _ru_maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _can_reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kib("VmHWM") > 0
    except OSError:
        return False
