"""One line naming the machine a benchmark ran on (CPU model, cores, load), for its printed header."""

from __future__ import annotations

import os
import platform


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return f"{cpu}, {os.cpu_count()} logical cores, load average {load}"
