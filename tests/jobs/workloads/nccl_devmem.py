"""Data parallel with the model in "device memory": the parameters live in a cudaMalloc allocation of the
CUDA runtime in $FAKE_CUDART (tests/native/fakecuda: host memory, for machines without a GPU), reached only
through "kernels" (host functions run by cudaLaunchKernel) and cudaMemcpy, as on a GPU; the rest as
nccl_dp.py. Under `cryosleep run --fast-path` the preloaded interceptor serves that allocation itself and
moves it at every snapshot; under plain torchrun (the reference) it is the runtime's own."""

import ctypes
import os

from ncclstep import FLOAT64, Job, init_values, zeros

N = 48
STREAM = 0x100
SIZE = 2 << 20  # served by the interceptor from 1 MiB up
KERNEL = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


def main() -> None:
    job = Job()
    ctypes.CDLL(os.environ["FAKE_CUDART"], mode=ctypes.RTLD_GLOBAL)
    cuda = ctypes.CDLL(None)  # global scope: the interceptor, when preloaded, comes first
    ptr = ctypes.c_void_p()
    assert cuda.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(SIZE)) == 0
    params = (ctypes.c_double * (3 * N)).from_address(ptr.value)  # touched only inside kernels
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
        job.report(step, host)
    job.finish(world)


if __name__ == "__main__":
    main()
