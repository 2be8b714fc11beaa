#!/usr/bin/env python3
"""Generates the interceptor's pass-through wrappers from nccl.h (as NCCL's contrib/nccl_checkpoint).

    gen_wrappers.py NCCL_H OUTDIR

writes OUTDIR/cs_generated.h  the table of real NCCL functions (struct cs_real_table, CS_REAL_NAMES)
       OUTDIR/cs_generated.c  a wrapper for every function that takes a communicator and needs no care
       OUTDIR/cs_exports.map  the linker version script: the wrapped NCCL API is all the library exports

A wrapper passes the gate, counts the call and translates the virtual communicator:
collectives (a communicator and a stream) count toward the communicator's sequence number,
ncclSend/ncclRecv toward the per-peer counters, anything else is only gated. Functions that
create communicators or need other care are in MANUAL, each with the reason, and written by hand
in manual.c. A new NCCL function that creates communicators stops the build until it is placed.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

# Hand-written in manual.c: name -> why it needs care.
# CUDA driver submission calls exported under their own names (drvgate.c: a library linked against libcuda
# binds to the gated versions); each takes at most eleven integer-class arguments.
DRIVER_EXPORTS = [
    "cuLaunchKernel", "cuLaunchKernel_ptsz", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", "cuLaunchCooperativeKernel",
    "cuLaunchCooperativeKernel_ptsz", "cuGraphLaunch", "cuGraphLaunch_ptsz", "cuMemcpy", "cuMemcpy_ptds",
    "cuMemcpyAsync", "cuMemcpyAsync_ptsz", "cuMemcpyPeer", "cuMemcpyPeerAsync", "cuMemcpyHtoD_v2",
    "cuMemcpyHtoD_v2_ptds", "cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds", "cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds",
    "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz",
    "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz", "cuMemcpy2D_v2", "cuMemcpy2DAsync_v2", "cuMemcpy3D_v2",
    "cuMemcpy3DAsync_v2", "cuMemsetD8_v2", "cuMemsetD16_v2", "cuMemsetD32_v2", "cuMemsetD8Async", "cuMemsetD16Async",
    "cuMemsetD32Async", "cuStreamWriteValue32_v2", "cuStreamWriteValue64_v2", "cuStreamBatchMemOp_v2",
]

CUDA_RUNTIME = {"cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaMalloc", "cudaFree", "cudaLaunchKernel",
                "cudaLaunchKernelExC", "cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpy2DAsync", "cudaMemset",
                "cudaMemsetAsync", "cudaGraphLaunch", "cudaMallocAsync", "cudaMallocFromPoolAsync", "cudaFreeAsync"}

# The driver's calls on memory the application maps itself (vmm.c: its handles are virtual with the fast path on).
VMM_EXPORTS = ["cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess", "cuMemRetainAllocationHandle",
               "cuMemGetAllocationPropertiesFromHandle", "cuMemExportToShareableHandle"]

MANUAL: dict[str, str] = {
    "ncclGetUniqueId": "gated: it opens a listening socket, which must not appear while quiesced",
    "ncclCommInitRank": "creates a virtual handle; records rank, size and id for rebuild",
    "ncclCommInitRankConfig": "creates a virtual handle; records rank, size, id and config for rebuild",
    "ncclCommInitRankScalable": "creates a virtual handle; rebuilt from one fresh id",
    "ncclCommInitAll": "several devices in one process: passed through untracked, flagged",
    "ncclCommSplit": "records parent, color, key, config for replay; counted as a collective of the parent",
    "ncclCommShrink": "not replayed: passed through untracked, flagged",
    "ncclCommFinalize": "a finalized communicator is destroyed at quiesce and not rebuilt",
    "ncclCommDestroy": "frees the virtual handle and its split history",
    "ncclCommAbort": "frees the virtual handle and its split history",
    "ncclCommCount": "answered from the record: valid while quiesced",
    "ncclCommUserRank": "answered from the record: valid while quiesced",
    "ncclCommCuDevice": "answered from the record: valid while quiesced",
    "ncclCommGetAsyncError": "never held (PyTorch's watchdog polls it); answered locally while quiesced",
    "ncclGetLastError": "never held; its communicator may be quiesced",
    "ncclCommRegister": "virtual registration handles, re-registered at rebuild",
    "ncclCommDeregister": "translates the virtual registration handle",
    "ncclCommWindowRegister": "flagged: symmetric windows are not re-registered after rebuild",
    "ncclRedOpCreatePreMulSum": "counted: an operator alive at a snapshot is not replayed",
    "ncclRedOpDestroy": "counted: an operator alive at a snapshot is not replayed",
    "ncclGroupStart": "group depth; the gate is checked at the outermost start only",
    "ncclGroupEnd": "group depth; never held (the group is already open)",
    "ncclGroupSimulateEnd": "ends a group like ncclGroupEnd",
}

# Point-to-point calls: counted per peer (the parameter named `peer`).
P2P = {"ncclSend": "CS_K_SEND", "ncclRecv": "CS_K_RECV"}


@dataclass
class Param:
    text: str
    type_: str
    name: str


@dataclass
class Function:
    ret: str
    name: str
    params: list[Param]

    def comm_params(self) -> list[Param]:
        return [p for p in self.params if p.type_ in ("ncclComm_t", "const ncclComm_t")]

    def creates_comm(self) -> bool:
        return any(p.type_ == "ncclComm_t*" for p in self.params)


def parse(header: str) -> list[Function]:
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    decl = re.compile(r"(ncclResult_t|const\s+char\s*\*)\s*(nccl\w+)\s*\(([^)]*)\)\s*;", re.S)
    out: list[Function] = []
    seen: set[str] = set()
    for m in decl.finditer(text):
        ret, name, raw = re.sub(r"\s+", " ", m.group(1)).replace(" *", "*"), m.group(2), m.group(3)
        if name in seen:
            continue
        seen.add(name)
        params = []
        for piece in raw.split(","):
            piece = " ".join(piece.split())
            if not piece or piece == "void":
                continue
            pm = re.match(r"^(.*?)(\w+)$", piece)
            if not pm:
                raise SystemExit(f"gen_wrappers: cannot parse parameter {piece!r} of {name}")
            type_ = re.sub(r"\s*\*\s*", "*", pm.group(1).strip())
            params.append(Param(piece, type_, pm.group(2)))
        out.append(Function(ret, name, params))
    return out


def wrapper(fn: Function) -> str:
    comms = fn.comm_params()
    comm = comms[0].name
    if fn.name in P2P:
        kind, peer = P2P[fn.name], "peer"
    elif any(p.type_ == "cudaStream_t" for p in fn.params):
        kind, peer = "CS_K_COLL", "0"
    else:
        kind, peer = "CS_K_MGMT", "0"
    decl = ", ".join(p.text for p in fn.params) or "void"
    args = ", ".join(("real_comm" if p.name == comm else p.name) for p in fn.params)
    return f"""/* {kind[5:].lower()} */
ncclResult_t {fn.name}({decl}) {{
  struct cs_tslot* t = cs_thread();
  ncclComm_t real_comm;
  ncclResult_t r = cs_enter(t, {kind}, {comm}, {peer}, &real_comm);
  if (r == ncclSuccess) r = cs_real.{fn.name} ? cs_real.{fn.name}({args}) : cs_missing("{fn.name}");
  cs_leave(t);
  return r;
}}
"""


def main() -> None:
    header_path, outdir = Path(sys.argv[1]), Path(sys.argv[2])
    fns = parse(header_path.read_text())
    names = {f.name for f in fns}
    for name in MANUAL:
        if name not in names:
            print(f"gen_wrappers: note: {name} is not in {header_path.name}", file=sys.stderr)
    generated: list[Function] = []
    for fn in fns:
        if fn.name in MANUAL or not fn.comm_params() and not fn.creates_comm():
            continue
        if fn.creates_comm():
            raise SystemExit(f"gen_wrappers: {fn.name} creates communicators: add it to MANUAL and manual.c")
        if len(fn.comm_params()) != 1 or fn.ret != "ncclResult_t":
            raise SystemExit(f"gen_wrappers: {fn.name} has an unusual signature: add it to MANUAL and manual.c")
        generated.append(fn)

    table = "\n".join(f"  __typeof__({f.name})* {f.name};" for f in fns)
    xmacro = " \\\n".join(f"  X({f.name})" for f in fns)
    drv = " \\\n".join(f"  X({n})" for n in DRIVER_EXPORTS)
    (outdir / "cs_generated.h").write_text(f"""/* Generated by gen_wrappers.py from {header_path.name}: do not edit. */
#ifndef CRYOSLEEP_CS_GENERATED_H
#define CRYOSLEEP_CS_GENERATED_H
#include <nccl.h>

/* Every NCCL function of the header, resolved from the real library once at init. */
struct cs_real_table {{
{table}
}};

#define CS_REAL_NAMES(X) \\
{xmacro}

/* CUDA driver submission calls exported by drvgate.c. */
#define CS_DRV_EXPORTS(X) \\
{drv}

#endif
""")
    body = "\n".join(wrapper(f) for f in generated)
    manual = "\n".join(f" *   {n:26s} {why}" for n, why in MANUAL.items())
    (outdir / "cs_generated.c").write_text(f"""/* Generated by gen_wrappers.py from {header_path.name}: do not edit.
 * Pass-through wrappers; hand-written in manual.c (and why):
{manual}
 */
#include "cs.h"

{body}""")
    # and the CUDA runtime calls it wraps: IPC (cudaipc.c) and device allocations (devmem.c)
    exported = sorted({f.name for f in generated} | (set(MANUAL) & names) | CUDA_RUNTIME | set(DRIVER_EXPORTS) | set(VMM_EXPORTS)
                      | {"dlsym", "cuGetProcAddress", "cuGetProcAddress_v2"})
    lines = "\n".join(f"    {n};" for n in exported)
    (outdir / "cs_exports.map").write_text(f"""/* Generated by gen_wrappers.py: NCCL's API and the CUDA runtime calls wrapped. */
{{
  global:
{lines}
  local:
    *;
}};
""")


if __name__ == "__main__":
    main()
