// A compiled graph's inputs, dropped without the GIL (kernels/native_ops.py hold_refs; used by
// workers/compiled/cache.py CallOptions.call around every compiled CPU step).
//
// torch keeps a tensor's Python object alive while C++ holds references to the tensor besides
// the Python object's own, so the step from two C++ references to one decrefs the Python object,
// which takes the GIL. A cpp_wrapper graph (inductor) runs with the GIL released, gets its inputs
// as C++ handles and drops each after its last use: an input nothing else in C++ refers to takes
// the GIL there, and waits while any other thread of the process runs Python (a serving replica's
// scheduler and event loop: the forward then waits for their Python instead of running beside it).
// TensorRefs is one more C++ reference to each input for the length of the call: the graph's
// drops then go from three references to two, and the last step happens when Python drops the
// TensorRefs, with the GIL held.
#include <torch/custom_class.h>

#include "native_common.h"

namespace {

struct TensorRefs : torch::CustomClassHolder {
  explicit TensorRefs(std::vector<at::Tensor> tensors) : tensors(std::move(tensors)) {}
  int64_t size() const { return static_cast<int64_t>(tensors.size()); }
  std::vector<at::Tensor> tensors;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybridserve_native, m) {
  m.class_<TensorRefs>("TensorRefs")
      .def(torch::init<std::vector<at::Tensor>>())
      .def("size", &TensorRefs::size);
}
