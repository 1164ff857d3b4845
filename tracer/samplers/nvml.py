"""GPU utilisation from NVML (pynvml, from the nvidia-ml-py package).

The driver keeps its own utilisation samples, each the busy share of one short period
(1/6 s on current GPUs) stamped with the CPU wall-clock time (µs) at its end.  Reading
them with nvmlDeviceGetSamples gives every period once with its own time, where polling
nvmlDeviceGetUtilizationRates would re-read whichever period ended last.  Each call
asks for the samples newer than the newest one seen, so the poll interval only bounds
the delay.  Drivers that keep no samples get the rates, one per poll.

nvmlDeviceGetProcessUtilization gives each process's share of the same samples, so that
on a shared GPU the analysis can count only the traced job's work.

Rows are tuples (mono_ns, index, uuid, bus_id, util, mem_util, mem_mib, dur_ns, pid):
see the `gpu` kind in trace/schema.py."""

from __future__ import annotations

import time

import numpy as np

from trainbpf.tracer.samplers.clock import wall_minus_mono_ns

# nvmlValueType_t -> the nvmlValue_t member holding the value
VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


class NvmlSource:
    def __init__(self):
        self.offset = wall_minus_mono_ns()  # measured again at each poll
        self.gpus: list[dict] = []  # index, uuid, bus_id
        self.sampling: str | None = None  # "driver_samples" or "rates"
        self.period_ns: int | None = None  # the driver's sample period, when seen
        self.per_process = False
        self._nv = None
        self._handles: list = []
        self._last: list[int] = []  # per GPU: newest driver sample read (wall µs)
        self._proc_last: list[int] = []  # per GPU: newest per-process sample read

    def open(self) -> bool:
        """Initialise NVML and name the GPUs; False when NVML is not there (no pynvml,
        no libnvidia-ml, no driver, no GPU)."""
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
        except Exception:  # ImportError, or any NVMLError from loading and init
            return False
        self._nv = pynvml
        try:
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            for i, h in enumerate(self._handles):
                self.gpus.append({"index": i, "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                                  "bus_id": _text(pynvml.nvmlDeviceGetPciInfo(h).busId), "node": _numa_node(pynvml, h)})
        except pynvml.NVMLError:
            self.close()
            return False
        if not self._handles:
            self.close()
            return False
        self._prime()
        return True

    def _prime(self) -> None:
        """Start each GPU's reading at its newest driver sample: the first sample read
        then has a known period, and the held samples' spacing is the driver's period.
        A driver that answers with anything but "none yet" keeps no samples: rates."""
        nv = self._nv
        steps: list[int] = []
        for h in self._handles:
            try:
                ts = [t for t, _ in self._samples(h, nv.NVML_GPU_UTILIZATION_SAMPLES, 0)]
            except nv.NVMLError:
                self.sampling = "rates"
                return
            steps += np.diff(ts).tolist()
            self._last.append(ts[-1] if ts else 0)
        self.sampling = "driver_samples"
        self.period_ns = int(np.median(steps)) * 1000 if steps else None
        self._proc_last = list(self._last)
        self.per_process = True  # until the driver says otherwise

    def poll(self) -> list[tuple]:
        """The rows that arrived since the last poll, every GPU."""
        nv = self._nv
        rows: list[tuple] = []
        # The driver stamped these samples within the last poll interval: the wall clock's
        # offset now converts them, wherever a step has moved it since the start.
        self.offset = wall_minus_mono_ns()
        for i, (g, h) in enumerate(zip(self.gpus, self._handles)):
            try:
                mem_mib = nv.nvmlDeviceGetMemoryInfo(h).used / 2**20
                if self.sampling == "driver_samples":
                    rows += self._device_rows(i, g, h, mem_mib)
                else:
                    u = nv.nvmlDeviceGetUtilizationRates(h)
                    rows.append((time.monotonic_ns(), g["index"], g["uuid"], g["bus_id"],
                                 float(u.gpu), float(u.memory), mem_mib, None, None))
                if self.per_process:
                    rows += self._process_rows(i, g, h)
            except nv.NVMLError:
                continue  # this GPU this time; the next poll tries again
        return rows

    def _device_rows(self, i: int, g: dict, h, mem_mib: float) -> list[tuple]:
        nv = self._nv
        last = self._last[i]
        util = [(t, v) for t, v in self._samples(h, nv.NVML_GPU_UTILIZATION_SAMPLES, last) if t > last]
        if not util:
            return []
        try:  # asked from the same point, so every utilisation sample finds its twin
            mem = dict(self._samples(h, nv.NVML_MEMORY_UTILIZATION_SAMPLES, last))
        except nv.NVMLError:
            mem = {}
        rows = []
        prev = last or None
        for t, v in sorted(util):  # the driver's buffer need not be in time order
            rows.append((self._mono(t), g["index"], g["uuid"], g["bus_id"], float(v), mem.get(t), mem_mib,
                         (t - prev) * 1000 if prev else None, None))
            prev = t
        self._last[i] = prev
        return rows

    def _process_rows(self, i: int, g: dict, h) -> list[tuple]:
        """Each process's share of the samples newer than the last call's newest: the
        value covers (since, timeStamp], which is its dur_ns."""
        nv = self._nv
        since = self._proc_last[i]
        try:
            entries = nv.nvmlDeviceGetProcessUtilization(h, since)
        except nv.NVMLError_NotFound:
            return []
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            self.per_process = False
            return []
        entries = [e for e in entries if e.timeStamp > since]
        if entries:
            self._proc_last[i] = max(e.timeStamp for e in entries)
        return [(self._mono(e.timeStamp), g["index"], g["uuid"], g["bus_id"], float(e.smUtil), float(e.memUtil),
                 None, (e.timeStamp - since) * 1000 if since else None, int(e.pid)) for e in entries]

    def _samples(self, h, kind: int, last_seen_us: int) -> list[tuple[int, float]]:
        """(wall µs, value) of the driver's samples of `kind` newer than `last_seen_us`."""
        nv = self._nv
        try:
            value_type, samples = nv.nvmlDeviceGetSamples(h, kind, last_seen_us)
        except nv.NVMLError_NotFound:  # none newer yet
            return []
        field = VALUE_FIELDS[value_type] if 0 <= value_type < len(VALUE_FIELDS) else "uiVal"
        return [(int(s.timeStamp), getattr(s.sampleValue, field)) for s in samples]

    def processes(self) -> set[tuple[int, str]]:
        """(pid, uuid) of every compute process on every GPU."""
        nv = self._nv
        found: set[tuple[int, str]] = set()
        if nv is None:  # closed
            return found
        for g, h in zip(self.gpus, self._handles):
            try:
                found |= {(int(p.pid), g["uuid"]) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}
            except nv.NVMLError:
                continue
        return found

    def _mono(self, wall_us: int) -> int:
        return wall_us * 1000 - self.offset

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass
            self._nv = None


def _numa_node(pynvml, handle) -> int | None:
    """The device's NUMA node where the driver knows it (None: read the PCI device's)."""
    try:
        node = int(pynvml.nvmlDeviceGetNumaNodeId(handle))
    except (pynvml.NVMLError, AttributeError):  # not supported, or bindings without the call
        return None
    return node if node >= 0 else None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
