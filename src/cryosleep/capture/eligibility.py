"""Every eligibility check in one place, each returning a Check (name, ok, detail).

System checks answer "can this machine capture and restore at all"; job checks answer "can this job's
processes be captured now". A snapshot runs the job checks first and refuses with their reasons rather
than fail half-way.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryosleep import paths
from cryosleep.capture import criu_install, cuda
from cryosleep.core import privileges, proctree
from cryosleep.core.interceptor import ControlBlock, DevMem, flag_reasons
from cryosleep.errors import CryosleepError
from cryosleep.net import tools as net_tools


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    fatal: bool = True  # a failed non-fatal check is a warning

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _kernel() -> Check:
    rel = platform.release()
    try:
        major, minor = (int(x) for x in rel.split(".")[:2])
    except ValueError:
        return Check("kernel", False, f"cannot parse kernel release {rel!r}")
    ok = (major, minor) >= (5, 10)
    return Check("kernel", ok, f"Linux {rel}" + ("" if ok else " (need >= 5.10 for CRIU 4.2)"))


def _root() -> Check:
    ok = os.geteuid() == 0
    return Check("privileges", ok, "running as root" if ok else
                 "not root: CRIU needs root (or CAP_CHECKPOINT_RESTORE and CAP_SYS_ADMIN); run with sudo")


def _capabilities() -> list[Check]:
    """Which of the capabilities a snapshot and a restore need this process lacks (core/privileges.py)."""
    out = []
    for name, need in (("capabilities (run, snapshot)", privileges.SNAPSHOT),
                       ("capabilities (restore)", privileges.RESTORE)):
        lacking = privileges.missing(need)
        out.append(Check(name, not lacking, f"missing {', '.join(lacking)}: grant them (docs/security.md)" if lacking
                         else f"all {len(need)}: " + ", ".join(f"CAP_{n.upper()}" for n in sorted(need))))
    return out


def _pid_namespaces() -> Check:
    ok = Path("/proc/self/ns/pid").exists()
    return Check("pid namespaces", ok, "available" if ok else "the kernel has no PID namespaces")


def _native() -> Check:
    init = paths.native_dir() / "cryosleep-init"
    ok = init.is_file() and os.access(init, os.X_OK)
    return Check("sandbox init", ok, str(init) if ok else
                 f"{init} is missing: build it with `make -C native` (part of `make setup`)")


def _criu() -> list[Check]:
    try:
        criu = criu_install.locate()
    except CryosleepError as e:
        return [Check("criu", False, f"{e.what}; {e.hint}")]
    out = [Check("criu", True, f"CRIU {criu.version} ({criu.source}: {' '.join(criu.argv[-1:])})")]
    if os.geteuid() != 0:
        out.append(Check("criu check", False, "skipped: needs root"))
        return out
    res = subprocess.run(criu.command("check"), env=criu.env(), capture_output=True, text=True, check=False)
    text = (res.stdout + res.stderr).strip().splitlines()
    verdict = [ln for ln in text if "RLIMIT_NOFILE" not in ln and "kdat cache" not in ln]
    out.append(Check("criu check", res.returncode == 0, verdict[-1] if verdict else f"exit {res.returncode}"))
    out.append(Check("network lock", criu.nft_argv is not None,
                     "nftables (nft available to release a lock)" if criu.nft_argv else
                     "nft not found: a killed dump's network lock could not be removed"))
    out.append(_iproute())
    return out


def _iproute() -> Check:
    """iproute2's ip: `--net job` and CRIU's dump and restore of a network namespace run it."""
    try:
        ip = net_tools.iproute_argv("ip")
    except CryosleepError as e:
        return Check("iproute2", False, f"{e.what}: `--net job` cannot work; {e.hint}", fatal=False)
    return Check("iproute2", True, f"ip: {ip[-1]}" + (" (private prefix)" if len(ip) > 1 else ""))


# The driver's checkpoint API appeared in 550; restoring onto other GPUs (a UUID map) needs 570 or later.
MIN_DRIVER = (550, 0)
MIN_DRIVER_GPU_MAP = (570, 0)
SMI_QUERY = "name,uuid,driver_version,persistence_mode,mig.mode.current"


def gpu_checks_from_smi(csv: str, env: dict[str, str]) -> list[Check]:
    """The GPU part of the report, from `nvidia-smi --query-gpu=SMI_QUERY --format=csv,noheader`."""
    rows = [[c.strip() for c in line.split(",")] for line in csv.strip().splitlines() if line.strip()]
    if not rows:
        return [Check("gpus", True, "none on this machine (CPU jobs only)", fatal=False)]
    out: list[Check] = []
    models = sorted({r[0] for r in rows})
    out.append(Check("gpus", len(models) == 1, f"{len(rows)} x {', '.join(models)}" +
                     ("" if len(models) == 1 else ": mixed models; a job's GPUs must be of one model"), fatal=False))
    driver = rows[0][2]
    try:
        version = tuple(int(x) for x in driver.split(".")[:2])
    except ValueError:
        version = (0, 0)
    ok = version >= MIN_DRIVER
    detail = f"NVIDIA driver {driver}"
    if not ok:
        detail += f": the CUDA checkpoint API needs {MIN_DRIVER[0]} or later"
    elif version < MIN_DRIVER_GPU_MAP:
        detail += f": restore onto other GPUs (--gpu-map) needs {MIN_DRIVER_GPU_MAP[0]} or later"
    out.append(Check("driver", ok, detail))
    off = [r[1] for r in rows if r[3].lower() != "enabled"]
    out.append(Check("persistence mode", not off, "enabled on every GPU" if not off else
                     f"off on {len(off)} GPU(s): the driver may unload between jobs and a restore then pays its "
                     "start-up; ask the machine's administrator to enable it", fatal=False))
    mig = [r[1] for r in rows if r[4].lower() == "enabled"]
    out.append(Check("MIG", not mig, "off" if not mig else
                     f"MIG is enabled on {len(mig)} GPU(s): the CUDA checkpoint does not support MIG instances"))
    mps = env.get("CUDA_MPS_PIPE_DIRECTORY") or ("/tmp/nvidia-mps" if Path("/tmp/nvidia-mps/control").exists() else "")
    out.append(Check("MPS", not mps, "not in use" if not mps else
                     f"an MPS server is in use ({mps}): processes behind MPS cannot be checkpointed"))
    nvls = env.get("NCCL_NVLS_ENABLE")
    out.append(Check("NCCL_NVLS_ENABLE", nvls in (None, "0"), "unset (cryosleep run sets it to 0)" if nvls is None
                     else f"{nvls} in this environment" + ("" if nvls == "0" else ": NVLink multicast cannot be "
                                                                              "captured; set it to 0"),
                     fatal=False))
    return out


def _gpu() -> list[Check]:
    import shutil

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [Check("gpus", True, "no nvidia-smi: CPU jobs only", fatal=False)]
    res = subprocess.run([smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60, check=False)
    if res.returncode != 0:
        return [Check("gpus", False, f"nvidia-smi failed: {res.stderr.strip() or res.stdout.strip()}", fatal=False)]
    checks = gpu_checks_from_smi(res.stdout, dict(os.environ))
    checks.append(Check("cuda checkpoint API", cuda.available(), "libcuda has cuCheckpointProcessLock"
                        if cuda.available() else "libcuda.so.1 or its checkpoint API is missing"))
    return checks


def system_checks() -> list[Check]:
    return [_kernel(), _root(), *_capabilities(), _pid_namespaces(), _native(), *_criu(), *_gpu()]


GPU_DEVICES = ("/dev/nvidia", "/dev/dri")
UVM_DEVICE = "/dev/nvidia-uvm"
UVM_DRIVER_MAPPING = 2 << 20  # the one mapping of /dev/nvidia-uvm every CUDA process has (H200, driver 580)


def managed_memory_bytes(maps: str) -> int:
    """Bytes of CUDA managed memory (cudaMallocManaged) in a process, from its /proc/PID/maps text.

    Seen on an H200 with driver 580 (docs/gpu-acceptance.md): every CUDA process maps /dev/nvidia-uvm once,
    2 MiB; a managed allocation adds a mapping of /dev/nvidia-uvm of its own size. The driver's checkpoint
    refuses such a process (CUDA_ERROR_NOT_SUPPORTED, the process stays locked and is unlocked by the
    rollback), so `check` names it first. A managed allocation of exactly 2 MiB is not told apart here;
    the driver still refuses it."""
    total = 0
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].strip() == UVM_DEVICE:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo != UVM_DRIVER_MAPPING:
                total += hi - lo
    return total


def _gpu_process(pid: int, who: str) -> list[Check]:
    out: list[Check] = []
    if not cuda.available():
        out.append(Check("gpu", False, f"{who} uses a GPU, but the CUDA driver's checkpoint API is not available "
                                       "to the agent (libcuda with cuCheckpointProcessLock, driver >= 550)"))
    maps = proctree.maps_paths(pid)
    nccl = any("/libnccl" in m for m in maps)
    intercepted = any("libcryosleep_nccl" in m for m in maps)
    if nccl and not intercepted:
        out.append(Check("nccl", False, f"{who} has NCCL loaded without Cryosleep's interceptor: if it holds live "
                                        "communicators, the CUDA checkpoint fails and the snapshot is rolled back "
                                        "(docs/facts.md)", fatal=False))
    try:
        managed = managed_memory_bytes(Path(f"/proc/{pid}/maps").read_text())
    except OSError:
        managed = 0
    if managed:
        out.append(Check("managed memory", False, f"{who} holds {managed / 2**20:.0f} MiB of CUDA managed memory "
                                                  "(cudaMallocManaged), which the CUDA checkpoint refuses "
                                                  "(CUDA_ERROR_NOT_SUPPORTED): allocate with cudaMalloc instead"))
    env = proctree.environ(pid)
    if nccl and env.get("NCCL_NVLS_ENABLE", "") != "0":
        out.append(Check("nvls", False, f"{who}: NCCL_NVLS_ENABLE is not 0 (NVLink multicast cannot be captured)"))
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _kib(n: int) -> str:
    return _size(n) if n >= 2**20 else f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n} bytes"


def fast_path_checks(rank: int, dm: DevMem) -> list[Check]:
    """What a snapshot of the rank would take with the fast path: the memory it moves, what it leaves to the
    driver's checkpoint and why, and how its staging arena was pinned (informational rows)."""
    small = f", {dm.slab_count} cudaMalloc under 1 MiB held in shared 2 MiB chunks" if dm.slab_count else ""
    moved = (f"rank {rank}: moves {_size(dm.moved_bytes)} itself ({_size(dm.bytes)} it serves for cudaMalloc in "
             f"{dm.count} VMM allocation(s){small}; {_size(dm.vmm_bytes)} in {dm.vmm_count} handle(s) the "
             "application mapped with cuMemCreate/cuMemMap)")
    if dm.stage_bytes:
        a = dm.arena()
        how = ", ".join(w for w, on in (("prefaulted", a["prefaulted"]), ("huge pages", a["huge_pages"]),
                                        ("made early", a["early"])) if on) or "not prefaulted, small pages"
        staged = (f"its staging arena holds {_size(dm.stage_bytes)}, pinned once ({how}; {dm.arena_pins} "
                  f"cuMemHostRegister call(s) of {_size(dm.arena_piece)}; prefault {dm.arena_prefault_s:.2f} s, "
                  f"pin {dm.arena_pin_s:.2f} s)")
        if dm.stage_bytes < dm.moved_bytes:
            staged += (f", {_size(dm.moved_bytes - dm.stage_bytes)} short of the device memory: the next snapshot "
                       "grows and pins it")
    else:
        staged = ("its staging arena is made at the first snapshot (as much host memory, on /dev/shm; pinning it "
                  "stalls the job's CUDA calls meanwhile, about 9 s for 24 GiB on an H200; "
                  "CRYOSLEEP_ARENA_BYTES makes it ahead)")
    out = [Check("fast path", True, f"{moved}; {staged}", fatal=False)]
    for kind, n, count, why in dm.left():
        out.append(Check("fast path: left to the driver", True,
                         f"rank {rank}: {_kib(n)} in {count} {kind} allocation(s) are copied by the driver's "
                         f"checkpoint instead (slower, inside the pause): {why}", fatal=False))
    return out


def interceptor_checks(blocks: Mapping[int, ControlBlock]) -> list[Check]:
    """What the workers' NCCL interceptors refuse: the feature flags they publish (docs/interceptor.md,
    "Check"), a block no control thread serves, and (a warning here, refused at the cut) user reduction
    operators alive. ``blocks`` maps job rank -> published control block."""
    out: list[Check] = []
    for rank, b in sorted(blocks.items()):
        if not b.control_thread:
            out.append(Check("nccl interceptor", False,
                             f"rank {rank}: no interceptor control thread serves its NCCL control block, so it "
                             "cannot be held at a cut (see its log for lines 'cryosleep-nccl[PID]')"))
        for why in flag_reasons(b.flags):
            out.append(Check("nccl features", False,
                             f"rank {rank}: {why}; a snapshot cannot rebuild its NCCL state (this stays so for the "
                             "life of the process)"))
        if b.premul_live:
            out.append(Check("nccl features", False,
                             f"rank {rank}: {b.premul_live} user reduction operator(s) (ncclRedOpCreatePreMulSum) "
                             "are alive now; a snapshot is refused if they still are at the cut", fatal=False))
        dm = b.devmem
        if dm.on:  # informational: what the fast path will move (docs/interceptor.md, "The fast path")
            out.extend(fast_path_checks(rank, dm))
    return out


def nccl_env_checks(env: Mapping[str, str], interceptor: bool) -> list[Check]:
    """Warnings about how a job was started (its spec's environment and `cryosleep run` flags)."""
    out: list[Check] = []
    if not interceptor:
        out.append(Check("nccl interceptor", False,
                         "the job runs without the NCCL interceptor (`cryosleep run --no-interceptor`): if it holds "
                         "live NCCL communicators on GPUs, its snapshots fail and are rolled back", fatal=False))
    elif env.get("NCCL_NVLS_ENABLE", "0") != "0":
        out.append(Check("nvls", False,
                         f"the job was started with NCCL_NVLS_ENABLE={env['NCCL_NVLS_ENABLE']}: NVLink multicast "
                         "cannot be captured, so a GPU snapshot of it is refused where NCCL uses NVLS; start it "
                         "without that setting (`cryosleep run` then sets 0)", fatal=False))
    return out


def process_checks(root_pid: int) -> list[Check]:
    """What the processes of a sandbox hold that CRIU cannot capture (empty list: nothing found)."""
    problems: list[Check] = []
    if not proctree.alive(root_pid):
        return [Check("job processes", False, f"the job's init (PID {root_pid}) is not running")]
    for pid in proctree.tree(root_pid):
        st = proctree.state(pid)
        comm = Path(f"/proc/{pid}/comm").read_text().strip() if Path(f"/proc/{pid}/comm").exists() else "?"
        who = f"PID {pid} ({comm})"
        if st in ("T", "t"):
            problems.append(Check("process state", False, f"{who} is stopped or traced (another debugger?)"))
        held = proctree.open_files(pid)
        for f in held:
            if f.target == "anon_inode:[io_uring]":
                problems.append(Check("io_uring", False,
                                      f"{who} holds an io_uring, which CRIU cannot dump (PyTorch's libuv TCPStore "
                                      "does this: run the job with USE_LIBUV=0, as `cryosleep run` does)"))
        if any(f.target.startswith(GPU_DEVICES) for f in held):
            problems.extend(_gpu_process(pid, who))
    seen: set[tuple[str, str]] = set()
    unique = []
    for c in problems:
        if (c.name, c.detail) not in seen:
            seen.add((c.name, c.detail))
            unique.append(c)
    return unique
