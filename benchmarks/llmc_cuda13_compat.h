// Forced into llm.c's build (nvcc -include) by benchmarks/llmc.py when the CUDA toolkit is 13 or newer.
//
// CUDA 13 changed cudaMemAdvise's last parameter from an int device ordinal to a struct
// cudaMemLocation (CUDA 13.0 runtime API, cudaMemAdvise; the CUDA 12 spelling of the new form was
// cudaMemAdvise_v2). llm.c's cuda_utils.cuh (cudaMallocConditionallyManaged, the managed-memory
// fallback it takes only when cudaMalloc runs out of memory) still passes cudaCpuDeviceId, an int,
// so train_gpt2.cu does not compile against CUDA 13 (llm.c PRs #825 and #850 propose the fix; not
// merged in the clone measured here). This overload takes the old form and forwards it, leaving
// llm.c's sources as they are. It is never reached in a benchmark that fits in GPU memory.
#pragma once
#include <cuda_runtime_api.h>

#if defined(__cplusplus) && defined(CUDART_VERSION) && CUDART_VERSION >= 13000
static inline cudaError_t cudaMemAdvise(const void *ptr, size_t count, enum cudaMemoryAdvise advice, int device) {
    struct cudaMemLocation where = {};
    where.type = device == cudaCpuDeviceId ? cudaMemLocationTypeHost : cudaMemLocationTypeDevice;
    where.id = device == cudaCpuDeviceId ? 0 : device;
    return cudaMemAdvise(ptr, count, advice, where);
}
#endif
