// Torch bindings for the routed-token permutation kernels: argument checks, allocation, stream.
// Autograd lives in Python (megatron_xmod/permute/cuda_ops.py) so all three backends share it.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "permute_kernels.h"

namespace {

using xmod_permute::DType;

DType dtype_of(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return DType::kFloat32;
    case torch::kFloat16: return DType::kFloat16;
    case torch::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "xmod permute (cuda): ", name, " must be float32, float16 or bfloat16, got ",
                  t.scalar_type());
  }
}

void check_cuda(const torch::Tensor& t, const char* name, const torch::Tensor& like) {
  TORCH_CHECK(t.is_cuda(), "xmod permute (cuda): ", name, " must be a CUDA tensor, got device ",
              t.device(), " (the cuda backend only runs on GPU tensors)");
  TORCH_CHECK(t.device() == like.device(), "xmod permute (cuda): ", name, " is on ", t.device(),
              " but the other inputs are on ", like.device());
  TORCH_CHECK(t.is_contiguous(), "xmod permute (cuda): ", name, " must be contiguous");
}

void check_indices(const torch::Tensor& idx, const torch::Tensor& like) {
  check_cuda(idx, "indices", like);
  TORCH_CHECK(idx.scalar_type() == torch::kInt64, "xmod permute (cuda): indices must be int64, got ",
              idx.scalar_type());
  TORCH_CHECK(idx.dim() == 2, "xmod permute (cuda): indices must be [k, b], got ", idx.sizes());
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "xmod permute (cuda): ", what, " launch failed: ",
              cudaGetErrorString(err));
}

torch::Tensor gather(const torch::Tensor& x, const torch::Tensor& idx) {
  check_cuda(x, "x", x);
  check_indices(idx, x);
  TORCH_CHECK(x.dim() == 3, "xmod permute (cuda): x must be [s, b, h], got ", x.sizes());
  TORCH_CHECK(idx.size(1) == x.size(1), "xmod permute (cuda): indices has b=", idx.size(1),
              " but x has b=", x.size(1));
  const c10::cuda::CUDAGuard guard(x.device());
  auto out = torch::empty({idx.size(0), x.size(1), x.size(2)}, x.options());
  check_launch(xmod_permute::launch_gather(dtype_of(x, "x"), x.data_ptr(), idx.data_ptr<int64_t>(),
                                           out.data_ptr(), x.size(0), idx.size(0), x.size(1),
                                           x.size(2), c10::cuda::getCurrentCUDAStream()),
               "gather");
  return out;
}

// x and gate are optional (see launch_scatter_add_gated); s is explicit because x may be absent.
torch::Tensor scatter_add_gated(const c10::optional<torch::Tensor>& x, const torch::Tensor& y,
                                const c10::optional<torch::Tensor>& gate, const torch::Tensor& idx,
                                int64_t s) {
  check_cuda(y, "y", y);
  check_indices(idx, y);
  TORCH_CHECK(y.dim() == 3, "xmod permute (cuda): y must be [k, b, h], got ", y.sizes());
  TORCH_CHECK(idx.size(0) == y.size(0) && idx.size(1) == y.size(1),
              "xmod permute (cuda): indices ", idx.sizes(), " does not match y ", y.sizes());
  TORCH_CHECK(s >= 0, "xmod permute (cuda): s must be >= 0");
  const DType dt = dtype_of(y, "y");
  if (x.has_value()) {
    check_cuda(*x, "x", y);
    TORCH_CHECK(x->scalar_type() == y.scalar_type(), "xmod permute (cuda): x dtype ",
                x->scalar_type(), " != y dtype ", y.scalar_type());
    TORCH_CHECK(x->dim() == 3 && x->size(0) == s && x->size(1) == y.size(1) &&
                    x->size(2) == y.size(2),
                "xmod permute (cuda): x ", x->sizes(), " does not match [s, b, h] of y ", y.sizes());
  }
  if (gate.has_value()) {
    check_cuda(*gate, "gate", y);
    TORCH_CHECK(gate->scalar_type() == y.scalar_type(), "xmod permute (cuda): gate dtype ",
                gate->scalar_type(), " != y dtype ", y.scalar_type());
    TORCH_CHECK(gate->sizes() == idx.sizes(), "xmod permute (cuda): gate ", gate->sizes(),
                " must match indices ", idx.sizes());
  }
  const c10::cuda::CUDAGuard guard(y.device());
  auto out = torch::empty({s, y.size(1), y.size(2)}, y.options());
  check_launch(xmod_permute::launch_scatter_add_gated(
                   dt, x.has_value() ? x->data_ptr() : nullptr, y.data_ptr(),
                   gate.has_value() ? gate->data_ptr() : nullptr, idx.data_ptr<int64_t>(),
                   out.data_ptr(), s, idx.size(0), y.size(1), y.size(2),
                   c10::cuda::getCurrentCUDAStream()),
               "scatter_add_gated");
  return out;
}

std::vector<torch::Tensor> scatter_backward(const torch::Tensor& grad_out, const torch::Tensor& y,
                                            const torch::Tensor& gate, const torch::Tensor& idx,
                                            bool need_y, bool need_gate) {
  check_cuda(grad_out, "grad_out", y);
  check_cuda(y, "y", y);
  check_cuda(gate, "gate", y);
  check_indices(idx, y);
  const DType dt = dtype_of(y, "y");
  TORCH_CHECK(grad_out.scalar_type() == y.scalar_type() && gate.scalar_type() == y.scalar_type(),
              "xmod permute (cuda): grad_out/gate dtypes must equal y dtype ", y.scalar_type());
  TORCH_CHECK(grad_out.dim() == 3 && y.dim() == 3 && grad_out.size(1) == y.size(1) &&
                  grad_out.size(2) == y.size(2),
              "xmod permute (cuda): grad_out ", grad_out.sizes(), " does not match y ", y.sizes());
  TORCH_CHECK(gate.sizes() == idx.sizes() && idx.size(0) == y.size(0) && idx.size(1) == y.size(1),
              "xmod permute (cuda): gate ", gate.sizes(), " / indices ", idx.sizes(),
              " must be [k, b] of y ", y.sizes());
  const c10::cuda::CUDAGuard guard(y.device());
  torch::Tensor gy, gg;
  if (need_y) gy = torch::empty_like(y);
  // zeros, not empty: with h == 0 the kernel is skipped and the gradient is exactly zero.
  if (need_gate) gg = y.size(2) == 0 ? torch::zeros_like(gate) : torch::empty_like(gate);
  if (need_y || need_gate) {
    check_launch(xmod_permute::launch_scatter_backward(
                     dt, grad_out.data_ptr(), y.data_ptr(), gate.data_ptr(),
                     idx.data_ptr<int64_t>(), need_y ? gy.data_ptr() : nullptr,
                     need_gate ? gg.data_ptr() : nullptr, grad_out.size(0), idx.size(0), y.size(1),
                     y.size(2), c10::cuda::getCurrentCUDAStream()),
                 "scatter_backward");
  }
  return {gy, gg};
}

}  // namespace

void register_graph_if_node(pybind11::module_& m);  // graph_if_node_bindings.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron_xmod routed-token permutation kernels (sm_80 / sm_90), and CUDA-graph IF nodes for torch < 2.12";
  register_graph_if_node(m);
  m.def("gather", &gather, "out[k,b,h] = x[indices[k,b], b, :]", py::arg("x"), py::arg("indices"));
  m.def("scatter_add_gated", &scatter_add_gated, "[s,b,h] = x (or 0) + gate (or 1) * y at indices",
        py::arg("x"), py::arg("y"), py::arg("gate"), py::arg("indices"), py::arg("s"));
  m.def("scatter_backward", &scatter_backward, "(grad_y, grad_gate) of the gated scatter",
        py::arg("grad_out"), py::arg("y"), py::arg("gate"), py::arg("indices"), py::arg("need_y"),
        py::arg("need_gate"));
}
