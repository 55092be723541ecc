// Torch side of the CUDA-graph IF nodes of graph_if_node.h (megatron_xmod/hf/static_decode.py uses them where
// torch.cuda.CUDAGraph has no begin_capture_to_if_node, torch < 2.12): the body is captured on a stream of its
// own, made torch's current stream, and the caching allocator serves that capture from the graph's memory
// pool, as it serves the graph's own capture; ending the node gives both back.
#include <torch/extension.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "graph_if_node.h"

namespace {

namespace allocator = c10::cuda::CUDACachingAllocator;

struct OpenIfNode {
  c10::cuda::CUDAStream outer;  // the stream of the capture the node belongs to
  cudaStream_t body_stream;
  unsigned long long outer_id;
  c10::MempoolId_t pool;
};

// Nodes may nest: the innermost is ended first. Per thread, as stream capture is.
thread_local std::vector<OpenIfNode> open_nodes;

// Body streams, kept for the next node rather than destroyed: a capture then creates none after the first
// (the decode state's relaxed warm-up capture creates them; a global-mode capture reuses them), and the
// allocator, which keys its free blocks by stream, reuses one body's blocks in the next. Not torch's stream
// pool: its 32 streams go round, and one of them may be the outer capture's own stream.
std::mutex streams_mutex;
std::unordered_map<c10::DeviceIndex, std::vector<cudaStream_t>> free_streams;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // as C10_CUDA_CHECK: a later launch check must not report this error again
    TORCH_CHECK(false, "xmod graph IF node: ", what, " failed: ", cudaGetErrorString(err));
  }
}

// The allocator option graph_capture_record_stream_reuse (torch >= 2.10 or so; absent before) makes
// endAllocateToPool assert while the outer stream is still capturing, which a node's allocator switch does.
template <typename Config, typename = void>
struct has_record_stream_reuse : std::false_type {};
template <typename Config>
struct has_record_stream_reuse<Config, std::void_t<decltype(Config::graph_capture_record_stream_reuse())>>
    : std::true_type {};

bool record_stream_reuse() {
  using Config = allocator::CUDAAllocatorConfig;
  if constexpr (has_record_stream_reuse<Config>::value) {
    return Config::graph_capture_record_stream_reuse();
  } else {
    return false;
  }
}

cudaStream_t take_stream(c10::DeviceIndex device) {
  {
    const std::lock_guard<std::mutex> lock(streams_mutex);
    auto& free = free_streams[device];
    if (!free.empty()) {
      cudaStream_t stream = free.back();
      free.pop_back();
      return stream;
    }
  }
  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a stream for the body");
  return stream;
}

void give_stream(c10::DeviceIndex device, cudaStream_t stream) {
  const std::lock_guard<std::mutex> lock(streams_mutex);
  free_streams[device].push_back(stream);
}

// The pool's allocations go to the capture `capture_id` instead of the one they went to. beginAllocateToPool
// takes a use of the pool as capture_begin's does, and only CUDAGraph::reset's releasePool gives one back:
// give this one back at once, or the pool would never be freed.
void allocate_to_pool_for(c10::DeviceIndex device, const c10::MempoolId_t& pool, unsigned long long capture_id) {
  allocator::endAllocateToPool(device, pool);
  allocator::beginAllocateToPool(device, pool, [capture_id](cudaStream_t stream) {
    return xmod_graph::captures_into(stream, capture_id);
  });
  allocator::releasePool(device, pool);
}

void begin_capture_to_if_node(const torch::Tensor& pred, uint64_t pool_first, uint64_t pool_second) {
  TORCH_CHECK(xmod_graph::if_nodes_built(), "xmod graph IF node: built without CUDA >= 12.4 runtime headers");
  TORCH_CHECK(pred.is_cuda() && pred.scalar_type() == torch::kBool && pred.numel() == 1,
              "xmod graph IF node: pred must be a one-element bool CUDA tensor, got ", pred.scalar_type(),
              " with ", pred.numel(), " elements on ", pred.device());
  TORCH_CHECK(!record_stream_reuse(), "xmod graph IF node: the allocator option graph_capture_record_stream_reuse "
              "is on (PYTORCH_CUDA_ALLOC_CONF); a node's allocations cannot be switched to its body under it; "
              "turn it off, or decode without CUDA graphs (graphed=False)");
  const c10::cuda::CUDAGuard guard(pred.device());
  const auto device = pred.get_device();
  const c10::MempoolId_t pool{pool_first, pool_second};
  auto outer = c10::cuda::getCurrentCUDAStream(device);
  cudaGraph_t body;
  unsigned long long outer_id = 0, body_id = 0;
  check(xmod_graph::add_if_node(outer.stream(), pred.data_ptr<bool>(), &body, &outer_id),
        "adding the node to the current stream's capture (is a CUDA graph being captured on it?)");
  cudaStream_t body_stream = take_stream(device);
  const cudaError_t began = xmod_graph::begin_capture_to_graph(body_stream, body, &body_id);
  if (began != cudaSuccess) {
    give_stream(device, body_stream);
    check(began, "capturing into the body");
  }
  try {
    allocate_to_pool_for(device, pool, body_id);
  } catch (...) {  // e.g. the pool is not the one being captured: end the body's capture, nothing left open
    cudaGraph_t unused;
    if (cudaStreamEndCapture(body_stream, &unused) == cudaSuccess) give_stream(device, body_stream);
    (void)cudaGetLastError();
    throw;
  }
  open_nodes.push_back({outer, body_stream, outer_id, pool});
  c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromExternal(body_stream, device));
}

void end_capture_to_conditional_node() {
  TORCH_CHECK(!open_nodes.empty(), "xmod graph IF node: no node is open on this thread");
  const OpenIfNode node = open_nodes.back();
  open_nodes.pop_back();
  const auto device = node.outer.device_index();
  const c10::cuda::CUDAGuard guard(device);
  cudaGraph_t body;
  const cudaError_t ended = cudaStreamEndCapture(node.body_stream, &body);
  // the outer capture's stream and its allocation pool go back whatever the capture did; the body's stream
  // goes back to the free list only when its capture ended (a stream still capturing is never reused)
  c10::cuda::setCurrentCUDAStream(node.outer);
  if (ended == cudaSuccess) give_stream(device, node.body_stream);
  allocate_to_pool_for(device, node.pool, node.outer_id);
  check(ended, "ending the body's capture");
}

int pool_use_count(int64_t device, uint64_t pool_first, uint64_t pool_second) {
  return allocator::getPoolUseCount(static_cast<c10::DeviceIndex>(device), {pool_first, pool_second});
}

}  // namespace

void register_graph_if_node(pybind11::module_& m) {
  m.def("if_nodes_built", &xmod_graph::if_nodes_built,
        "whether this build opens CUDA-graph IF nodes (CUDA >= 12.4 runtime headers)");
  m.def("begin_capture_to_if_node", &begin_capture_to_if_node,
        "in the CUDA graph being captured on the current stream into the memory pool (pool_first, pool_second), "
        "open an IF node on the device bool pred: what follows is captured into its body until "
        "end_capture_to_conditional_node",
        py::arg("pred"), py::arg("pool_first"), py::arg("pool_second"));
  m.def("end_capture_to_conditional_node", &end_capture_to_conditional_node,
        "close the innermost IF node opened on this thread; the capture goes on after it");
  m.def("pool_use_count", &pool_use_count, "the caching allocator's use count of a graph memory pool (tests)",
        py::arg("device"), py::arg("pool_first"), py::arg("pool_second"));
}
