"""specfleet's native CPU backend: one C library per ISA path, one loader, one ABI check, one table of the
C entry points' signatures.

Every C kernel (csrc/: the GGUF block-format products, the fused products, attention and the layer loop,
the bf16 linear) is linked into one library, compiled on first use by `native.compile_library` (the
system C compiler, OpenMP; into the cache, named by a hash of the sources and flags) and loaded with
ctypes, which releases the GIL for each call, so drafter threads overlap it.

csrc/ is split at an architecture boundary: the drivers (q_linear.c, fused_linear.c, attention.c,
layers.c, k_pack.c) and the contract (q_common.h) are arch-free C; each path links them with one
family's bodies (`BODIES`): csrc/arch/x86/ (AVX2, AVX-VNNI, AVX512-VNNI), csrc/arch/arm/ (NEON with the
dot product) or csrc/generic/ (plain C that any compiler builds).

ISA paths, best first (`ISA_PATHS`): `amx` (the 512-bit VNNI path whose Q4_K products over a prompt's
rows run on AMX's int8 tiles, csrc/arch/x86/amx_k.h), `avx512vnni`, `avxvnni`, `avx2` on x86-64 Linux, `neondot` on
aarch64 Linux. The CPU's flags pick the best one it runs; `SPECFLEET_ISA` (or RuntimeConfig.isa) pins a
slower one. `generic` runs on any Linux machine with a C compiler but is never picked by itself (it is
the reference the tests pin, tests/runtime/backends/native/test_csrc_generic.py). Each path is its own build, every path gives
the generic path's bits (tests/runtime/backends/native/test_isa_paths.py, tests/runtime/backends/native/test_csrc_generic.py, tests/runtime/backends/native/test_arm_qemu.py),
so the choice changes speed only. Per-path flags rather than -march=native: the same path builds the
same code on every machine with those flags, so its bits are too, and a test can build and compare each
path the CPU runs.

Where no path runs (another OS or CPU, an x86 without AVX2/FMA/F16C, an ARM without the dot product, no
compiler, a failed build, `SPECFLEET_NATIVE=0`) `library()` is None and `unavailable_reason()` says why,
in one line, once, in a warning; callers keep torch's routes (GGUF files load as dense weights).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import torch

from specfleet.runtime.backends.native import build as native

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
# the arch-free drivers every path links
DRIVERS = [_CSRC / n for n in ("q_linear.c", "fused_linear.c", "attention.c", "layers.c", "k_pack.c")]
# each family's bodies: the formats' column functions and quantizers, row ops, attention, the bf16 linear
BODIES: dict[str, list[Path]] = {
    "x86": [_CSRC / "arch" / "x86" / n for n in ("quants_legacy.c", "quants_k.c", "rowops.c", "attention.c",
                                                 "bf16_linear.c")],
    "arm": [*(_CSRC / "arch" / "arm" / n for n in ("quants.c", "rowops.c", "attention.c")),
            _CSRC / "generic" / "bf16_linear.c"],
    "generic": [_CSRC / "generic" / n for n in ("quants.c", "rowops.c", "attention.c", "bf16_linear.c")],
}
HEADERS = tuple(sorted(_CSRC.rglob("*.h")))
# every build: no fused multiply-add the source does not write (the bodies' shared bits depend on it)
BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
FAMILY_FLAGS = {"x86": ["-mavx2", "-mfma", "-mf16c"], "arm": ["-march=armv8.2-a+dotprod"], "generic": []}
# name -> (the CPU flags the path needs, what it adds to its family's flags), best first
ISA_PATHS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "amx": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"),
            ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8")),
    "avx512vnni": (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                   ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
    "avxvnni": (("avx_vnni",), ("-mavxvnni",)),
    "avx2": ((), ()),
    "neondot": (("asimddp",), ()),
    "generic": ((), ()),
}
FAMILY = {"amx": "x86", "avx512vnni": "x86", "avxvnni": "x86", "avx2": "x86", "neondot": "arm", "generic": "generic"}


def sources(path: str) -> list[Path]:
    """The C files of ISA path `path`'s library."""
    return DRIVERS + BODIES[FAMILY[path]]


def flags(path: str) -> list[str]:
    """The compiler flags of ISA path `path`'s library."""
    return BASE_FLAGS + FAMILY_FLAGS[FAMILY[path]] + list(ISA_PATHS[path][1]) + ["-lm"]


# 3: the K formats in the kernels' interleaved order (pack_k); 4: attention reads a key plan; 5: ISA paths;
# 6: the bf16 linear in the same library; 7: Q4_0, Q5_0 and Q8_0 in groups of eight blocks (g32_pack);
# 8: specfleet_set_prefetch; 9: specfleet_set_grouping; 10: a distance for weight rows in groups, prefetches into L2,
# grouping by the activations' size; 11: specfleet_set_prefetch_far, specfleet_set_chunk_bytes; 12: specfleet_set_schedule
ABI = 12
# input transforms of specfleet_q_linear_fused (csrc/fused_linear.c): none, RMSNorm with a weight, SiLU(gate) * up
PRE_NONE, PRE_RMSNORM, PRE_SILU_MUL = 0, 1, 2


class FusedPart(ctypes.Structure):
    """One weight of a fused product (csrc/q_common.h's sfq_part)."""

    _fields_ = [("type", ctypes.c_int64), ("W", ctypes.c_void_p), ("row_bytes", ctypes.c_int64),
                ("N", ctypes.c_int64), ("bias", ctypes.c_void_p)]


class NativeLayer(ctypes.Structure):
    """One decoder layer for `specfleet_decode_layers` (csrc/layers.c's sfq_layer)."""

    _fields_ = [("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p), ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("n_qkv", ctypes.c_int64), ("n_o", ctypes.c_int64), ("n_gate_up", ctypes.c_int64),
                ("n_down", ctypes.c_int64), ("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p),
                ("eps1", ctypes.c_double), ("eps2", ctypes.c_double), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# every C entry point: (argument types, result type)
SIGNATURES: dict[str, tuple[list, object]] = {
    "specfleet_q_abi": ([], _int),
    "specfleet_q_isa": ([], ctypes.c_char_p),
    "specfleet_set_prefetch": ([_i64, _i64, _i64, _i64], None),
    "specfleet_set_grouping": ([_i64, _i64], None),
    "specfleet_set_prefetch_far": ([_i64, _i64], None),
    "specfleet_set_chunk_bytes": ([_i64], None),
    "specfleet_set_schedule": ([_i64], None),
    "specfleet_q_linear": ([_int, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int], _int),
    "specfleet_q_act_row_bytes": ([_int, _i64], _i64),
    "specfleet_q_linear_fused": ([_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _f32, _ptr, _i64, _i64, _i64], _int),
    "specfleet_rope_kv": ([_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr], None),
    "specfleet_attend": ([_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _ptr,
                          _i64], _int),
    "specfleet_decode_layers": ([_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr,
                                 _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _f32, _i64], _int),
    "specfleet_k_pack": ([_int, _ptr, _ptr, _i64, _int], _int),
    "specfleet_g32_pack": ([_int, _ptr, _ptr, _i64, _i64, _int], _int),
    "specfleet_bf16_linear": ([_ptr, _i64, _i64, _ptr, _i64, _ptr, _int], None),
}

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}  # per ISA path, once tried (None: unavailable, see _reasons)
_reasons: dict[str, str] = {}
_default: ctypes.CDLL | None = None  # the library of `isa()`, once loaded (the hot path asks every forward)


def missing() -> str | None:
    """Why no native path can be built here, before trying (None: this machine's best path should build)."""
    reason = native.missing_prerequisite()
    if reason is None and native.machine_family() == "x86" and "f16c" not in native.cpu_flags():
        reason = "this CPU lacks F16C"
    return reason


def runnable_isas() -> list[str]:
    """The native ISA paths this CPU runs, best first (empty where none can; `generic` is not one of them)."""
    if missing() is not None:
        return []
    have, family = native.cpu_flags(), native.machine_family()
    return [name for name, (needs, _) in ISA_PATHS.items()
            if FAMILY[name] == family and set(needs) <= have]


def _pinnable(path: str) -> bool:
    return path in runnable_isas() or (path == "generic" and native.missing_prerequisite("generic") is None)


def isa(wanted: str | None = None) -> str | None:
    """The ISA path the kernels use here: `wanted` (else SPECFLEET_ISA) where set and runnable (`generic`
    wherever a C compiler is), else the best the CPU runs; None where no path runs. An unknown path, or
    one the CPU cannot run, is a ValueError."""
    wanted = (wanted if wanted is not None else os.environ.get("SPECFLEET_ISA", "")).strip().lower()
    paths = runnable_isas()
    if not wanted and _default is not None:  # the library in use (the best path, or the next where it failed to build),
        loaded = _default.specfleet_q_isa().decode()  # where it is one this CPU runs (not under a simulated CPU's flags)
        if loaded in paths:
            return loaded
    if wanted:
        if wanted not in ISA_PATHS:
            raise ValueError(f"ISA path {wanted!r} (SPECFLEET_ISA) is not a kernel path; choose one of {list(ISA_PATHS)}")
        if not _pinnable(wanted):
            raise ValueError(f"ISA path {wanted!r} (SPECFLEET_ISA): this CPU cannot run it (it runs {paths or 'none'})")
        return wanted
    return paths[0] if paths else None


# How the x86 products prefetch weights (csrc/arch/x86/x86.h stream_ahead): the distance in bytes for one activation
# row, for more row by row, and for weight rows in pairs and fours, and whether more rows prefetch into L2 (1) or L1
# (0), where it differs from the body's compiled default (quants_k.c: 4, 16 and 16 KB into L1 on the 512-bit VNNI
# path, measured on a Zen 5). On a Cascade Lake Xeon 16 KB made 2-9 verification rows 5-10 % slower than 4-8 KB (c(4)
# 1.66 against 1.55; benchmarks/kernels/prefetch.py, benchmarks/RESULTS.md, session 31). On a Zen 4 (AMD family 25
# with AVX512) 4 KB gave 2-9 rows 4-10 % faster forwards than 8-16 KB row by row (session 34), and prefetching into L2
# let the long-K products in pairs and fours (the down product, 8960 wide) verify 2-5 rows in 9-13 ms against 14-20
# ms (session 37); the AVX2 path, which goes row by row, verified 2 rows in 40.5 ms against 46.8 into L1 on that Zen 4
# (AMD family 25 is Zen 3 as well, with the same 32 KB L1 and 512 KB L2; on a Zen 3, session 42, into L2 or L1 were level
# within that machine's drift at 1-9 rows; no one-row prefetch and 8 KB made decode slower: 74 and 72 ms a one-row
# forward against 67-69). Keyed by ISA
# path, vendor and CPU family (None: any family of the vendor).
PREFETCH: dict[tuple[str, str, int | None], tuple[int, int, int, int]] = {
    ("avx512vnni", "GenuineIntel", None): (4096, 4096, 4096, 0),
    ("avx512vnni", "AuthenticAMD", 25): (4096, 4096, 16384, 1),
    ("avx2", "AuthenticAMD", 25): (4096, 4096, 4096, 1),
}
# The fewest activation rows for which the products take weight rows in pairs and fours (csrc/q_common.h
# sf_group_min_rows; compiled default 2), and the activation bytes (rows x row bytes) above which fewer rows, from 2,
# do too (sf_group_act_bytes; compiled 0, never), where they differ. On a Zen 4, whose 512-bit units run each
# instruction in two 256-bit halves, pairs and fours made the 1.5B's 2-row forward cost 1.68-1.81 decode steps against
# 1.17-1.18 row by row, and 5 rows 2.05-2.26 against 1.70-1.77; from 9 rows the fours win again (benchmarks/kernels/
# prefetch.py --group, session 34). That holds for the 1536-wide products; the 8960-wide down product reads 13 KB of
# activation quants a row for every weight row, which L1 does not hold for two rows, and there pairs and fours
# (prefetching into L2) win from 2 rows (session 37). From 8 rows (session 39): row by row made the 6- and 7-row
# forwards (the fleet's usual verification at one stream) 7-15 % faster and ran level from 9; 8 rows stay in groups, as
# row by row there sped plain decoding at 8 streams but not the fleet's 9-10 row batches (benchmarks/RESULTS.md).
# Keyed as PREFETCH.
GROUP_ROWS: dict[tuple[str, str, int | None], tuple[int, int]] = {("avx512vnni", "AuthenticAMD", 25): (8, 16384)}


# A second prefetch of the weights, further ahead and into L2 only (csrc/arch/x86/x86.h stream_ahead;
# sf_prefetch_far): (one activation row, more rows) distances in bytes, 0 for none (the compiled default). A core
# keeps as many misses to memory in flight as its L1 has fill buffers; where the L1 prefetch finds its lines already
# in L2 each fill buffer is held for an L2 hit only, so more of the stream is in flight. On an AMX Xeon (Golden Cove
# class cores, 2 vCPUs) 12 KB into L2 on top of the 4 KB into L1 made the 1.5B's one-row forward 10-13 % faster and
# 2-5 rows 5-15 % faster, 9 rows level; 8 KB and 16-24 KB less so, a non-temporal hint far slower (benchmarks/kernels/
# prefetch.py far= farmany=, benchmarks/RESULTS.md, session 48). Measured on that CPU only, so it is keyed to Intel
# CPUs with the tile unit (the `amx_tile` flag: Sapphire Rapids and later), on the 512-bit paths.
PREFETCH_FAR_AMX_XEON = (12288, 12288)
# Elsewhere keyed as PREFETCH. On a Zen 5 (AMD family 26, 48 KB L1, 1 MB L2, 2 vCPUs) a second prefetch for more
# rows only, 6 KB ahead (nearer than the 16 KB of the L1 prefetch: it asks again, into L2, for lines whose L1
# prefetch was dropped while the fill buffers were full), made the 1.5B's 5- to 9-row forwards 7-12 % faster in two
# runs of 60 rounds; 4, 8, 12 and 24 KB helped less; for one row it made decode no faster (session 49).
PREFETCH_FAR: dict[tuple[str, str, int | None], tuple[int, int]] = {("avx512vnni", "AuthenticAMD", 26): (0, 6144)}


def prefetch_far_setting(path: str, vendor: str | None = None, flags: frozenset[str] | None = None,
                         family: int | None = None) -> tuple[int, int] | None:
    """(one row, more rows) far prefetch distances into L2 for ISA path `path` on this CPU: SPECFLEET_PREFETCH_FAR
    ("ONE,MANY" in bytes, 0 for none) where set, else PREFETCH_FAR_AMX_XEON on an Intel CPU with AMX running a
    512-bit path, else PREFETCH_FAR's entry for the path, vendor and family; None keeps the compiled default (none)."""
    env, values = _env_ints("SPECFLEET_PREFETCH_FAR")
    if env:
        if len(values) != 2 or not all(0 <= v <= 1 << 20 for v in values):
            raise ValueError(f"SPECFLEET_PREFETCH_FAR={env!r}: expected ONE_ROW,MANY_ROWS, byte counts in "
                             f"[0, {1 << 20}] (0: none)")
        return values[0], values[1]
    if _amx_xeon(path, vendor, flags):
        return PREFETCH_FAR_AMX_XEON
    return _tuned(PREFETCH_FAR, path, vendor, family)


# The fewest bytes of weight rows a one-row product (decode) hands a thread at once (csrc/q_common.h sf_chunk_rows;
# compiled 0: 64 rows, 32-80 KB of the 1.5B's and the 0.5B's matrices). Where a chunk ends, what the thread prefetched
# past it is another thread's and the next chunk starts cold, so longer chunks stream better. On the AMX Xeon, with the
# far prefetch, 128 KB made the 1.5B's one-row forward 5 % faster and the requantized 0.5B's decode 7-8 % (256 KB: 7 %
# and 6 %, 512 KB slower for the 0.5B; benchmarks/kernels/prefetch.py chunk=, benchmarks/RESULTS.md, session 48). Keyed
# as the far prefetch, with which it was measured.
CHUNK_BYTES_AMX_XEON = 131072
# Elsewhere keyed as PREFETCH. On a Zen 5 (AMD family 26) 256 KB made the 1.5B's one-row forward 7 % faster (26.9 ->
# 25.0 ms; 128 KB 5 %, 512 KB-2 MB level with 256 KB) and the requantized Q4_0 0.5B's 13 % (10.1 -> 8.8 ms; 512 KB the
# same), without the far prefetch for one row (session 49).
CHUNK_BYTES: dict[tuple[str, str, int | None], int] = {("avx512vnni", "AuthenticAMD", 26): 262144}


def chunk_bytes_setting(path: str, vendor: str | None = None, flags: frozenset[str] | None = None,
                        family: int | None = None) -> int | None:
    """The fewest bytes of a one-row product's chunks for ISA path `path` on this CPU: SPECFLEET_CHUNK_BYTES (0: 64
    rows) where set, else CHUNK_BYTES_AMX_XEON on an Intel CPU with AMX running a 512-bit path, else CHUNK_BYTES'
    entry for the path, vendor and family; None keeps the compiled default (64 rows)."""
    env, values = _env_ints("SPECFLEET_CHUNK_BYTES")
    if env:
        if len(values) != 1 or not 0 <= values[0] <= 1 << 24:
            raise ValueError(f"SPECFLEET_CHUNK_BYTES={env!r}: expected a byte count in [0, {1 << 24}] (0: 64 rows)")
        return values[0]
    if _amx_xeon(path, vendor, flags):
        return CHUNK_BYTES_AMX_XEON
    return _tuned(CHUNK_BYTES, path, vendor, family)


# How the products hand their chunks of weight rows to threads (csrc/q_common.h sf_schedule_guided): 1 guided (a
# thread takes a run of consecutive chunks, half of what is left over the threads, then shorter runs), 0 one chunk at a
# time (the compiled default). Handed one at a time, the two threads of a 2-core machine alternate chunks, each jumping
# over the other's rows, and what a thread prefetches past its chunk is the other's. On a Zen 5 (AMD family 26, 2
# vCPUs) guided made the 1.5B's one-row forward 11 % faster (22.7 -> 20.3 ms, with 256 KB chunks), 5 rows 14 % and 9
# rows 17 %, and the Q4_0 0.5B's one-row forward 5 % (8.0 -> 7.6 ms); a static split was level with guided (session
# 49). 2 (split): as guided, but a fused product over fewer than 32 activation rows gives each thread one run of its
# weight rows, of equal bytes: no thread waits at the end for another's last chunk (with 256 KB chunks the 0.5B's
# q/k/v product was 4 chunks); on the Zen 5, inside the layer loop's one team, the 0.5B's decoder layers 2-3 % faster
# at 1 and 5 rows and the 1.5B's likewise (session 50). Measured there only, so keyed as PREFETCH;
# SPECFLEET_SCHEDULE ("guided", "dynamic" or "split") overrides.
SCHEDULE: dict[tuple[str, str, int | None], int] = {("avx512vnni", "AuthenticAMD", 26): 2}
SCHEDULES = {"dynamic": 0, "guided": 1, "split": 2}


def schedule_setting(path: str, vendor: str | None = None, family: int | None = None) -> int | None:
    """1 where the products hand out their chunks in guided runs for ISA path `path` on this CPU, 0 one at a time, 2
    guided but one run of equal bytes a thread for fused products over few rows: SPECFLEET_SCHEDULE ("guided",
    "dynamic" or "split") where set, else SCHEDULE's entry; None keeps the compiled default (one at a time)."""
    env = os.environ.get("SPECFLEET_SCHEDULE", "").strip()
    if env:
        if env.lower() not in SCHEDULES:
            raise ValueError(f"SPECFLEET_SCHEDULE={env!r}: expected one of {', '.join(SCHEDULES)}")
        return SCHEDULES[env.lower()]
    return _tuned(SCHEDULE, path, vendor, family)


def _env_ints(name: str) -> tuple[str, list[int]]:
    """An override's text (stripped; "" where unset) and its comma-separated integers ([] where any is not one), for
    the setting functions to check and name in their errors."""
    env = os.environ.get(name, "").strip()
    try:
        return env, [int(v) for v in env.split(",")] if env else []
    except ValueError:
        return env, []


def _amx_xeon(path: str, vendor: str | None, flags: frozenset[str] | None) -> bool:
    """Whether `path` is a 512-bit path on an Intel CPU with the tile unit (where the far prefetch was measured)."""
    vendor = native.cpu_vendor() if vendor is None else vendor
    flags = native.cpu_flags() if flags is None else flags
    return path in ("amx", "avx512vnni") and vendor == "GenuineIntel" and "amx_tile" in flags


# paths whose settings are another path's: `amx` runs decode and verification on the avx512vnni kernels
TUNED_AS = {"amx": "avx512vnni"}


def _tuned(table: dict, path: str, vendor: str | None, family: int | None):
    vendor = native.cpu_vendor() if vendor is None else vendor
    family = native.cpu_family() if family is None else family
    path = TUNED_AS.get(path, path)
    return table.get((path, vendor, family), table.get((path, vendor, None)))


def prefetch_setting(path: str, vendor: str | None = None,
                     family: int | None = None) -> tuple[int, int, int, int] | None:
    """(one row, more rows, weight rows in groups, into L2) prefetch settings for ISA path `path` on this CPU:
    SPECFLEET_PREFETCH ("ONE,MANY" or "ONE,MANY,GROUPED,L2"; -1 keeps the compiled value) where set, else PREFETCH's
    entry for the path and the CPU's vendor and family; None keeps the compiled default."""
    env, values = _env_ints("SPECFLEET_PREFETCH")
    if env:
        if len(values) not in (2, 4):
            raise ValueError(f"SPECFLEET_PREFETCH={env!r}: expected ONE_ROW,MANY_ROWS[,GROUPED,L2]: byte counts and "
                             "0 or 1 for L2")
        if not all(0 <= v <= 1 << 20 for v in values[:3]) or (len(values) == 4 and values[3] not in (0, 1)):
            raise ValueError(f"SPECFLEET_PREFETCH={env!r}: distances must lie in [0, {1 << 20}] bytes, L2 be 0 or 1")
        return tuple(values + [-1, -1])[:4]
    return _tuned(PREFETCH, path, vendor, family)


def group_rows_setting(path: str, vendor: str | None = None, family: int | None = None) -> tuple[int, int] | None:
    """(the fewest activation rows for which weight rows go in pairs and fours, the activation bytes above which
    fewer rows do) on ISA path `path` on this CPU: SPECFLEET_GROUP_ROWS ("ROWS" or "ROWS,BYTES", ROWS >= 2, BYTES 0
    for never) where set, else GROUP_ROWS' entry; None keeps the compiled default (2, never)."""
    env, values = _env_ints("SPECFLEET_GROUP_ROWS")
    if env:
        if len(values) not in (1, 2):
            raise ValueError(f"SPECFLEET_GROUP_ROWS={env!r}: expected a number of activation rows (>= 2)[,BYTES]")
        if not 2 <= values[0] <= 1 << 20 or (len(values) == 2 and not 0 <= values[1] <= 1 << 30):
            raise ValueError(f"SPECFLEET_GROUP_ROWS={env!r}: rows must lie in [2, {1 << 20}], bytes in [0, {1 << 30}]")
        return values[0], values[1] if len(values) == 2 else -1
    return _tuned(GROUP_ROWS, path, vendor, family)


def _load(path: str) -> ctypes.CDLL:
    reason = native.missing_prerequisite("generic") if path == "generic" else missing()
    if reason is not None:
        raise RuntimeError(reason)
    if not _pinnable(path):
        raise RuntimeError(f"this CPU cannot run the {path} kernels")
    lib = build(path)
    for setting, apply, kept in ((prefetch_setting, lib.specfleet_set_prefetch, "prefetch distances"),
                                 (prefetch_far_setting, lib.specfleet_set_prefetch_far, "far prefetch (none)"),
                                 (chunk_bytes_setting, lib.specfleet_set_chunk_bytes, "chunks (64 rows)"),
                                 (schedule_setting, lib.specfleet_set_schedule, "schedule (one chunk at a time)"),
                                 (group_rows_setting, lib.specfleet_set_grouping, "grouping")):
        try:
            value = setting(path)
        except ValueError as e:  # a bad override costs speed only: keep the kernels, say what was wrong
            log.warning("%s; keeping the compiled %s", e, kept)
            continue
        if isinstance(value, int):
            value = (value,)
        if value is not None:
            apply(*value)
    return lib


def tuning(path: str | None = None) -> dict | None:
    """The speed settings in effect in ISA path `path`'s loaded library (default: the one in use): prefetch
    distances (one row, more rows, weight rows in groups), whether more rows prefetch into L2, the far distances into
    L2 (one row, more rows; 0: none), the fewest bytes of a one-row product's chunks (0: 64 rows), how chunks are
    handed to threads ("dynamic": one at a time, "guided": in runs), the fewest rows
    that go in weight-row groups and the activation bytes above which fewer do (0: never); None where it is not
    loaded."""
    lib = library(path)
    if lib is None:
        return None
    return {"prefetch_bytes": list((ctypes.c_int64 * 3).in_dll(lib, "sf_prefetch_bytes")),
            "prefetch_l2": bool(ctypes.c_int64.in_dll(lib, "sf_prefetch_l2").value),
            "prefetch_far": list((ctypes.c_int64 * 2).in_dll(lib, "sf_prefetch_far")),
            "chunk_bytes": ctypes.c_int64.in_dll(lib, "sf_chunk_bytes").value,
            "schedule": {v: k for k, v in SCHEDULES.items()}[ctypes.c_int64.in_dll(lib, "sf_schedule_guided").value],
            "group_min_rows": ctypes.c_int64.in_dll(lib, "sf_group_min_rows").value,
            "group_act_bytes": ctypes.c_int64.in_dll(lib, "sf_group_act_bytes").value}


def build(path: str, csrc: Path = _CSRC) -> ctypes.CDLL:
    """ISA path `path`'s library compiled from the C sources under `csrc` (another source tree's csrc folder:
    an A/B of two trees' kernels, benchmarks/kernels/attention.py --base-src), its entry points typed."""
    files = [csrc / f.relative_to(_CSRC) for f in sources(path)]
    headers = HEADERS if csrc == _CSRC else tuple(sorted(csrc.rglob("*.h")))
    lib = native.compile_library(files, flags(path), headers)
    for name, (args, res) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    if lib.specfleet_q_abi() != ABI:
        raise RuntimeError(f"{lib._name} has ABI {lib.specfleet_q_abi()}, expected {ABI}")
    if lib.specfleet_q_isa().decode() != path:
        raise RuntimeError(f"{lib._name} was built for {lib.specfleet_q_isa().decode()}, expected {path}")
    return lib


def library(path: str | None = None) -> ctypes.CDLL | None:
    """The kernel library of ISA path `path` (default: `isa()`), built on first use; None where it cannot
    be (the reason in `unavailable_reason()`)."""
    global _default
    if path is None:
        if _default is not None:
            return _default
        try:
            path = isa()
        except ValueError as e:
            _reasons.setdefault("?", str(e))
            return None
        lib = library(path or "avx2")  # no runnable path: _load says why (missing())
        if lib is None and path and not os.environ.get("SPECFLEET_ISA", "").strip():
            # the best path did not build here (say, a compiler without -mamx-tile): the next one the CPU runs
            paths = runnable_isas()
            for other in paths[paths.index(path) + 1:] if path in paths else []:
                lib = library(other)
                if lib is not None:
                    break
        _default = lib
        return lib
    if path in _libs:
        return _libs[path]
    with _lock:
        if path not in _libs:
            try:
                _libs[path] = _load(path)
            except Exception as e:  # noqa: BLE001 -- any failure means: no native kernel here
                _reasons[path] = str(e)
                _libs[path] = None
                log.warning("specfleet native kernels (%s) unavailable: %s", path, e)
    return _libs[path]


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    if library() is not None:
        return None
    return next(iter(_reasons.values()), None)


def bf16_linear(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] (any float dtype) @ weight [N, K]^T with a contiguous bf16 CPU weight; fp32 [M, N] out,
    fp32 sums. Checks its arguments; raises if the kernel is unavailable."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native bf16 kernel is unavailable: {unavailable_reason()}")
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError("bf16_linear needs a contiguous bf16 CPU weight")
    if x2.dim() != 2 or x2.shape[1] != weight.shape[1]:
        raise ValueError(f"bf16_linear: x of shape {tuple(x2.shape)} does not match weight {tuple(weight.shape)}")
    return run_bf16_linear(lib, x2, weight, bias)


def run_bf16_linear(lib: ctypes.CDLL, x2: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """`bf16_linear` without the checks, for a caller that has made them (runtime/backends/cpu.py, once per
    linear layer per forward): `lib` from `library()`, a contiguous bf16 CPU weight, x2 [M, K] on the CPU."""
    n, k = weight.shape
    x = x2.to(torch.float32).contiguous()
    m = x.shape[0]
    y = torch.empty((m, n), dtype=torch.float32)
    if m and n:
        lib.specfleet_bf16_linear(x.data_ptr(), m, k, weight.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    if bias is not None:
        y += bias.float()
    return y
