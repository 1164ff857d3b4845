"""The sources a recording runs beside its probes (the BPF collectors loader.select
chooses), in the order the session calls them: a new source is a Source subclass
(tracer/source.py) and one line in SOURCES."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from trainbpf.tracer import loader
from trainbpf.tracer.collectors.cuda import DEVICE_SOURCE_CALLS
from trainbpf.tracer.samplers import containers, jobenv, procfs, taskstats
from trainbpf.tracer.samplers.memcg import CgroupSampler, cgroup_batch
from trainbpf.tracer.samplers.files import FileNames
from trainbpf.tracer.samplers.gpu import GpuSampler
from trainbpf.tracer.samplers.pagenodes import Affinities, PageNodes
from trainbpf.tracer.source import Source
from trainbpf.tracer.symbols.addrs import AddressDescriber, futex_pairs
from trainbpf.tracer.symbols.maps import ProcMaps
from trainbpf.tracer.symbols.pystacks import PythonStacks
from trainbpf.tracer.symbols.stacks import StackSymbolizer, drop_irq_wakers, kernel_refs, user_refs

# vmstat and PSI are summed over the recording: sampled this often, and at the stop.
PROC_SAMPLE_S = 5.0


def _present(*batches: pa.RecordBatch | None) -> list[pa.RecordBatch]:
    return [b for b in batches if b is not None]


class StackNames(Source):
    """Native stacks by name: kernel ones at each flush, user ones placed in their files
    at each flush and named after the stop (tracer/symbols/stacks.py)."""

    name = "stacks"
    symbolizer: StackSymbolizer | None = None

    def start(self) -> dict:
        self.symbolizer = StackSymbolizer(self.session.bpf)
        self.symbolizer.load_kernel_symbols()  # kallsyms alone, tens of ms: before the clock starts
        self.session.threads.exec_listeners.append(self.symbolizer.exec_seen)
        return {}

    def describe(self, rows: pa.RecordBatch, maps: ProcMaps) -> tuple[pa.RecordBatch, list[pa.RecordBatch]]:
        """Kernel stacks first: they tell which wake-ups came from interrupt context, whose
        "waker" (the task that happened to be interrupted) is dropped from the rows."""
        kernel = self.symbolizer.symbolize(kernel_refs(rows), [])
        rows = drop_irq_wakers(rows, self.symbolizer.irq_id_array())
        return rows, _present(kernel, self.symbolizer.symbolize([], user_refs(rows), maps))

    def end(self, now_ns: int, ended: list[pa.RecordBatch], *, final: bool) -> list[pa.RecordBatch]:
        return ended + _present(self.symbolizer.finish(now_ns)) if final else ended

    def meta(self) -> dict:
        settings = self.session.settings
        return {"stacks": {"frames": settings.stack_frames, "entries": settings.stack_entries,
                           **loader.stack_counts(self.session.bpf)}}

    def close(self) -> None:
        if self.symbolizer is not None:
            self.symbolizer.close()


class FutexAddresses(Source):
    """What the futex rows' addresses are (a lock in a library, a heap word)."""

    name = "futex_addrs"

    def open(self, session) -> None:
        super().open(session)
        self.describer = AddressDescriber()
        # only the futex probe records futex rows: looking for them costs ~0.2 ms a flush
        self.wanted = any(p.name == "futex" for p in session.probes)

    def start(self) -> dict:
        self.session.threads.exec_listeners.append(self.describer.exec_seen)
        return {}

    def describe(self, rows: pa.RecordBatch, maps: ProcMaps) -> tuple[pa.RecordBatch, list[pa.RecordBatch]]:
        return rows, _present(self.describer.describe(futex_pairs(rows), maps) if self.wanted else None)


class PythonFrames(Source):
    """The Python stacks the probes walked, named while their processes live, with
    settings.python_frames (tracer/symbols/pystacks.py)."""

    name = "python_frames"
    stacks: PythonStacks | None = None

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        session = self.session
        if session.settings.python_frames:
            cpus, entries = loader.py_stack_table()
            self.stacks = PythonStacks(session.bpf, cpus=cpus, stack_entries=entries, notice=session.notice)
            session.threads.exec_listeners.append(self.stacks.exec_seen)
            self.stacks.track(session.threads)
        return []

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        if self.stacks is None:
            return []
        named = self.stacks.take(now_ns)  # named while the processes live, then new threads
        self.stacks.track(self.session.threads)
        return _present(named)

    def end(self, now_ns: int, ended: list[pa.RecordBatch], *, final: bool) -> list[pa.RecordBatch]:
        if not final or self.stacks is None:
            return ended
        # stacks of threads blocked to the end, read while they still are
        return [b for batch in ended for b in self.stacks.fill_blocked(batch, now_ns)]

    def meta(self) -> dict:
        return self.stacks.meta() if self.stacks else {"python_frames": {"enabled": False}}

    def close(self) -> None:
        if self.stacks is not None:
            self.stacks.close()


class GpuSamples(Source):
    """The GPUs' utilisation and the traced processes on them (tracer/samplers/gpu.py)."""

    name = "gpu"
    sampler: GpuSampler | None = None

    def open(self, session) -> None:
        super().open(session)
        self.sampler = GpuSampler(mode=session.config.gpu)
        self.sampler.check()
        self.at_start: list[dict] = []  # [{pid, uuid}]

    def start(self) -> dict:
        session, gpu = self.session, self.sampler
        gpu.start()
        self.at_start = gpu.processes({t.pid for t in session.seed} | ({session.pid} if session.pid else set()))
        return {"topology": procfs.topology(gpu.gpus, session.declared_topology),
                "gpu": {**gpu.meta(), "processes": self.at_start}}

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        return _present(self.sampler.take())

    def meta(self) -> dict:
        gpu = self.sampler
        return {"gpu": {**gpu.meta(), "samples": gpu.count, "process_samples": gpu.process_count,
                        "processes": self._processes(self.session.threads.tgids())}}

    def _processes(self, tgids: list[int]) -> list[dict]:
        """The traced processes' GPUs seen at the start or now (at the stop)."""
        now = self.sampler.processes(set(tgids)) if self.sampler.source else []
        merged = {(p["pid"], p["uuid"]): p for p in self.at_start + now}
        return [merged[k] for k in sorted(merged)]

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()


class ProcSamples(Source):
    """vmstat and PSI, summed over the recording (tracer/samplers/procfs.py)."""

    name = "proc"
    sampler: procfs.ProcSampler | None = None

    def start(self) -> dict:
        return {"thp": procfs.thp_mode()}  # what faults per MiB are judged against

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        self.sampler = procfs.ProcSampler(interval_ns=int(PROC_SAMPLE_S * 1e9))  # starts within the trace
        return []

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        return self.sampler.take(final=final)

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()


class MemoryCgroups(Source):
    """The traced processes' memory cgroups: limits, usage and what fills them, at the
    start, every settings.cgroup_sample_ns and at the stop (tracer/samplers/memcg.py)."""

    name = "memory_cgroup"
    sampler: CgroupSampler | None = None

    def open(self, session) -> None:
        super().open(session)
        self.taken: list[tuple] = []  # rows read since the last flush: one batch a flush, not one a sample

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        self.sampler = CgroupSampler()
        self.next_ns = self.session.start_ns
        self.sample(self.session.start_ns)
        return []

    def sample_interval_ns(self) -> int | None:
        return self.session.settings.cgroup_sample_ns

    def sample(self, now_ns: int, *, final: bool = False) -> None:
        if self.sampler is None or (now_ns < self.next_ns and not final):
            return
        self.next_ns = now_ns + self.session.settings.cgroup_sample_ns
        self.taken += self.sampler.rows(now_ns, self.session.threads.tgids(), final=final)

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        if final:  # the cgroups as the recording ends
            self.sample(now_ns, final=True)
        taken, self.taken = self.taken, []
        return _present(cgroup_batch(taken))

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()


class NumaPages(Source):
    """Each traced process's pages per NUMA node, at the start and at the stop."""

    name = "numa_maps"

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        return _present(procfs.numa_maps_batch(self.session.threads.tgids(), "start"))

    def end(self, now_ns: int, ended: list[pa.RecordBatch], *, final: bool) -> list[pa.RecordBatch]:
        return ended + _present(procfs.numa_maps_batch(self.session.threads.tgids(), "end")) if final else ended


class CopySources(Source):
    """The NUMA node of each CUDA copy's source page (`copy_node` rows, a query-only
    move_pages while the process lives: tracer/samplers/pagenodes.py), and each traced
    thread's CPU affinity and allowed memory nodes when first seen (`affinity` rows)."""

    name = "copy_sources"

    def open(self, session) -> None:
        super().open(session)
        self.pages = PageNodes()
        self.affinities = Affinities()
        self.wanted = any(p.name == "cuda" for p in session.probes)  # only its rows have a source pointer

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        return self.flush(self.session.start_ns, final=False)

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        return _present(self.affinities.take(self.session.threads.live()))

    def describe(self, rows: pa.RecordBatch, maps: ProcMaps) -> tuple[pa.RecordBatch, list[pa.RecordBatch]]:
        if not self.wanted:
            return rows, []
        copies = rows.filter(pc.and_(pc.equal(rows.column("kind"), "cuda_call"), pc.equal(rows.column("state"), "copy")))
        # nested driver copies are the runtime copy's own; value holds the source pointer
        copies = copies.filter(pc.and_(pc.equal(copies.column("op"), 0), pc.greater(copies.column("value"), 0)))
        copies = copies.filter(pc.invert(pc.is_in(copies.column("name"), pa.array(sorted(DEVICE_SOURCE_CALLS)))))
        if not copies.num_rows:
            return rows, []
        ts, tid, pid, src, size = (copies.column(c).to_pylist() for c in ("ts_ns", "tid", "pid", "value", "size"))
        return rows, _present(self.pages.copy_rows(ts, tid, pid, [int(a) for a in src], size))

    def meta(self) -> dict:
        return {"copy_sources": {"page_queries": self.pages.queries}}


class JobEnvironments(Source):
    """Each traced process's rank variables (`process_env` rows), read when it joins or
    execs, and the target's as the trace's `job` (tracer/samplers/jobenv.py)."""

    name = "job_env"

    def open(self, session) -> None:
        super().open(session)
        # under sudo, a process the user could no longer ptrace has its read thrown away
        self.reader = jobenv.JobEnvReader(admitted=session.gate.admits if session.gate is not None else None)
        self.target_env = self.reader.read(session.pid) if session.pid is not None else None

    def start(self) -> dict:
        return {"job": jobenv.job_meta(self.target_env)}

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        rows = self.flush(self.session.start_ns, final=False)
        note = jobenv.lone_rank_note(self.session.pid, self.target_env, list(self.reader.envs.values()))
        if note and self.session.notice:
            self.session.notice(note)
        return rows

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        return _present(self.reader.take(self.session.threads))


class Containers(Source):
    """The container each traced process runs in, from its cgroup path (`container` rows,
    tracer/samplers/containers.py), read when it joins."""

    name = "containers"

    def open(self, session) -> None:
        super().open(session)
        self.reader = containers.ContainerReader()

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        return self.flush(self.session.start_ns, final=False)

    def flush(self, now_ns: int, *, final: bool) -> list[pa.RecordBatch]:
        return _present(self.reader.take(self.session.threads))


class TaskDelays(Source):
    """Each traced thread's delay accounting (taskstats), at the start and at the stop."""

    name = "taskstats"

    def start(self) -> dict:
        return {"delayacct": taskstats.delayacct_enabled()}

    def seed(self, walked: list) -> list[pa.RecordBatch]:
        return _present(taskstats.snapshot(dict(self.session.threads.tgid), "start"))

    def end(self, now_ns: int, ended: list[pa.RecordBatch], *, final: bool) -> list[pa.RecordBatch]:
        return ended + _present(taskstats.snapshot(self.session.threads.live(), "end")) if final else ended


# After the probes, in this order: symbolisers name the flush's rows in turn, and each
# source's end() sees what the ones before it ended.
SOURCES: list[type[Source]] = [
    StackNames, FutexAddresses, PythonFrames, FileNames, JobEnvironments, Containers, GpuSamples, ProcSamples, MemoryCgroups,
    NumaPages, CopySources,
    TaskDelays,
]
