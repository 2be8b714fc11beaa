"""The fast path over every kind of device memory a job has (docs/interceptor.md, "The fast path"), through a
real control block: memory the application maps itself with cuMemCreate/cuMemMap (PyTorch's expandable
segments, NCCL's buffers) and cudaMalloc under 1 MiB (from shared slab chunks) are moved; a handle exported to
another process, cudaMallocAsync, and small allocations without the slab are left to the driver with why; the
staging arena is pinned once, prefaulted (the CPU stand-in driver records how it was pinned). The stand-in driver
(tests/native/fakecuda) keeps handles as the driver does: never reused, refused once released, memory
inaccessible until cuMemSetAccess, and it counts the physical memory alive, so a handle the interceptor forgot,
a mapping not remade or access not granted again fails these tests."""

from __future__ import annotations

import time
from pathlib import Path

from test_fast_path import Worker

from cryosleep.capture.eligibility import fast_path_checks
from cryosleep.core.interceptor import (
    ARENA_EARLY,
    ARENA_HUGE,
    ARENA_PREFAULTED,
    LEFT_EXPORTED,
    LEFT_POOL,
    LEFT_SMALL,
)

MIB = 1 << 20

SCRIPT = """
import ctypes, hashlib, sys
from ncclbind import FLOAT64, SUM, Nccl, addr, buffer, zeros
nccl = Nccl()
comm = nccl.init(1, nccl.unique_id(), 0)
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)   # the process's "libcudart"
rt = ctypes.CDLL(None)                              # global scope: the preloaded interceptor first
drv = ctypes.CDLL("libcuda.so.1")                   # the driver's calls found by dlsym (PyTorch's way)
U64, SZ, ULL = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_ulonglong
class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint64)]
class Access(ctypes.Structure):
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]
GPA = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ULL,
                       ctypes.c_void_p)
def looked_up(name, *types):                        # NCCL's way: cuGetProcAddress (found in the global scope)
    fn = ctypes.c_void_p()
    assert rt.cuGetProcAddress_v2(name.encode(), ctypes.byref(fn), 12000, ULL(0), None) == 0, name
    return ctypes.CFUNCTYPE(ctypes.c_int, *types)(fn.value)
create = looked_up("cuMemCreate", ctypes.POINTER(U64), SZ, ctypes.c_void_p, ULL)
cumap = looked_up("cuMemMap", U64, SZ, SZ, U64, ULL)
regions = {}                                        # name -> (address, bytes)
handles = {}
def reserve(n):
    va = U64()
    assert drv.cuMemAddressReserve(ctypes.byref(va), SZ(n), SZ(0), U64(0), ULL(0)) == 0
    return va.value
def grant(va, n):
    acc = Access(1, 0, 3)
    assert drv.cuMemSetAccess(U64(va), SZ(n), ctypes.byref(acc), SZ(1)) == 0
prop = Prop(1, 0, 1, 0, None, 0)
# an expandable segment: two handles of 1 MiB side by side in one range, access granted once over it
seg = reserve(4 << 20)
for i in range(2):
    h = U64()
    assert drv.cuMemCreate(ctypes.byref(h), SZ(1 << 20), ctypes.byref(prop), ULL(0)) == 0
    assert drv.cuMemMap(U64(seg + (i << 20)), SZ(1 << 20), SZ(0), h, ULL(0)) == 0
    handles[f"seg{i}"] = h.value
grant(seg, 2 << 20)
regions["segment"] = (seg, 2 << 20)
# an NCCL buffer: found through cuGetProcAddress, its handle released at once (the mapping keeps it)
buf, h = reserve(2 << 20), U64()
assert create(ctypes.byref(h), 2 << 20, ctypes.addressof(prop), 0) == 0
assert cumap(buf, 2 << 20, 0, h.value, 0) == 0
grant(buf, 2 << 20)
assert drv.cuMemRelease(h) == 0
regions["nccl"] = (buf, 2 << 20)
# a handle exported to another process: left to the driver
ex, h, fd = reserve(1 << 20), U64(), ctypes.c_int()
assert drv.cuMemCreate(ctypes.byref(h), SZ(1 << 20), ctypes.byref(prop), ULL(0)) == 0
assert drv.cuMemMap(U64(ex), SZ(1 << 20), SZ(0), h, ULL(0)) == 0
grant(ex, 1 << 20)
assert drv.cuMemExportToShareableHandle(ctypes.byref(fd), h, 1, ULL(0)) == 0
regions["exported"] = (ex, 1 << 20)
# served by the interceptor, a stream-ordered pool allocation and two small ones
for name, n in (("served", 3 << 20), ("pool", 3 << 20), ("small-a", 4096), ("small-b", 100000)):
    p = ctypes.c_void_p()
    rc = rt.cudaMallocAsync(ctypes.byref(p), SZ(n), None) if name == "pool" else rt.cudaMalloc(ctypes.byref(p), SZ(n))
    assert rc == 0, name
    regions[name] = (p.value, n)
for k, (va, n) in enumerate(regions.values()):
    b = (ctypes.c_ubyte * n).from_address(va)
    for i in range(0, n, 4096):
        b[i] = (i // 4096 + 7 * k) % 251
def digest():
    h = hashlib.sha256()
    for va, n in regions.values():
        h.update(ctypes.string_at(va, n))
    return h.hexdigest()
print("ready", hex(seg), digest(), flush=True)
drv.fakecuda_pin_report.restype = ctypes.c_char_p
drv.fakecuda_device_bytes.restype = ctypes.c_longlong
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "digest":
        print("digest", digest(), flush=True)
    elif cmd[0] == "device":                      # physical memory the stand-in driver holds
        print("device", drv.fakecuda_device_bytes(), flush=True)
    elif cmd[0] == "allreduce":                   # a collective: held at a closed NCCL gate, else done
        src, dst = buffer(FLOAT64, [1.5, 2.5]), zeros(FLOAT64, 2)
        nccl.check("ncclAllReduce", addr(src), addr(dst), 2, FLOAT64, SUM, comm, None, comm=comm)
        nccl.stream_sync(None)
        print("reduced", list(dst), flush=True)
    elif cmd[0] == "pins":
        print("pins", drv.fakecuda_pin_report().decode(), flush=True)
    elif cmd[0] == "write":                       # after RELOAD the access is granted again: writable
        va, n = regions[cmd[1]]
        (ctypes.c_ubyte * n).from_address(va)[n - 1] ^= 0x5a
        print("written", flush=True)
    elif cmd[0] == "free":                        # everything given back: the virtual handles still valid
        rcs = [drv.cuMemUnmap(U64(seg), SZ(2 << 20)), drv.cuMemRelease(U64(handles["seg0"])),
               drv.cuMemRelease(U64(handles["seg1"])), drv.cuMemUnmap(U64(buf), SZ(2 << 20)),
               rt.cudaFree(ctypes.c_void_p(regions["served"][0])),
               rt.cudaFreeAsync(ctypes.c_void_p(regions["pool"][0]), None),
               rt.cudaFree(ctypes.c_void_p(regions["small-a"][0]))]
        print("freed", *rcs, flush=True)
"""


def pins(w: Worker) -> dict[str, int]:
    """The stand-in driver's record of the pinning: pages it faulted in itself, bytes pinned, huge-page KiB."""
    words = w.ask("pins").split()[1:]
    return {k: int(v) for k, v in zip(words[::2], words[1::2], strict=True)}


def offload_and_reload(w: Worker) -> None:
    assert w.driver.prepare([0], time.monotonic() + 30) == {}
    w.quiesce()
    assert w.driver.offload([0], time.monotonic() + 30) == {}


def device(w: Worker) -> int:
    return int(w.ask("device").split()[1])


def test_memory_the_application_maps_itself_and_small_allocations_are_moved_the_rest_left_with_why(
        tmp_path: Path) -> None:
    with Worker(tmp_path, script=SCRIPT) as w:
        dm = w.block.devmem
        # served: 3 MiB, and the two small ones from two 2 MiB slab chunks (a 4 KiB class and a 128 KiB class)
        assert (dm.bytes, dm.count, dm.slab_count) == (7 * MIB, 3, 2)
        assert (dm.vmm_bytes, dm.vmm_count) == (4 * MIB, 3)  # the segment's two handles and NCCL's buffer
        assert (dm.left_vmm_bytes, dm.left_vmm_count) == (MIB, 1) and dm.left_flags & LEFT_EXPORTED
        assert (dm.async_bytes, dm.async_count) == (3 * MIB, 1) and dm.left_flags & LEFT_POOL
        assert dm.small_count == 0 and not dm.left_flags & LEFT_SMALL
        assert device(w) == 12 * MIB  # all the VMM memory: served 7, mapped 4, exported 1
        offload_and_reload(w)
        dm = w.block.devmem
        assert dm.offload_bytes == 11 * MIB  # the staging file holds what was moved, nothing else
        assert device(w) == MIB  # released on the "GPU": only the exported handle is left
        assert w.protection() == "---p"  # the segment's range: reserved, nothing behind it
        w.driver.reload([0], time.monotonic() + 30)
        assert device(w) == 12 * MIB
        assert w.ask("digest") == f"digest {w.digest}"  # same addresses, same bytes, bit for bit
        assert w.protection() == "rw-s"  # the access granted again, as the application had set it
        for region in ("segment", "nccl", "served", "small-a", "pool"):
            assert w.ask(f"write {region}") == "written"
        w.driver.resume()
        # a second snapshot through the fast path, then every handle given back by the application: the
        # virtual handles it holds stay valid across the moves, and nothing is left on the "GPU" but the export
        offload_and_reload(w)
        w.driver.reload([0], time.monotonic() + 30)
        w.driver.resume()
        assert w.ask("free") == "freed 0 0 0 0 0 0 0"
        assert device(w) == 5 * MIB  # the export, and the slab's two chunks (kept for reuse)
        dm = w.block.devmem
        assert (dm.vmm_bytes, dm.vmm_count, dm.bytes, dm.slab_count, dm.async_count) == (0, 0, 4 * MIB, 1, 0)


def test_without_the_slab_small_allocations_are_left_and_check_job_says_why(tmp_path: Path) -> None:
    """CRYOSLEEP_DEVMEM_SMALL=0: cudaMalloc under 1 MiB is left to the driver (and still intact after a move of the
    rest). `cryosleep check --job`'s rows for the rank (and the manifest's plan): moved, left to the driver with
    why, the arena and how it was pinned."""
    with Worker(tmp_path, script=SCRIPT, env={"CRYOSLEEP_DEVMEM_SMALL": "0"}) as w:
        rows = fast_path_checks(0, w.block.devmem)
        assert ("moves 7 MiB itself (3 MiB it serves for cudaMalloc in 1 VMM allocation(s); 4 MiB in 3 handle(s) "
                "the application mapped") in rows[0].detail, rows[0]
        assert "staging arena is made at the first snapshot" in rows[0].detail, rows[0]
        left = [r.detail for r in rows[1:]]
        assert [r.name for r in rows[1:]] == ["fast path: left to the driver"] * 3 and all(not r.fatal for r in rows)
        assert left[0].startswith("rank 0: 1 MiB in 1 mapped by the application allocation(s)"), left
        assert "exported to another process" in left[0], left
        assert left[1].startswith("rank 0: 3 MiB in 1 cudaMallocAsync") and "stream-ordered pool" in left[1], left
        assert left[2].startswith("rank 0: 102 KiB in 2 cudaMalloc under 1 MiB") and "2 MiB granule" in left[2]
        assert w.driver.prepare([0], time.monotonic() + 30) == {}
        plan = w.block.devmem.plan()
        assert plan["moved_bytes"] == 7 * MIB and plan["arena"]["bytes"] == 64 * MIB and plan["arena"]["prefaulted"]
        assert {x["kind"] for x in plan["left"]} == {"mapped by the application", "cudaMallocAsync",
                                                     "cudaMalloc under 1 MiB"}
        assert "pinned once (prefaulted" in fast_path_checks(0, w.block.devmem)[0].detail
        dm = w.block.devmem
        assert (dm.bytes, dm.count, dm.slab_count) == (3 * MIB, 1, 0)
        assert (dm.small_bytes, dm.small_count) == (4096 + 100000, 2) and dm.left_flags & LEFT_SMALL
        w.quiesce()
        assert w.driver.offload([0], time.monotonic() + 30) == {}
        assert w.block.devmem.offload_bytes == 7 * MIB and device(w) == MIB
        w.driver.reload([0], time.monotonic() + 30)
        assert w.ask("digest") == f"digest {w.digest}"
        w.driver.resume()


def test_the_arena_is_prefaulted_before_it_is_pinned(tmp_path: Path) -> None:
    """The pinning then faults nothing in under the driver's lock: the stand-in driver records, at each
    cuMemHostRegister, the pages not yet in the page table. Without the prefault it sees them all."""
    with Worker(tmp_path / "a", script=SCRIPT) as w:
        assert w.driver.prepare([0], time.monotonic() + 30) == {}
        # PREPARE is answered while the job runs and nothing follows it: it holds no NCCL call
        assert w.ask("allreduce") == "reduced [1.5, 2.5]"
        dm, got = w.block.devmem, pins(w)
        assert got["faulted"] == 0 and got["bytes"] == 64 * MIB, got
        assert dm.arena_how & ARENA_PREFAULTED and dm.arena_pins == 1 and dm.arena_piece == 64 * MIB
        assert bool(dm.arena_how & ARENA_HUGE) == (got["huge_kb"] > 0), (dm, got)  # where tmpfs has huge pages
    with Worker(tmp_path / "b", script=SCRIPT, env={"CRYOSLEEP_ARENA_PREFAULT": "0"}) as w:
        assert w.driver.prepare([0], time.monotonic() + 30) == {}
        got = pins(w)
        assert got["faulted"] > 0 and got["bytes"] == 64 * MIB, got  # the pinning faulted the pages in itself
        assert not w.block.devmem.arena_how & ARENA_PREFAULTED


def test_an_early_arena_is_made_by_the_control_thread_before_any_snapshot(tmp_path: Path) -> None:
    """CRYOSLEEP_ARENA_BYTES: pinned once, ahead, at least that large; the first snapshot's PREPARE finds it."""
    with Worker(tmp_path, script=SCRIPT, env={"CRYOSLEEP_ARENA_BYTES": str(96 * MIB)}) as w:
        end = time.monotonic() + 30
        while not w.block.devmem.stage_bytes:
            assert time.monotonic() < end, "no early arena"
            time.sleep(0.05)
        dm = w.block.devmem
        assert dm.stage_bytes == 128 * MIB and dm.arena_how & ARENA_EARLY and dm.arena_how & ARENA_PREFAULTED
        assert w.driver.prepare([0], time.monotonic() + 30) == {}
        assert w.block.devmem.stage_bytes == 128 * MIB  # pinned once: nothing more
        got = pins(w)
        assert got["faulted"] == 0 and got["bytes"] == 128 * MIB, got
        w.quiesce()
        assert w.driver.offload([0], time.monotonic() + 30) == {}
        w.driver.reload([0], time.monotonic() + 30)
        assert w.ask("digest") == f"digest {w.digest}"
        w.driver.resume()
