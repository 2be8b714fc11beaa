"""What the CUDA checkpoint API does with managed memory and CUDA IPC, and what shows from outside.

    sudo python3 bench/gpu_refusals.py        (on a GPU machine; PYTHONPATH=src)

Starts four CUDA processes (torch for the context, the driver API through ctypes for the rest): a plain one,
one with 64 MiB of managed memory (cuMemAllocManaged), one that exports a device allocation (cuIpcGetMemHandle)
and one that imports it (cuIpcOpenMemHandle). For each it prints the sizes of its /dev/nvidia-uvm mappings,
its /dev/nvidia* mappings, and the outcome of lock, checkpoint, restore, unlock through capture/cuda.py.
Output recorded in docs/gpu-acceptance.md; `check` uses what it showed (eligibility.managed_memory_bytes).
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from cryosleep.capture import cuda
from cryosleep.errors import CryosleepError

MANAGED_BYTES = 64 << 20
CU_MEM_ATTACH_GLOBAL = 1
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


def worker(role: str, arg: str = "") -> None:
    import torch

    torch.cuda.set_device(0)
    keep = torch.ones(1 << 20, device="cuda")  # a context, and an allocation to export
    torch.cuda.synchronize()
    lib = ctypes.CDLL("libcuda.so.1")
    if role == "managed":
        p = ctypes.c_uint64(0)
        rc = lib.cuMemAllocManaged(ctypes.byref(p), ctypes.c_size_t(MANAGED_BYTES), ctypes.c_uint(CU_MEM_ATTACH_GLOBAL))
        rc2 = lib.cuMemsetD8_v2(p, ctypes.c_ubyte(7), ctypes.c_size_t(MANAGED_BYTES)) if rc == 0 else -1
        print("READY", rc, rc2, flush=True)
    elif role == "exporter":
        h = IpcHandle()
        rc = lib.cuIpcGetMemHandle(ctypes.byref(h), ctypes.c_uint64(keep.data_ptr()))
        print("HANDLE", ctypes.string_at(ctypes.byref(h), 64).hex() if rc == 0 else "", rc, flush=True)
        print("READY", rc, flush=True)
    elif role == "importer":
        h = IpcHandle()
        ctypes.memmove(ctypes.byref(h), bytes.fromhex(arg), 64)
        p = ctypes.c_uint64(0)
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), IpcHandle, ctypes.c_uint]
        print("READY", lib.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), flush=True)
    else:
        print("READY", flush=True)
    time.sleep(600)


def look(pid: int) -> dict[str, Any]:
    uvm_kib = []
    devices: Counter[str] = Counter()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith("/dev/nvidia"):
                devices[path] += 1
            if path == "/dev/nvidia-uvm":
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                uvm_kib.append((hi - lo) >> 10)
    return {"uvm_kib": uvm_kib, "device_maps": dict(devices)}


def main() -> None:
    procs: dict[str, tuple[subprocess.Popen[str], list[str]]] = {}

    def start(name: str, *args: str) -> list[str]:
        p = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        lines = []
        while True:
            line = p.stdout.readline()
            lines.append(line.strip())
            if line.startswith("READY") or not line:
                break
        procs[name] = (p, lines)
        return lines

    start("plain", "plain")
    start("managed", "managed")
    handle = next(x for x in start("exporter", "exporter") if x.startswith("HANDLE")).split()[1]
    start("importer", "importer", handle)
    drv = cuda.driver()
    for name, (p, lines) in procs.items():
        steps = []
        for call in ("lock", "checkpoint", "restore", "unlock"):
            try:
                if call == "lock":
                    drv.lock(p.pid, 10.0)
                else:
                    getattr(drv, call)(p.pid)
                steps.append(f"{call}: ok")
            except CryosleepError as e:
                steps.append(f"{call}: {e.why}")
                steps.append(f"state {drv.state(p.pid).name}")
                break
        print(name, lines, json.dumps(look(p.pid)), steps)
    for p, _ in procs.values():
        p.kill()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        worker(*sys.argv[1:])
    else:
        main()
