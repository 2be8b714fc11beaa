"""ctypes bindings to NCCL's host API for the test workloads.

Symbols are looked up in the process's global scope, the way libtorch_cuda finds NCCL: an
LD_PRELOADed interceptor comes first, then the stand-in libnccl.so.2 (loaded RTLD_GLOBAL). The
stand-in's `standinStreamSynchronize` plays the part of `cudaStreamSynchronize`.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

# ncclDataType_t and ncclRedOp_t values from nccl.h
INT8, UINT8, INT32, UINT32, INT64, UINT64, FLOAT16, FLOAT32, FLOAT64, BFLOAT16 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
NOCOLOR = -1
CTYPE: dict[int, Any] = {
    INT8: ctypes.c_int8, UINT8: ctypes.c_uint8, INT32: ctypes.c_int32, UINT32: ctypes.c_uint32,
    INT64: ctypes.c_int64, UINT64: ctypes.c_uint64, FLOAT32: ctypes.c_float, FLOAT64: ctypes.c_double,
}
RESULT_NAMES = ["ncclSuccess", "ncclUnhandledCudaError", "ncclSystemError", "ncclInternalError",
                "ncclInvalidArgument", "ncclInvalidUsage", "ncclRemoteError", "ncclInProgress"]


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


class NcclError(RuntimeError):
    def __init__(self, code: int, what: str, text: str) -> None:
        name = RESULT_NAMES[code] if 0 <= code < len(RESULT_NAMES) else str(code)
        super().__init__(f"{what}: {name} ({text})")
        self.code = code


_vp, _sz, _int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    "ncclGetVersion": [ctypes.POINTER(_int)],
    "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(_vp), _int, UniqueId, _int],
    "ncclCommSplit": [_vp, _int, _int, ctypes.POINTER(_vp), _vp],
    "ncclCommFinalize": [_vp],
    "ncclCommDestroy": [_vp],
    "ncclCommAbort": [_vp],
    "ncclCommCount": [_vp, ctypes.POINTER(_int)],
    "ncclCommUserRank": [_vp, ctypes.POINTER(_int)],
    "ncclCommCuDevice": [_vp, ctypes.POINTER(_int)],
    "ncclCommGetAsyncError": [_vp, ctypes.POINTER(_int)],
    "ncclCommRegister": [_vp, _vp, _sz, ctypes.POINTER(_vp)],
    "ncclCommDeregister": [_vp, _vp],
    "ncclAllReduce": [_vp, _vp, _sz, _int, _int, _vp, _vp],
    "ncclReduce": [_vp, _vp, _sz, _int, _int, _int, _vp, _vp],
    "ncclBroadcast": [_vp, _vp, _sz, _int, _int, _vp, _vp],
    "ncclAllGather": [_vp, _vp, _sz, _int, _vp, _vp],
    "ncclReduceScatter": [_vp, _vp, _sz, _int, _int, _vp, _vp],
    "ncclAlltoAll": [_vp, _vp, _sz, _int, _vp, _vp],
    "ncclSend": [_vp, _sz, _int, _int, _vp, _vp],
    "ncclRecv": [_vp, _sz, _int, _int, _vp, _vp],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    "standinStreamSynchronize": [_vp],
    "standinCommSynchronize": [_vp],
}


class Nccl:
    """NCCL through the global scope. Methods raise NcclError on a non-success result."""

    def __init__(self, standin: str | None = None) -> None:
        lib = standin or os.environ["STANDIN_NCCL_LIB"]
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        self.lib = ctypes.CDLL(None)
        for name, args in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = args
            fn.restype = _int
        self.lib.ncclGetLastError.argtypes = [_vp]
        self.lib.ncclGetLastError.restype = ctypes.c_char_p

    def call(self, name: str, *args: Any) -> int:
        """Calls without raising; returns the ncclResult_t."""
        return int(getattr(self.lib, name)(*args))

    def check(self, name: str, *args: Any, comm: Any = None) -> None:
        r = self.call(name, *args)
        if r != 0:
            text = self.lib.ncclGetLastError(comm) or b""
            raise NcclError(r, name, text.decode(errors="replace"))

    def version(self) -> int:
        v = _int()
        self.check("ncclGetVersion", ctypes.byref(v))
        return v.value

    def unique_id(self) -> bytes:
        uid = UniqueId()
        self.check("ncclGetUniqueId", ctypes.byref(uid))
        return ctypes.string_at(ctypes.addressof(uid), 128)

    def init(self, nranks: int, uid: bytes, rank: int) -> int:
        comm = _vp()
        u = UniqueId()
        ctypes.memmove(ctypes.addressof(u), uid, 128)
        self.check("ncclCommInitRank", ctypes.byref(comm), nranks, u, rank)
        assert comm.value
        return comm.value

    def split(self, comm: int, color: int, key: int) -> int | None:
        new = _vp()
        self.check("ncclCommSplit", comm, color, key, ctypes.byref(new), None, comm=comm)
        return new.value

    def query(self, name: str, comm: int) -> int:
        v = _int()
        self.check(name, comm, ctypes.byref(v), comm=comm)
        return v.value

    def stream_sync(self, stream: int | None) -> None:
        self.check("standinStreamSynchronize", stream)

    def comm_sync(self, comm: int) -> None:
        self.check("standinCommSynchronize", comm, comm=comm)


def buffer(dtype: int, values: list[Any]) -> ctypes.Array[Any]:
    return (CTYPE[dtype] * len(values))(*values)


def zeros(dtype: int, n: int) -> ctypes.Array[Any]:
    return (CTYPE[dtype] * n)()


def addr(buf: ctypes.Array[Any]) -> int:
    return ctypes.addressof(buf)


def exchange_id(nccl: Nccl, path: Path, rank: int, root: int = 0, timeout: float = 30.0) -> bytes:
    """The root creates the unique id and publishes it as a file; the others wait for it."""
    if rank == root:
        uid = nccl.unique_id()
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(uid)
        tmp.rename(path)
        return uid
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no unique id at {path}")
        time.sleep(0.005)
    return path.read_bytes()
