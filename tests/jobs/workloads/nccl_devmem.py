"""Data parallel with the model in "device memory": the parameters live in a cudaMalloc allocation of the
CUDA runtime in $FAKE_CUDART (tests/native/fakecuda: host memory, for machines without a GPU), reached only
through "kernels" (host functions run by cudaLaunchKernel) and cudaMemcpy, as on a GPU; the rest as
nccl_dp.py. Under `cryosleep run --fast-path` the preloaded interceptor serves that allocation itself and
moves it at every snapshot; under plain torchrun (the reference) it is the runtime's own. The optimizer's state
lives in the other kinds of device memory a job has: a segment the workload maps itself with the driver's VMM
calls (as PyTorch's expandable segments and NCCL do), a cudaMalloc under 1 MiB (both moved by the fast path too)
and a cudaMallocAsync allocation (left to the driver's checkpoint: here CRIU copies it)."""

import ctypes
import os

from ncclstep import FLOAT64, Job, init_values, zeros

N = 48
STREAM = 0x100
SIZE = 2 << 20  # served by the interceptor from 1 MiB up
KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
MAPPED = 2 << 20  # mapped by the workload itself: two handles of 1 MiB side by side


class Prop(ctypes.Structure):  # CUmemAllocationProp: pinned memory on device 0
    _fields_ = [("type", ctypes.c_int), ("handle_types", ctypes.c_int), ("loc_type", ctypes.c_int),
                ("loc_id", ctypes.c_int), ("win32", ctypes.c_void_p), ("flags", ctypes.c_uint64)]


class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def mapped_segment(size: int) -> int:
    """An expandable segment: a range reserved, two handles mapped into it side by side (the second released
    at once, as NCCL does: its mapping keeps it), access granted once over the whole range."""
    drv = ctypes.CDLL("libcuda.so.1")  # found by dlsym, as PyTorch finds the driver's calls
    va = ctypes.c_uint64()
    assert drv.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0),
                                   ctypes.c_ulonglong(0)) == 0
    prop, half = Prop(1, 0, 1, 0, None, 0), size // 2
    for i in range(2):
        h = ctypes.c_uint64()
        assert drv.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(half), ctypes.byref(prop), ctypes.c_ulonglong(0)) == 0
        assert drv.cuMemMap(ctypes.c_uint64(va.value + i * half), ctypes.c_size_t(half), ctypes.c_size_t(0), h,
                            ctypes.c_ulonglong(0)) == 0
        if i == 1:
            assert drv.cuMemRelease(h) == 0
    acc = Access(1, 0, 3)  # read-write for device 0
    assert drv.cuMemSetAccess(ctypes.c_uint64(va.value), ctypes.c_size_t(size), ctypes.byref(acc),
                              ctypes.c_size_t(1)) == 0
    return va.value


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def main() -> None:
    job = Job()
    ctypes.CDLL(os.environ["FAKE_CUDART"], mode=ctypes.RTLD_GLOBAL)
    cuda = ctypes.CDLL(None)  # global scope: the interceptor, when preloaded, comes first
    ptr = ctypes.c_void_p()
    assert cuda.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(SIZE)) == 0
    params = (ctypes.c_double * (3 * N)).from_address(ptr.value)  # touched only inside kernels
    seg = mapped_segment(MAPPED)
    momentum = (ctypes.c_double * (3 * N)).from_address(seg)  # in the first handle
    ema = (ctypes.c_double * (3 * N)).from_address(seg + MAPPED // 2)  # in the second
    pool, small = ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cudaMallocAsync(ctypes.byref(pool), ctypes.c_size_t(8 * 3 * N), None) == 0
    assert cuda.cudaMalloc(ctypes.byref(small), ctypes.c_size_t(8 * N)) == 0  # under 1 MiB
    velocity = (ctypes.c_double * (3 * N)).from_address(pool.value)
    bias = (ctypes.c_double * N).from_address(small.value)
    state_host = [zeros(FLOAT64, 3 * N), zeros(FLOAT64, 3 * N), zeros(FLOAT64, 3 * N), zeros(FLOAT64, N)]
    host = zeros(FLOAT64, 3 * N)
    grads = [zeros(FLOAT64, N) for _ in range(3)]
    summed = [zeros(FLOAT64, N) for _ in range(3)]
    state = {"step": 0}

    def launch(kernel: object) -> None:
        assert cuda.cudaLaunchKernel(ctypes.cast(kernel, ctypes.c_void_p), Dim3(1, 1, 1), Dim3(1, 1, 1), None,
                                     ctypes.c_size_t(0), None) == 0

    @KERNEL
    def k_init(_: object) -> None:
        for i, v in enumerate(init_values(job.rank, 3 * N)):
            params[i] = v
            momentum[i] = ema[i] = velocity[i] = 0.0
        for i in range(N):
            bias[i] = 0.25 * i

    @KERNEL
    def k_grads(_: object) -> None:
        for b in range(3):
            for i in range(N):
                grads[b][i] = (params[b * N + i] * (job.rank + 1) + state["step"]) % 13.0

    @KERNEL
    def k_update(_: object) -> None:
        for b in range(3):
            for i in range(N):
                params[b * N + i] = (params[b * N + i] - 0.01 * summed[b][i] / job.nranks) % 1000.0
        for i in range(3 * N):
            params[i] = (params[i] + 0.5 * params[i]) % 1000.0
            momentum[i] = (0.9 * momentum[i] + summed[i // N][i % N]) % 1000.0
            ema[i] = (0.5 * ema[i] + params[i]) % 1000.0
            velocity[i] = (velocity[i] + momentum[i] + bias[i % N]) % 1000.0
        for i in range(N):
            bias[i] = (bias[i] + 0.125 * (state["step"] % 5)) % 100.0

    launch(k_init)
    world = job.comm("world")
    for step in range(job.args.steps):
        job.before_step(step)
        state["step"] = step
        launch(k_grads)
        for b in range(3):
            job.allreduce(grads[b], summed[b], world, STREAM)
        job.sync(STREAM)
        launch(k_update)
        assert cuda.cudaMemcpy(ctypes.c_void_p(ctypes.addressof(host)), ptr, ctypes.c_size_t(8 * 3 * N), 2) == 0
        for buf, src in zip(state_host, (seg, seg + MAPPED // 2, pool.value, small.value), strict=True):
            assert cuda.cudaMemcpy(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_void_p(src),
                                   ctypes.c_size_t(ctypes.sizeof(buf)), 2) == 0
        job.report(step, host, *state_host)
    job.finish(world)


if __name__ == "__main__":
    main()
