// IF nodes in a stream capture (graph_if_node.h): the condition is set on the device at each replay by a
// one-thread kernel captured before the node, so a replayed graph runs or skips the body without the host.
#include "graph_if_node.h"

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040
#define XMOD_IF_NODES 1
#else
#define XMOD_IF_NODES 0
#endif

namespace xmod_graph {

bool if_nodes_built() { return XMOD_IF_NODES; }

bool captures_into(cudaStream_t stream, unsigned long long id) {
  cudaStreamCaptureStatus status;
  unsigned long long stream_id = 0;
  if (cudaStreamGetCaptureInfo(stream, &status, &stream_id) != cudaSuccess) {
    cudaGetLastError();  // a query's failure must not surface as a later launch's error
    return false;
  }
  return status == cudaStreamCaptureStatusActive && stream_id == id;
}

#if XMOD_IF_NODES

namespace {
__global__ void set_if_condition(cudaGraphConditionalHandle handle, const bool* pred) {
  cudaGraphSetConditional(handle, *pred ? 1u : 0u);
}
}  // namespace

// CUDA 13 names the edge-data variants plainly; 12.4-12.9 (not compiled here: this machine has CUDA 13)
// keep the plain names for the variants without edge data.
#if CUDART_VERSION >= 13000
#define XMOD_CAPTURE_DEPENDENCIES(stream, deps, count) \
  cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, deps, nullptr, count)
#define XMOD_ADD_NODE(node, graph, deps, count, params) cudaGraphAddNode(node, graph, deps, nullptr, count, params)
#define XMOD_SET_DEPENDENCIES(stream, node) \
  cudaStreamUpdateCaptureDependencies(stream, node, nullptr, 1, cudaStreamSetCaptureDependencies)
#else
#define XMOD_CAPTURE_DEPENDENCIES(stream, deps, count) \
  cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, deps, count)
#define XMOD_ADD_NODE(node, graph, deps, count, params) cudaGraphAddNode(node, graph, deps, count, params)
#define XMOD_SET_DEPENDENCIES(stream, node) \
  cudaStreamUpdateCaptureDependencies(stream, node, 1, cudaStreamSetCaptureDependencies)
#endif

cudaError_t add_if_node(cudaStream_t stream, const bool* pred, cudaGraph_t* body,
                        unsigned long long* outer_id) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph;
  cudaError_t err = cudaStreamGetCaptureInfo(stream, &status, outer_id, &graph);
  if (err != cudaSuccess) return err;
  if (status != cudaStreamCaptureStatusActive) return cudaErrorIllegalState;  // no capture under way
  cudaGraphConditionalHandle handle;
  // cudaGraphCondAssignDefault: every launch of the graph starts the condition at 0 (skip)
  err = cudaGraphConditionalHandleCreate(&handle, graph, 0, cudaGraphCondAssignDefault);
  if (err != cudaSuccess) return err;
  set_if_condition<<<1, 1, 0, stream>>>(handle, pred);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // the node depends on what the capture reached so far, the condition's kernel included
  const cudaGraphNode_t* deps = nullptr;
  size_t count = 0;
  err = XMOD_CAPTURE_DEPENDENCIES(stream, &deps, &count);
  if (err != cudaSuccess) return err;
  cudaGraphNodeParams params = {};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
  err = XMOD_ADD_NODE(&node, graph, deps, count, &params);
  if (err != cudaSuccess) return err;
  *body = params.conditional.phGraph_out[0];
  return XMOD_SET_DEPENDENCIES(stream, &node);  // the capture goes on after the node
}

cudaError_t begin_capture_to_graph(cudaStream_t stream, cudaGraph_t graph, unsigned long long* capture_id) {
  // Relaxed: the outer capture's mode still governs what this thread may call
  cudaError_t err = cudaStreamBeginCaptureToGraph(stream, graph, nullptr, nullptr, 0, cudaStreamCaptureModeRelaxed);
  if (err != cudaSuccess) return err;
  cudaStreamCaptureStatus status;
  err = cudaStreamGetCaptureInfo(stream, &status, capture_id);
  if (err != cudaSuccess) {  // leave the stream as it was: not capturing
    cudaGraph_t unused;
    cudaStreamEndCapture(stream, &unused);
  }
  return err;
}

#else  // CUDA < 12.4: no conditional nodes

cudaError_t add_if_node(cudaStream_t, const bool*, cudaGraph_t*, unsigned long long*) {
  return cudaErrorNotSupported;
}

cudaError_t begin_capture_to_graph(cudaStream_t, cudaGraph_t, unsigned long long*) {
  return cudaErrorNotSupported;
}

#endif

}  // namespace xmod_graph
