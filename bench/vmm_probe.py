"""What the CUDA driver does with VMM memory, pinned shared staging memory and its own lock (issue 6 design).

    sudo python3 bench/vmm_probe.py [--gib 8] [--stage-dir /dev/shm] [--json]

A child process (driver API through ctypes, no PyTorch) maps --gib GiB of device memory with the virtual
memory API (cuMemAddressReserve + cuMemCreate + cuMemMap), fills it with a pattern, creates a staging file
of the same size on --stage-dir (MAP_SHARED, fallocated, cuMemHostRegister'ed) and reports the cost of each
step and the copy rates into and out of it. The parent then drives the driver's checkpoint API on the child:

1. lock / checkpoint / restore / unlock with the VMM memory mapped: does the driver copy it, and how fast;
2. while the parent holds the lock: can a thread of the locked process still make a CUDA call (a lock the
   process takes on itself blocks it the same way: seen 2026-11-30, docs/benchmarks.md);
3. the child copies its memory out, unmaps and releases it (the address range stays reserved), the parent
   runs the checkpoint cycle again (how much is left for the driver), and the child maps new memory at the
   same addresses and copies it back: is the pattern intact, and is the staging still pinned (copy rate).

Every step prints one JSON line; nothing here is part of Cryosleep itself.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
GiB = 1 << 30


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Loc),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Loc), ("flags", ctypes.c_int)]


def emit(**kw: Any) -> None:
    print(json.dumps(kw), flush=True)


class Child:
    def __init__(self, gib: float, stage_dir: str, portable: bool = False) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.size = int(gib * GiB)
        self.ck(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.ck(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.ctx = ctypes.c_void_p()
        self.ck(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "retain")
        self.ck(self.cu.cuCtxSetCurrent(self.ctx), "setcurrent")
        self.prop = Prop(type=1, location=Loc(1, 0))  # pinned, on device 0
        gran = ctypes.c_size_t()
        self.ck(self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 0), "gran")
        self.size = (self.size + gran.value - 1) // gran.value * gran.value
        t0 = time.perf_counter()
        self.va = ctypes.c_uint64()
        self.ck(
            self.cu.cuMemAddressReserve(
                ctypes.byref(self.va),
                ctypes.c_size_t(self.size),
                ctypes.c_size_t(0),
                ctypes.c_uint64(0),
                ctypes.c_ulonglong(0),
            ),
            "reserve",
        )
        self.map_phys()
        t1 = time.perf_counter()
        for i in range(0, self.size, GiB):  # a different word per GiB
            n = min(GiB, self.size - i) // 4
            self.ck(
                self.cu.cuMemsetD32_v2(
                    ctypes.c_uint64(self.va.value + i), ctypes.c_uint(0x5EED0000 + i // GiB), ctypes.c_size_t(n)
                ),
                "memset",
            )
        self.ck(self.cu.cuCtxSynchronize(), "sync")
        # a small ordinary allocation too, left to the driver
        self.small = ctypes.c_uint64()
        self.ck(self.cu.cuMemAlloc_v2(ctypes.byref(self.small), ctypes.c_size_t(64 << 20)), "cuMemAlloc")
        path = Path(stage_dir) / f"vmm-probe-{os.getpid()}.stage"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        t2 = time.perf_counter()
        os.posix_fallocate(fd, 0, self.size)
        t3 = time.perf_counter()
        self.mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.host = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        t4 = time.perf_counter()
        self.ck(
            self.cu.cuMemHostRegister_v2(ctypes.c_void_p(self.host), ctypes.c_size_t(self.size), ctypes.c_uint(0)),
            "register",
        )
        t5 = time.perf_counter()
        d2h = self.copy_out()
        h2d = self.copy_in()
        emit(
            step="ready",
            pid=os.getpid(),
            gib=self.size / GiB,
            map_s=t1 - t0,
            fallocate_s=t3 - t2,
            mmap_s=t4 - t3,
            register_s=t5 - t4,
            d2h_gbs=self.size / d2h / 1e9,
            h2d_gbs=self.size / h2d / 1e9,
            stage=str(path),
        )

    def ck(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.cu.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: {rc} {name.value!r}")

    def map_phys(self) -> None:
        self.handle = ctypes.c_uint64()
        self.ck(
            self.cu.cuMemCreate(
                ctypes.byref(self.handle), ctypes.c_size_t(self.size), ctypes.byref(self.prop), ctypes.c_ulonglong(0)
            ),
            "create",
        )
        self.ck(
            self.cu.cuMemMap(
                self.va, ctypes.c_size_t(self.size), ctypes.c_size_t(0), self.handle, ctypes.c_ulonglong(0)
            ),
            "map",
        )
        acc = Access(Loc(1, 0), 3)
        self.ck(
            self.cu.cuMemSetAccess(self.va, ctypes.c_size_t(self.size), ctypes.byref(acc), ctypes.c_size_t(1)), "access"
        )

    def copy_out(self) -> float:
        t = time.perf_counter()
        self.ck(self.cu.cuMemcpyDtoH_v2(ctypes.c_void_p(self.host), self.va, ctypes.c_size_t(self.size)), "d2h")
        return time.perf_counter() - t

    def copy_in(self) -> float:
        t = time.perf_counter()
        self.ck(self.cu.cuMemcpyHtoD_v2(self.va, ctypes.c_void_p(self.host), ctypes.c_size_t(self.size)), "h2d")
        return time.perf_counter() - t

    def verify(self) -> bool:
        buf = (ctypes.c_uint32 * 1024)()
        for i in range(0, self.size, GiB):
            for off in (i, min(i + GiB, self.size) - 4096):
                self.ck(
                    self.cu.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(self.va.value + off), ctypes.c_size_t(4096)), "verify"
                )
                if any(w != 0x5EED0000 + i // GiB for w in buf):
                    return False
        return True

    def timed_call(self, label: str, wait_s: float = 3.0) -> None:
        """A small copy on another thread: did it return within wait_s?"""
        done: dict[str, Any] = {}

        def go() -> None:
            self.ck(self.cu.cuCtxSetCurrent(self.ctx), "setcurrent")
            buf = (ctypes.c_uint32 * 1024)()
            t = time.perf_counter()
            done["rc"] = self.cu.cuMemcpyDtoH_v2(buf, self.va, ctypes.c_size_t(4096))
            done["s"] = time.perf_counter() - t

        th = threading.Thread(target=go, daemon=True)
        th.start()
        th.join(wait_s)
        emit(step=label, returned=not th.is_alive(), **done)
        if th.is_alive():
            self._pending = th

    def serve(self) -> None:
        for line in sys.stdin:
            cmd = line.strip()
            try:
                if cmd == "verify":
                    emit(step="verify", ok=self.verify())
                elif cmd == "call":
                    self.timed_call("call-while-parent-locked")
                elif cmd == "joined":
                    th = getattr(self, "_pending", None)
                    if th is not None:
                        th.join(10)
                        emit(step="pending-call-after-unlock", returned=not th.is_alive())
                    else:
                        emit(step="pending-call-after-unlock", returned=True)
                elif cmd == "release":
                    t0 = time.perf_counter()
                    out = self.copy_out()
                    t1 = time.perf_counter()
                    self.ck(self.cu.cuMemUnmap(self.va, ctypes.c_size_t(self.size)), "unmap")
                    self.ck(self.cu.cuMemRelease(self.handle), "release")
                    emit(
                        step="release",
                        copy_out_s=out,
                        gbs=self.size / out / 1e9,
                        unmap_release_s=time.perf_counter() - t1,
                        total_s=time.perf_counter() - t0,
                    )
                elif cmd == "remap":
                    t0 = time.perf_counter()
                    self.map_phys()
                    t1 = time.perf_counter()
                    back = self.copy_in()
                    emit(step="remap", map_s=t1 - t0, copy_in_s=back, gbs=self.size / back / 1e9, ok=self.verify())
                elif cmd == "rates":
                    o = self.copy_out()
                    i = self.copy_in()
                    emit(step="rates", d2h_gbs=self.size / o / 1e9, h2d_gbs=self.size / i / 1e9, ok=self.verify())
                elif cmd == "exit":
                    emit(step="exit")
                    return
            except Exception as e:
                emit(step=cmd, error=str(e))


def parent(a: argparse.Namespace) -> None:
    from cryosleep.capture import cuda

    drv = cuda.driver()
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", "--gib", str(a.gib), "--stage-dir", a.stage_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin and child.stdout

    def rd(until: str = "") -> dict[str, Any]:
        while True:
            line = child.stdout.readline()  # type: ignore[union-attr]
            print(line, end="", flush=True)
            got = json.loads(line) if line.strip() else {"step": "eof"}
            if not until or got["step"] in (until, "eof") or got["step"].startswith(until):
                return got

    def say(cmd: str, until: str) -> dict[str, Any]:
        child.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        return rd(until)

    def cycle(label: str) -> None:
        out: dict[str, Any] = {"step": label}
        for name, fn in [
            ("lock", lambda: drv.lock(child.pid, 10)),
            ("checkpoint", lambda: drv.checkpoint(child.pid)),
            ("restore", lambda: drv.restore(child.pid)),
            ("unlock", lambda: drv.unlock(child.pid)),
        ]:
            t = time.perf_counter()
            try:
                fn()
            except Exception as e:
                out[name + "_error"] = str(e)
                break
            out[name + "_s"] = round(time.perf_counter() - t, 3)
        emit(**out)

    ready = rd("ready")
    stage = ready.get("stage")
    try:
        cycle("cycle-vmm-mapped")
        say("verify", "verify")
        say("rates", "rates")  # the staging memory still pinned after the cycle?
        drv.lock(child.pid, 10)
        say("call", "call")
        drv.unlock(child.pid)
        say("joined", "pending")
        say("release", "release")
        cycle("cycle-vmm-released")
        say("remap", "remap")
        say("rates", "rates")
    finally:
        try:
            say("exit", "exit")
        except Exception:
            pass
        child.wait(30)
        if stage:
            Path(stage).unlink(missing_ok=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--stage-dir", default="/dev/shm")
    p.add_argument("--child", action="store_true")
    p.add_argument("--portable", action="store_true", help="register the staging CU_MEMHOSTREGISTER_PORTABLE")
    a = p.parse_args()
    if a.child:
        Child(a.gib, a.stage_dir, a.portable).serve()
    else:
        parent(a)


if __name__ == "__main__":
    main()
