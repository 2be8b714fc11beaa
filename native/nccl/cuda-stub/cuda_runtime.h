/* The two CUDA runtime types that nccl.h needs, for building without a CUDA toolkit.
 * cudaStream_t is an opaque pointer in the real header too, so the ABI is the same. */
#ifndef CRYOSLEEP_CUDA_RUNTIME_STUB_H
#define CRYOSLEEP_CUDA_RUNTIME_STUB_H
#include <stddef.h> /* the real header brings size_t in too */
typedef struct CUstream_st* cudaStream_t;
typedef int cudaError_t;
#endif
