// CUDA-graph IF nodes during stream capture, for torches that cannot open them (torch.cuda.CUDAGraph gained
// begin_capture_to_if_node in 2.12). Plain CUDA runtime calls, no torch types: graph_if_node_bindings.cpp
// adds the caching allocator's side and the Python binding.
#pragma once
#include <cuda_runtime_api.h>

namespace xmod_graph {

// Whether this build can open IF nodes: CUDA >= 12.4 runtime headers (conditional nodes and the device
// call that sets their condition).
bool if_nodes_built();

// In the capture running on `stream` (capture id `*outer_id`): one kernel that sets a condition from the
// device bool `*pred` at every replay, then an IF node after it, which the capture of `stream` continues
// after. `*body` receives the node's body graph, to be captured into (cudaStreamBeginCaptureToGraph).
cudaError_t add_if_node(cudaStream_t stream, const bool* pred, cudaGraph_t* body,
                        unsigned long long* outer_id);

// Begin capturing `stream` into `graph` (an IF node's body); `*capture_id` receives the capture's id.
cudaError_t begin_capture_to_graph(cudaStream_t stream, cudaGraph_t graph, unsigned long long* capture_id);

// Whether `stream` is capturing under the capture id `id` (the caching allocator's pool filter).
bool captures_into(cudaStream_t stream, unsigned long long id);

}  // namespace xmod_graph
