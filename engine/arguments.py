"""Checks of command-line values, shared by every CLI (strata, strata-pack, strata-budget, strata-profile).

Each check raises ValueError naming the flag, what was found and what is expected, so a command
refuses a bad value before it loads anything (the load and warm-up take seconds to minutes).

Why each rule exists:
- Floats must be finite: `--temp inf` once passed a `>= 0` check and the sampler then divided -inf by
  inf and emitted token 0 every step; NaN fails every comparison, so a range check written as
  "refuse when < lo" lets it through.
- Counts are ASCII digits only: str.isdigit() is true for '²' (int() then fails with a bare
  "invalid literal") and for '٣' (int() reads it as 3, so a typo became a token id).
"""

from __future__ import annotations

import errno
import math
import os
import shutil
from pathlib import Path


def finite(flag: str, value: float | None, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, note: str = "") -> float | None:
    """`value` if it is a finite number in [lo, hi] (or (lo, hi] with lo_open); None passes."""
    if value is None:
        return None
    ok = math.isfinite(value) and (lo is None or (value > lo if lo_open else value >= lo)) and (hi is None or value <= hi)
    if not ok:
        raise ValueError(f"{flag} {value}: expected {_range(lo, hi, lo_open)}{f' ({note})' if note else ''}")
    return value


def _range(lo, hi, lo_open) -> str:
    if lo is not None and hi is not None:
        return f"a number in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"
    if lo is not None:
        return f"a finite number {'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"a finite number <= {_num(hi)}"
    return "a finite number"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def is_count(text: str) -> bool:
    """ASCII digits only (see the module note: '²' and '٣' are str.isdigit())."""
    return text.isascii() and text.isdigit()


def count(flag: str, text: str, what: str = "a non-negative integer") -> int:
    if not is_count(text):
        raise ValueError(f"{flag} {text!r}: expected {what} (ASCII digits 0-9)")
    return int(text)


def parse_prefill(text: str) -> int | None:
    """`--prefill auto|CHUNK|off` -> None (auto: the chunk engine/budget.py's auto_prefill_chunk picks),
    a chunk of CHUNK tokens, or 0 (off: token by token)."""
    if text == "auto":
        return None
    if text == "off":
        return 0
    if not is_count(text):
        raise ValueError(f"--prefill {text!r}: expected auto, off or a chunk size in tokens")
    return int(text)


def parse_stream_min_tokens(text: str) -> int | None:
    """`--stream-min-tokens auto|N|off` -> None (auto: engine/tier/staging.py's auto_min_tokens), N >= 1
    tokens, or 0 (off: a prompt chunk's non-resident experts run on the CPU)."""
    return _auto_off_tokens("--stream-min-tokens", text)


def parse_stream_layer_tokens(text: str) -> int | None:
    """`--stream-layer-tokens auto|N|off` -> None (auto: engine/tier/staging.py's auto_layer_tokens),
    N >= 1 tokens, or 0 (off: the device step streams no layer whole)."""
    return _auto_off_tokens("--stream-layer-tokens", text)


def _auto_off_tokens(flag: str, text: str) -> int | None:
    if text == "auto":
        return None
    if text == "off":
        return 0
    if not is_count(text) or int(text) < 1:
        raise ValueError(f"{flag} {text!r}: expected auto, off or a number of tokens >= 1")
    return int(text)


def read_text(flag: str, path: Path) -> str:
    """A UTF-8 text file; an undecodable byte is reported with the file and its byte offset."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:  # was a bare "[Errno 21] Is a directory: '/tmp'" naming no flag
        raise ValueError(f"{flag} {path}: {e.strerror}; expected a UTF-8 text file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text: byte {e.start} is 0x{data[e.start]:02x} ({e.reason}); "
                         "expected a UTF-8 file") from None


def writable_file(flag: str, path: Path) -> None:
    """`path` can be created: its directory exists and takes a file now (checked before a long run,
    so that the run cannot end in an unwritable path after all the compute)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: a directory; expected a file name")
    parent = path.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    probe = parent / f".{path.name}.probe-{os.getpid()}"
    try:
        probe.open("wb").close()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot write in {parent} ({e.strerror})") from None
    probe.unlink()


def fits_memory(flag: str, shown: str, need_bytes: int, available: int | None, what: str) -> None:
    """Refuse a size whose `need_bytes` (what it sizes) exceeds the host memory available now;
    `shown` is the flag and its value as the message gives them."""
    if available is not None and need_bytes > available:
        raise ValueError(f"{shown}: {what} needs {_gib(need_bytes)}, the host has {_gib(available)} available; "
                         f"lower {flag}")


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem `path` (a file to be written, or a directory) would be written to."""
    d = Path(path)
    while not d.is_dir() and d != d.parent:
        d = d.parent
    try:
        return shutil.disk_usage(d).free
    except OSError:
        return None


def check_free_space(flag: str, path: Path, need_bytes: int) -> None:
    """Refuse an output that cannot fit before the run that produces it (a full disk was once a bare
    "[Errno 28]" after all the compute, naming no file and no size)."""
    free = free_bytes(path)
    if free is not None and need_bytes > free:
        raise ValueError(f"{flag} {path}: needs {_gib(need_bytes)}, the filesystem there has {_gib(free)} free")


def no_space(e: OSError, outputs) -> str | None:
    """The message for a disk that filled during the run (ENOSPC), naming the outputs and the free
    space now; None for any other error."""
    if getattr(e, "errno", None) != errno.ENOSPC:
        return None
    paths = [Path(p) for p in outputs if p is not None]
    where = ", ".join(str(p) for p in paths) or "the output"
    free = free_bytes(paths[0]) if paths else None
    left = f"; {_gib(free)} free there now" if free is not None else ""
    return f"no space left on the device while writing {where}{left} (nothing was left half-written)"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB ({n} B)"
