"""A mapped file that shrinks under the engine: a message naming it, not a silent SIGBUS.

The engine maps pool.bin and the source GGUFs it reads experts from (never copies). When one of them
is truncated or rewritten in place while a run reads it, the next read of a page past the new end
raises SIGBUS; the default action killed `strata generate` with exit 135 and nothing on stderr.

What can and cannot catch it (measured):
- A Python handler (signal.signal) cannot: CPython's C handler only sets a flag and returns, the
  faulting load runs again and faults again, and a fault inside a Numba kernel or a numpy copy never
  reaches a bytecode boundary anyway.
- faulthandler prints "Fatal Python error: Bus error" and a Python traceback, naming no file.
- A C-level handler can: `install` compiles one with Numba (`cfunc`, no Python inside) that reads the
  faulting address from siginfo, finds the mapping it falls in, write(2)s that file's prepared message
  and _exit(1)s (both async-signal-safe). It reads the table of mappings and messages from memory at
  an address fixed for the process, so it is compiled once per process (about 0.5-0.9 s, at the first
  load; not cached on disk on purpose: the address differs in every process), and each later load
  only rewrites the table.
It cannot resume the run (the data are gone); it makes the death explicit and names the file.

A file rewritten in place at the SAME size does not fault: the pages just hold other bytes. That is
caught by `Pack.check_unchanged` (size, mtime, inode against those at open), which the commands call
between tokens, so the run stops with a message instead of printing what the new bytes decode to.
"""

from __future__ import annotations

import ctypes
import faulthandler
import platform
import signal
import sys
from pathlib import Path

import numpy as np

_SA_SIGINFO = 4
_MAX_FILES = 64  # pool.bin and the GGUFs a pack maps (a split model: a few shards)
# The handler's data, at addresses fixed for the process: [0] the number of rows, then per mapped file
# (start, end, message address, message length). The handler is compiled once per process with these
# addresses as constants; each install only rewrites the table (a load costs no compile after the first).
_TABLE = (ctypes.c_uint64 * (1 + 4 * _MAX_FILES))()
_OTHER = ctypes.create_string_buffer(8192)  # the message for a fault outside every listed mapping
_KEEP: list = []  # the current messages (the table points into them)
_HANDLER: list = []  # the compiled handler, once per process


class _Sigaction(ctypes.Structure):
    # glibc's struct sigaction on 64-bit Linux (x86-64 and aarch64): handler, a 1024-bit mask, flags, restorer
    _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_uint64 * 16), ("flags", ctypes.c_int),
                ("restorer", ctypes.c_void_p)]


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64") and hasattr(signal, "SIGBUS")


def message(who: str, path: Path) -> str:
    return (f"{who}: error: {path} was truncated or rewritten while the engine was reading it (bus error on a "
            "mapped page); a file the pack maps must not change until the run ends: put the complete file back "
            "(strata-pack verify checks it) and run again\n")


def install(mapped: list[tuple[Path, np.ndarray]], who: str) -> bool:
    """Name the file in a SIGBUS that hits one of the `mapped` arrays; True when the C-level handler is
    installed, False where it cannot be (then faulthandler at least prints that a bus error killed the run)."""
    if not supported():
        faulthandler.enable()
        return False
    try:
        handler = _handler()
    except Exception:  # a Numba that cannot build a cfunc here: the fallback still says what killed the run
        faulthandler.enable()
        return False
    _fill_table(mapped, who)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sigaction.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigaction), ctypes.POINTER(_Sigaction)]
    sa = _Sigaction()
    sa.handler = handler.address
    sa.flags = _SA_SIGINFO
    if libc.sigaction(signal.SIGBUS, ctypes.byref(sa), None) != 0:
        faulthandler.enable()
        return False
    return True


def _fill_table(mapped: list[tuple[Path, np.ndarray]], who: str) -> None:
    keep, rows = [], []
    for path, data in mapped:
        if data.size == 0 or len(rows) == _MAX_FILES:
            continue
        text = message(who, path).encode()
        buf = ctypes.create_string_buffer(text)
        keep.append(buf)
        rows.append((data.ctypes.data, data.ctypes.data + data.size, ctypes.addressof(buf), len(text)))
    names = ", ".join(str(p) for p, _ in mapped)
    other = (f"{who}: error: bus error outside the pack's mappings ({names} are mapped; one of them may have "
             "changed while the engine ran)\n").encode()[: len(_OTHER) - 1]
    _TABLE[0] = 0  # no row is read while the table is rewritten
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            _TABLE[1 + 4 * i + j] = v
    ctypes.memmove(_OTHER, other + b"\0", len(other) + 1)
    _KEEP[:] = keep
    _TABLE[0] = len(rows)


def _handler():
    if _HANDLER:
        return _HANDLER[0]
    from llvmlite import ir
    from numba import carray, cfunc, types
    from numba.core.extending import intrinsic

    libc = ctypes.CDLL(None, use_errno=True)
    c_write = libc.write
    c_write.argtypes, c_write.restype = [ctypes.c_int, ctypes.c_size_t, ctypes.c_size_t], ctypes.c_ssize_t
    c_strlen = libc.strlen
    c_strlen.argtypes, c_strlen.restype = [ctypes.c_size_t], ctypes.c_size_t
    c_exit = libc._exit
    c_exit.argtypes, c_exit.restype = [ctypes.c_int], None

    @intrinsic
    def as_pointer(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

        return types.voidptr(types.uint64), codegen

    table_addr, other_addr = ctypes.addressof(_TABLE), ctypes.addressof(_OTHER)

    @cfunc(types.void(types.int32, types.voidptr, types.voidptr))
    def on_sigbus(sig, info, context):
        addr = carray(info, 4, np.uint64)[2]  # siginfo_t: si_signo, si_errno, si_code, pad, then si_addr
        table = carray(as_pointer(np.uint64(table_addr)), 1 + 4 * _MAX_FILES, np.uint64)
        for i in range(table[0]):
            if table[1 + 4 * i] <= addr < table[2 + 4 * i]:
                c_write(2, table[3 + 4 * i], table[4 + 4 * i])
                c_exit(1)
        c_write(2, other_addr, c_strlen(other_addr))
        c_exit(1)

    _HANDLER.append(on_sigbus)
    return on_sigbus
