"""Per-GPU sampling through NVML (nvidia-ml-py). No driver, no library, no GPU -> no GPUs.

Each reading is taken on its own: a board that does not support power or clock readings
still reports the others (the missing ones are None and the series is absent).
"""

from __future__ import annotations

from typing import Any


class NvmlGpus:
    def __init__(self) -> None:
        self._nv: Any = None
        self._handles: list[Any] = []
        self.names: list[str] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self.names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
            self._nv = pynvml
        except Exception:
            # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...:
            # all mean "this node has no usable NVIDIA GPU", which is not an error.
            self._handles = []

    @property
    def count(self) -> int:
        return len(self._handles)

    def sample(self) -> list[dict[str, Any]]:
        nv = self._nv
        out = []
        for index, handle in enumerate(self._handles):
            gpu: dict[str, Any] = {"gpu": index, "name": self.names[index]}
            util = _try(lambda: nv.nvmlDeviceGetUtilizationRates(handle).gpu)
            gpu["util"] = None if util is None else util / 100.0
            mem = _try(lambda: nv.nvmlDeviceGetMemoryInfo(handle))
            gpu["mem_used"] = None if mem is None else int(mem.used)
            gpu["mem_total"] = None if mem is None else int(mem.total)
            power = _try(lambda: nv.nvmlDeviceGetPowerUsage(handle))  # milliwatts
            gpu["power_w"] = None if power is None else power / 1000.0
            gpu["temp_c"] = _try(lambda: float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU)))
            clock = _try(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM))  # MHz
            gpu["sm_clock_hz"] = None if clock is None else clock * 1e6
            out.append(gpu)
        return out

    def close(self) -> None:
        if self._nv is not None:
            _try(self._nv.nvmlShutdown)
            self._nv = None
            self._handles = []


def _try(fn):
    try:
        return fn()
    except Exception:  # NVMLError_NotSupported and friends: this reading is absent
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
