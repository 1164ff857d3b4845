"""Numbers and frames as people read them, for the text and HTML reports: shares as
percentages, sizes in kB/MB/GB, durations in ms or s, rates per second, and Python
frames one per line, leaf first, as a stack.  `evidence_lines` shows a finding's
evidence that way.  The JSON report keeps the raw numbers; only renderers call this."""

from __future__ import annotations

from typing import Any

from trainbpf.reports.python_frames import frame_label

SIZE_UNITS = ("B", "kB", "MB", "GB", "TB")
# Evidence keys that hold stacks: native frames joined by ";" (stacks.stack_excerpt).
NATIVE_STACK_KEYS = ("user_stack", "kernel_stack")
NONE = "—"


SHORT_ID_CHARS = 12  # a container id as `docker ps` shows it


def container_words(container: dict[str, Any] | None) -> str | None:
    """The report's `container` in words: "0123456789ab (containerd), pod UID"; None
    for a process in none."""
    if not container:
        return None
    runtime = f" ({container['runtime']})" if container["runtime"] else ""
    pod = f", pod {container['pod_uid']}" if container["pod_uid"] else ""
    return f"{container['id'][:SHORT_ID_CHARS]}{runtime}{pod}"


def pct(share: float) -> str:
    """A share (0-1) as "12.3%"."""
    return f"{100.0 * share:.1f}%"


def size(n_bytes: float) -> str:
    """A byte count as "5.48 GB" (decimal units, as tools and disks print them)."""
    value, unit = float(n_bytes), 0
    while abs(value) >= 1000 and unit < len(SIZE_UNITS) - 1:
        value, unit = value / 1000, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.3g} {SIZE_UNITS[unit]}"


def duration(seconds: float) -> str:
    """Seconds as "2.35 s", below a second as "140 ms", below a millisecond as "12 µs"."""
    s = float(seconds)
    if abs(s) >= 1 or s == 0:
        return f"{s:.3g} s" if abs(s) < 100 else f"{s:.0f} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def number(key: str, value: Any) -> str:
    """One evidence number in the unit its key names (…bytes, …_ms, …_s, …_per_s,
    …share, …fraction); a count as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NONE if value in ("", None) else ("yes" if value is True else "no" if value is False else str(value))
    if key.endswith("bytes"):
        return size(value)
    if key.endswith("_per_s"):
        return f"{value:.3g}/s"
    if key.endswith("_ms"):
        return duration(value / 1e3)
    if key.endswith("_s") or key == "seconds":
        return duration(value)
    if key.endswith(("share", "fraction")):
        return pct(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def python_stack(frames: list[dict[str, Any]]) -> list[str]:
    """Python frames (leaf first) as a stack: "data.py:31 decode_batch  /srv/job/data.py"."""
    return [f"{frame_label(f)}  {f.get('file') or '?'}" for f in frames]


def _python_frames(value: dict[str, Any]) -> list[str]:
    """A finding's `python_frames`: the waiter's stack, then the producer's."""
    lines = []
    for end in ("waiter", "producer"):
        if value.get(end):
            lines += [f"{end}:"] + ["  " + line for line in python_stack(value[end])]
    return lines


def _item(key: str, item: Any) -> str:
    """One element of an evidence list: a frame by its label, a record as "key value"s."""
    if isinstance(item, dict) and "function" in item:
        seconds = f"  {duration(item['seconds'])}" if "seconds" in item else ""
        return (frame_label(item) if item.get("file") else str(item["function"])) + seconds
    if isinstance(item, dict):
        return ", ".join(f"{k} {number(k, v)}" for k, v in item.items())
    return number(key, item)


def evidence_lines(key: str, value: Any) -> list[str]:
    """An evidence value as lines for people: numbers in their units, stacks one frame
    a line, lists one item a line, mappings one key a line."""
    if key == "python_frames" and isinstance(value, dict):
        return _python_frames(value) or [NONE]
    if key in NATIVE_STACK_KEYS and isinstance(value, str):
        return value.split(";") if value else [NONE]
    if isinstance(value, list):
        return [_item(key, v) for v in value] or [NONE]
    if isinstance(value, dict):
        # Keyed by names or ids (seconds per state, ops per kind): the unit is `key`'s.
        return [f"{k}: {number(key, v)}" for k, v in value.items()] or [NONE]
    return [number(key, value)]


def task_label(c: dict[str, Any]) -> str:
    """A task a culprit names, as every report line names one: "name (tid)", its process
    too where that is known and differs, "name (tid, pid P)"."""
    where = f"{c['tid']}" if c["pid"] in (None, c["tid"]) else f"{c['tid']}, pid {c['pid']}"
    return f"{c['name'] or '?'} ({where})"


def culprit_lines(culprits: list[dict[str, Any]]) -> list[str]:
    """What a disk, memory or network finding blames: the device, the memory cgroup, the
    files (written back, added to the cache, read again) with who dirtied them, the
    other tasks whose I/O filled the device, the network peers and the uploads on their
    interface: a line each, for the text and HTML reports."""
    lines = []
    for c in culprits:
        if c["kind"] == "device":
            lines.append(f"disk: {c['name']} ({c['device']}), {size(c['bytes'])} of requests during the waits")
        elif c["kind"] == "cgroup":
            held = ", ".join(f"{label} {size(c[key])}" for key, label in (
                ("limit_bytes", "limit"), ("usage_bytes", "usage"), ("file_bytes", "page cache"),
                ("anon_bytes", "anonymous")) if key in c)
            lines.append(f"cgroup: {c['name']} ({held})")
        elif c["kind"] == "file":
            lines.append(f"file: {c['name']} ({_file_amounts(c)})")
        elif c["kind"] == "peer":
            lines.append(_peer_line(c))
        elif c.get("uploader"):
            lines.append(f"upload: {task_label(c)} sent "
                         f"{size(c['bytes'])} on {c['interface'] or 'the interface'} during the waits "
                         f"({size(c['rate_bytes_per_s'])}/s)")
        elif "folios" in c:
            at = f" at {c['function']}" if c.get("function") else ""
            lines.append(f"dirtied by: {task_label(c)}{at}, {c['folios']} folios")
        elif "direction" in c:
            lines.append(f"other I/O: {task_label(c)} {size(c['bytes'])} {c['direction']}")
    return lines


# write_path's paths as a file culprit's line says them (the others by their own name).
_PATH_WORDS = {"mapped": "through a shared mapping"}


def _peer_line(c: dict[str, Any]) -> str:
    host = f" ({c['host']})" if c.get("host") else ""
    said = [f"waited {duration(c['seconds'])}", f"{size(c['recv_bytes'])} received, {size(c['send_bytes'])} sent"]
    if c["requests"]:
        said.append(f"{c['requests']} requests, {duration(c['mean_latency_ms'] / 1e3)} each on average")
    if c["retransmits"]:
        said.append(f"{c['retransmits']} retransmits")
    return f"peer: {c['name']}{host}: " + ", ".join(said)


def _file_amounts(c: dict[str, Any]) -> str:
    said = [f"{size(c[key])} {what}" for key, what in (
        ("written_back_bytes", "written back"), ("dirtied_bytes", "dirtied"), ("added_bytes", "added to the page cache"),
        ("refaulted_bytes", "read again"))
        if key in c]
    if c.get("write_paths"):
        said.append(f"written {'/'.join(_PATH_WORDS.get(p, p) for p in c['write_paths'])}")
    return ", ".join(said)


def memory_sentences(memory: dict[str, Any]) -> list[str]:
    """The `memory` section in words: the THP mode, then one sentence per process."""
    thp = memory["thp"]
    out = [] if not memory["processes"] and thp.get("enabled") is None else \
        [f"Transparent huge pages: {thp.get('enabled') or 'unknown'} (defrag {thp.get('defrag') or 'unknown'})"]
    for p in memory["processes"]:
        pages = "huge pages (2 MiB) used" if p["huge_pages"] else \
            f"4 KiB pages: huge pages would take {p['faults_with_huge_pages']:,} faults"
        out.append(f"process {p['pid']}: {p['faults_per_mib']:.1f} faults per MiB newly mapped "
                   f"({p['faults']:,} faults over {size(p['mapped_bytes'])}); {pages}")
    for t in memory.get("tlb_shootdowns", []):
        out.append(f"{t['comm'] or '?'} ({t['tid']}) was interrupted by {t['received']:,} TLB shootdowns"
                   + "".join(f"; {shootdown_sender(s)}" for s in t["senders"]))
    return out


def numa_sentences(numa: dict[str, Any] | None) -> list[str]:
    """The `numa` section in words: the bytes copied to the GPU per source page node."""
    if not numa:
        return []
    nodes = ", ".join(f"{size(b)} from node {n}" for n, b in sorted(numa["bytes_by_node"].items()))
    home = "the GPU's node unknown" if numa["gpu_node"] is None else f"GPU on node {numa['gpu_node']}"
    remote = "" if numa["remote_share"] is None else f": {numa['remote_share']:.0%} from other nodes"
    out = [f"Copied to the GPU from host memory: {size(numa['copied_bytes'])} ({nodes or 'none'}; {home}){remote}"]
    if numa["device_source_bytes"] or numa["unknown_bytes"]:
        out.append(f"Not counted: {size(numa['device_source_bytes'])} copied from device memory, "
                   f"{size(numa['unknown_bytes'])} whose source page was not looked up")
    return out


def shootdown_sender(s: dict[str, Any]) -> str:
    """A thread whose mapping changes sent TLB shootdowns: "tb_unmapper (12) sent 181
    with its unmaps (munmap 266, mmap 266)"."""
    calls = ", ".join(f"{name} {n:,}" for name, n in s["mm_calls"].items())
    return f"{s['comm'] or '?'} ({s['tid']}) sent {s['shootdowns']:,} with its unmaps" + (f" ({calls})" if calls else "")
