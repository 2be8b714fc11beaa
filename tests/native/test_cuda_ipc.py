"""CUDA IPC imports make the interceptor raise flag 0x200 while they are open (docs/interceptor.md).

CI has no CUDA runtime, so a stand-in for libcudart's two IPC calls is built here (the only double: the
GPU's runtime); the worker is a real process with the interceptor preloaded and the stand-in NCCL, and the
flag is read from its real control block, as the agent reads it. On a GPU machine torch's own libcudart
plays the stand-in's part."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from nccl_jobs import INTERCEPTOR, STANDIN, WORKLOADS

from cryosleep.core.interceptor import ControlBlock, flag_reasons

CUDA_IPC = 0x200

FAKE_CUDART = r"""
typedef struct { char reserved[64]; } handle_t;
#define MAPPED ((void*)0x7e57000)
int cudaIpcOpenMemHandle(void** p, handle_t h, unsigned flags) {
  if (h.reserved[0] != 'x' || h.reserved[63] != 'y' || flags != 1) return 1; /* the handle came through whole */
  *p = MAPPED;
  return 0;
}
int cudaIpcCloseMemHandle(void* p) { return p == MAPPED ? 0 : 1; }
"""

WORKER = """
import ctypes, sys
from ncclbind import Nccl
nccl = Nccl()                                    # the stand-in NCCL, RTLD_GLOBAL
comm = nccl.init(1, nccl.unique_id(), 0)         # a communicator: the control block is published
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # the process's "libcudart"
lib = ctypes.CDLL(None)                          # global scope: the preloaded interceptor comes first
class H(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]
lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), H, ctypes.c_uint]
h = H(); ctypes.memmove(ctypes.byref(h), b"x" + b"." * 62 + b"y", 64)
ptrs = []
for line in sys.stdin:
    if line.startswith("open"):
        p = ctypes.c_void_p()
        print("open", lib.cudaIpcOpenMemHandle(ctypes.byref(p), h, 1), hex(p.value or 0), flush=True)
        ptrs.append(p)
    elif line.startswith("close"):
        print("close", lib.cudaIpcCloseMemHandle(ptrs.pop()), flush=True)
"""


def test_cuda_ipc_imports_raise_the_flag_while_open(tmp_path: Path) -> None:
    cudart = tmp_path / "libfakecudart.so"
    (tmp_path / "fake.c").write_text(FAKE_CUDART)
    subprocess.run(["cc", "-Wall", "-Werror", "-shared", "-fPIC", "-o", str(cudart), str(tmp_path / "fake.c")],
                   check=True)
    (tmp_path / "worker.py").write_text(textwrap.dedent(WORKER))
    ctl = tmp_path / "rank-0.ctl"
    env = dict(os.environ, LD_PRELOAD=str(INTERCEPTOR), STANDIN_NCCL_LIB=str(STANDIN), CRYOSLEEP_NCCL_CTL=str(ctl),
               PYTHONPATH=os.pathsep.join([str(WORKLOADS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(cudart)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None

    def ask(cmd: str) -> list[str]:
        proc.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        return proc.stdout.readline().split()  # type: ignore[union-attr]

    try:
        block = ControlBlock.wait(ctl, pid=proc.pid)
        assert block.flags & CUDA_IPC == 0
        assert ask("open") == ["open", "0", "0x7e57000"]  # forwarded to the runtime, handle intact
        assert block.flags & CUDA_IPC
        assert any("CUDA IPC" in r for r in flag_reasons(block.flags))
        assert ask("open")[:2] == ["open", "0"]
        assert ask("close") == ["close", "0"]
        assert block.flags & CUDA_IPC, "one import is still open"
        assert ask("close") == ["close", "0"]
        assert block.flags & CUDA_IPC == 0, "every import is closed: the snapshot is allowed again"
        block.close()
    finally:
        proc.kill()
        proc.wait()
