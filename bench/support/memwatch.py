"""A thread that samples this process's memory from /proc/self/status, with a peak per phase.

RssAnon is anonymous memory (heap, torch tensors, copy-on-write copies of mapped pages): what a
run really takes from RAM. RssFile counts page-cache pages mapped into the process (weights read
in place from their files): the kernel reclaims them under pressure. VmHWM is the kernel's own
high-water mark of VmRSS (anonymous + file + shmem), so it also catches a spike between samples.

    with MemoryWatch(interval_s=0.02) as watch:
        watch.phase("load"); ...
        watch.phase("sample"); ...
    watch.summary()
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
STATUS = Path("/proc/self/status")


def read_status(path: Path = STATUS) -> dict[str, int]:
    """The memory fields of a /proc/<pid>/status file, in bytes (the kernel writes kB)."""
    values = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in FIELDS:
            values[key] = int(rest.split()[0]) * 1024
    return values


def peak_growth(call) -> int:
    """Peak RSS during `call` above the RSS when it started (Linux: clear_refs 5 resets the peak)."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    start = read_status()["VmRSS"]
    call()
    return read_status()["VmHWM"] - start


def rss_in_child(script: str, args) -> dict[str, int]:
    """Run `script --rss-only OUT --blocks N --threads T` in a child whose glibc returns every large
    block to the system when freed (MALLOC_MMAP_THRESHOLD_), and read the JSON it writes. With the
    default allocator freed memory stays in malloc's heap, so a difference of two peaks depends on
    what earlier calls left there and is off by tens of MiB either way."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "rss.json"
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        command = [sys.executable, script, "--rss-only", str(out), "--blocks", str(args.blocks), "--threads", str(args.threads)]
        subprocess.run(command, env=env, check=True)
        return json.loads(out.read_text())


class MemoryWatch:
    """Peaks of RssAnon and VmRSS, overall and per named phase, sampled every `interval_s`."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.samples = 0
        self._phase = "start"
        self._peaks: dict[str, dict[str, int]] = {}
        self._started = time.perf_counter()
        self._phase_started = self._started
        self._phase_cpu = time.process_time()
        self._seconds: dict[str, float] = {}
        self._cpu_seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memwatch", daemon=True)

    def __enter__(self) -> "MemoryWatch":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.phase("end")

    def phase(self, name: str) -> None:
        """Close the current phase (one last sample, its wall and CPU time) and open `name`."""
        self.sample()
        now, cpu = time.perf_counter(), time.process_time()
        with self._lock:
            self._seconds[self._phase] = self._seconds.get(self._phase, 0.0) + now - self._phase_started
            self._cpu_seconds[self._phase] = self._cpu_seconds.get(self._phase, 0.0) + cpu - self._phase_cpu
            self._phase, self._phase_started, self._phase_cpu = name, now, cpu
        self.sample()

    def sample(self) -> None:
        status = read_status()
        with self._lock:
            self.samples += 1
            peaks = self._peaks.setdefault(self._phase, {"anon": 0, "rss": 0, "file": 0})
            peaks["anon"] = max(peaks["anon"], status["RssAnon"])
            peaks["rss"] = max(peaks["rss"], status["VmRSS"])
            peaks["file"] = max(peaks["file"], status["RssFile"])
            self._hwm = status["VmHWM"]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def summary(self) -> dict:
        """Overall peaks, VmHWM, and per phase: wall and CPU seconds (all threads; steadier than wall
        time on a shared machine) and peak anon / RSS / mapped-file bytes."""
        with self._lock:
            phases = {name: {"seconds": round(self._seconds.get(name, 0.0), 3),
                             "cpu_seconds": round(self._cpu_seconds.get(name, 0.0), 3), "peak_anon_bytes": p["anon"],
                             "peak_rss_sampled_bytes": p["rss"], "peak_rss_file_bytes": p["file"]}
                      for name, p in self._peaks.items() if name != "end"}
            return {
                "peak_anon_bytes": max(p["anon"] for p in self._peaks.values()),
                "peak_rss_sampled_bytes": max(p["rss"] for p in self._peaks.values()),
                "vm_hwm_bytes": self._hwm,
                "samples": self.samples,
                "interval_s": self.interval_s,
                "phases": phases,
            }
