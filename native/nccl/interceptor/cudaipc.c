/* CUDA IPC imports, counted. A process that has opened another process's GPU memory
 * (cudaIpcOpenMemHandle, what torch.multiprocessing does with CUDA tensors) checkpoints, then cannot be
 * restored by the driver (CUDA_ERROR_INVALID_VALUE, the process left CHECKPOINTED: seen on an H200 with
 * driver 580, docs/gpu-acceptance.md). So the interceptor, preloaded into every worker, wraps the CUDA
 * runtime's two IPC calls and keeps CS_F_CUDA_IPC set while any import is open; the agent refuses the
 * snapshot before touching the process. NCCL's own IPC goes through its statically linked runtime and
 * never reaches these wrappers (and its communicators are destroyed before the capture anyway). */
#include <dlfcn.h>

#include "cs.h"

typedef struct {
  char reserved[64];
} cs_ipc_handle; /* cudaIpcMemHandle_t: 64 opaque bytes, passed by value */

#define CUDA_ERROR_INITIALIZATION 3 /* cudaErrorInitializationError: no CUDA runtime in the process */

static long cs_ipc_open; /* imports currently open */

cudaError_t cudaIpcOpenMemHandle(void** dev_ptr, cs_ipc_handle handle, unsigned int flags) {
  static cudaError_t (*real)(void**, cs_ipc_handle, unsigned int);
  if (!real) *(void**)&real = dlsym(RTLD_NEXT, "cudaIpcOpenMemHandle");
  if (!real) return CUDA_ERROR_INITIALIZATION;
  cudaError_t r = real(dev_ptr, handle, flags);
  if (r == 0) {
    __atomic_add_fetch(&cs_ipc_open, 1, __ATOMIC_RELAXED);
    cs_set_flag(CS_F_CUDA_IPC);
  }
  return r;
}

cudaError_t cudaIpcCloseMemHandle(void* dev_ptr) {
  static cudaError_t (*real)(void*);
  if (!real) *(void**)&real = dlsym(RTLD_NEXT, "cudaIpcCloseMemHandle");
  if (!real) return CUDA_ERROR_INITIALIZATION;
  cudaError_t r = real(dev_ptr);
  if (r == 0 && __atomic_sub_fetch(&cs_ipc_open, 1, __ATOMIC_RELAXED) <= 0) cs_clear_flag(CS_F_CUDA_IPC);
  return r;
}
