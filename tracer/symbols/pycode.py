"""Naming the frames the BPF walk kept (probes/pyframes.h): a code object's function,
file and line, read from the live process once per code object.

Per frame the walk keeps the code object's address and the raw instruction word
(3.11+: the frame's instruction pointer into the code's bytecode; 3.10: f_lasti, an int
counting code units).  The line is looked up the way CPython's own PyCode_Addr2Line
does, in the code object's line table: 3.11+ the location table
(Objects/locations.md), 3.10 the PEP 626 table of (bytecode delta, line delta) pairs.
A table that cannot be read or decoded gives line 0, never a guess."""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from trainbpf.tracer.symbols import pyruntime

CODE_UNIT = 2  # bytes per instruction unit (_Py_CODEUNIT)
MAX_LINETABLE = 1 << 20  # a larger table is not a code object's


@dataclass(frozen=True)
class CodeInfo:
    function: str
    filename: str
    firstlineno: int
    ends: list[int]  # code units where each line range ends (exclusive), ascending
    lines: list[int]  # the line of each range; 0: no line

    def line(self, unit: int) -> int:
        if unit < 0:  # not started (3.10 f_lasti -1; 3.11/3.12 prev_instr one before the code)
            return self.firstlineno  # as PyCode_Addr2Line answers
        i = bisect.bisect_right(self.ends, unit)
        return self.lines[i] if i < len(self.lines) else 0


def _varint(table: bytes, pos: int) -> tuple[int, int]:
    """Locations' unsigned varint: 6 bits a byte, 0x40 = more follows."""
    byte = table[pos]
    value, shift = byte & 0x3F, 6
    pos += 1
    while byte & 0x40:
        byte = table[pos]
        value |= (byte & 0x3F) << shift
        shift += 6
        pos += 1
    return value, pos


def _svarint(table: bytes, pos: int) -> tuple[int, int]:
    value, pos = _varint(table, pos)
    return (-(value >> 1) if value & 1 else value >> 1), pos


def location_ranges(table: bytes, firstlineno: int) -> tuple[list[int], list[int]]:
    """3.11+ location table -> (range ends in code units, their lines)."""
    ends, lines = [], []
    line, unit, pos = firstlineno, 0, 0
    while pos < len(table):
        head = table[pos]
        if not head & 0x80:
            raise ValueError("location entry without its start bit")
        code, length = (head >> 3) & 0xF, (head & 7) + 1
        pos += 1
        if code == 15:  # no location
            shown = 0
        elif code in (13, 14):  # no columns; long form
            delta, pos = _svarint(table, pos)
            line += delta
            shown = line
            if code == 14:
                for _ in range(3):  # end line delta, column + 1, end column + 1
                    _, pos = _varint(table, pos)
        elif code >= 10:  # one-line form: the code is the line delta + 10, two column bytes
            line += code - 10
            shown = line
            pos += 2
        else:  # short form: same line, one column byte
            shown = line
            pos += 1
        unit += length
        ends.append(unit)
        lines.append(shown)
    return ends, lines


def pep626_ranges(table: bytes, firstlineno: int) -> tuple[list[int], list[int]]:
    """3.10 co_linetable -> (range ends in code units, their lines)."""
    ends, lines = [], []
    line, end = firstlineno, 0
    for i in range(0, len(table) - 1, 2):
        start_delta, line_delta = table[i], struct.unpack_from("b", table, i + 1)[0]
        end += start_delta
        if line_delta != -128:
            line += line_delta
        if start_delta:  # a zero-width entry only moves the line on
            ends.append(end // CODE_UNIT)
            lines.append(line if line_delta != -128 else 0)
    return ends, lines


class CodeNamer:
    """Names frames of one live CPython process (`PyProcess`, tracer/symbols/pyruntime.py)."""

    def __init__(self, proc: pyruntime.PyProcess):
        self.proc = proc
        self.off = proc.offsets
        self.mem = pyruntime.ProcessMemory(proc.pid)
        self.code_type = 0  # the `code` type object's address, once seen
        self.known: dict[int, CodeInfo | None] = {}

    def frame(self, code: int, instr: int) -> str | None:
        """`function (file:line)`, or None when `code` is not a readable code object."""
        info = self.known.get(code, False)
        if info is False:
            info = self.known[code] = self._read(code)
        if info is None:
            return None
        return f"{info.function} ({info.filename}:{info.line(self._unit(code, instr))})"

    def stack(self, walked: list[tuple[int, int]]) -> list[str]:
        """The named frames of a walk's (code, instruction word) pairs, innermost first;
        frames that cannot be named are left out."""
        return [f for f in (self.frame(code, instr) for code, instr in walked) if f]

    def _unit(self, code: int, instr: int) -> int:
        if self.proc.version == "3.10":
            return struct.unpack("<i", struct.pack("<I", instr & 0xFFFFFFFF))[0]
        return (instr - code - self.off["code.co_code_adaptive"]) // CODE_UNIT

    def _read(self, code: int) -> CodeInfo | None:
        mem, off = self.mem, self.off
        try:
            if not self._is_code(code):
                return None
            name = pyruntime.read_ascii(mem, mem.u64(code + off.get("code.qualname", off["code.name"])), off)
            filename = pyruntime.read_ascii(mem, mem.u64(code + off["code.filename"]), off)
            firstlineno = struct.unpack("<i", mem.read(code + off["code.firstlineno"], 4))[0]
        except pyruntime.PyRuntimeError:
            return None
        try:
            table = mem.u64(code + off["code.linetable"])
            size = mem.u64(table + off["bytes.ob_size"])
            if not 0 <= size <= MAX_LINETABLE:
                raise ValueError("line table size out of range")
            raw = mem.read(table + off["bytes.ob_sval"], size) if size else b""
            decode = pep626_ranges if self.proc.version == "3.10" else location_ranges
            ends, lines = decode(raw, firstlineno)
        except (pyruntime.PyRuntimeError, ValueError, IndexError, struct.error):
            ends, lines = [], []
        return CodeInfo(name, filename, firstlineno, ends, lines)

    def _is_code(self, obj: int) -> bool:
        tp = self.mem.u64(obj + self.off["obj.ob_type"])
        if self.code_type:
            return tp == self.code_type
        if pyruntime.type_name(self.mem, obj, self.off) != "code":
            return False
        self.code_type = tp
        return True

    def close(self) -> None:
        self.mem.close()
