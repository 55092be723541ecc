// Plain C++ interface between the torch bindings and the nvcc-compiled kernels (no torch types,
// so permute_kernels.cu can be compiled without the torch headers).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace xmod_permute {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// out[k*b rows] = x rows at indices. x: [s,b,h], indices: [k,b], out: [k,b,h]; all contiguous.
cudaError_t launch_gather(DType dt, const void* x, const int64_t* indices, void* out, int64_t s,
                          int64_t k, int64_t b, int64_t h, cudaStream_t stream);

// out: [s,b,h]. Row (t,c) = (x ? x : 0) + (routed as j ? (gate ? gate[j,c] : 1) * y[j,c] : 0).
// x and gate may be null. Scatter-gated forward and gather backward.
cudaError_t launch_scatter_add_gated(DType dt, const void* x, const void* y, const void* gate,
                                     const int64_t* indices, void* out, int64_t s, int64_t k,
                                     int64_t b, int64_t h, cudaStream_t stream);

// Scatter-gated backward for y and gate (grad_x is grad_out itself). grad_y / grad_gate may be
// null when not needed.
cudaError_t launch_scatter_backward(DType dt, const void* grad_out, const void* y,
                                    const void* gate, const int64_t* indices, void* grad_y,
                                    void* grad_gate, int64_t s, int64_t k, int64_t b, int64_t h,
                                    cudaStream_t stream);

}  // namespace xmod_permute
