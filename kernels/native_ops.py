"""C++ kernels for the ops compiled CPU steps call outside inductor's own code.

A compiled CPU step (inductor with its C++ wrapper) runs without the GIL, except where it
calls an op inductor cannot generate: the in-place pool write ``hybridserve::scatter_rows``
(``kernels/static.py``; 16 calls a step on bench-15m) and, in batches where the static MoE
is not the cheaper, the expert loop ``hybridserve::moe_experts``
(``workers/models/moe_experts.py``; one call per MoE layer, ~10 ops per chosen expert). Their
kernels are Python, so each call takes the GIL back and runs the interpreter (~20 us a
write, hundreds of us a loop), and waits for the GIL whenever another thread holds it -- the
scheduler thread under ``scheduler.overlap``, or a replica's Ray and event-loop threads --
for up to the interpreter's switch interval (5 ms).

``load()`` builds (once per machine: the build is cached under torch's extension directory,
``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``, keyed by the torch version and
the source; concurrent builders wait on the build's lock) and loads ``hybridserve_native::scatter_rows`` and
``hybridserve_native::moe_experts``: the same computations as C++ kernels, op for op (the
same ATen kernels in the same order, so the same numerics), with the same schemas, and
registers their fakes. Compiled CPU steps trace with them when they loaded; when they cannot
be built (no compiler, no ninja) they trace with the Python ops, as before, and the reason
is logged once.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from kernels import cpu_linear

logger = logging.getLogger(__name__)

NAME = "hybridserve_native"
SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

// dst[index] = src along dim 0, in place (the rows of a state pool).
void scatter_rows(at::Tensor dst, const at::Tensor& index, const at::Tensor& src) {
  dst.index_copy_(0, index, src);
}

// The activations of workers/models/layers.py ACTIVATIONS, by HF name.
at::Tensor activate(const at::Tensor& x, const std::string& act) {
  if (act == "silu" || act == "swish") return at::silu(x);
  if (act == "gelu") return at::gelu(x);
  if (act == "gelu_pytorch_tanh") return at::gelu(x, "tanh");
  if (act == "relu") return at::relu(x);
  if (act == "relu2") return at::square(at::relu(x));
  TORCH_CHECK(false, "moe_experts: activation ", act, " is not supported");
}

// kernels/cpu_linear.py linear (no bias, no autograd, never traced here): oneDNN from
// MIN_ROWS rows and MIN_MACS multiply-adds in fp32 where the build has it, else at::linear.
at::Tensor dense(const at::Tensor& x, const at::Tensor& w) {
  static const std::optional<c10::OperatorHandle> onednn =
      at::hasMKLDNN() ? c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""})
                      : std::nullopt;
  const int64_t rows = x.size(-1) > 0 ? x.numel() / x.size(-1) : 0;
  if (onednn.has_value() && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
      w.is_contiguous() && w.dim() == 2 && rows >= @MIN_ROWS@ &&
      rows * w.size(1) * w.size(0) >= @MIN_MACS@) {
    torch::jit::Stack stack{x, w, c10::IValue(), std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::string("")};
    onednn->callBoxed(&stack);
    return stack[0].toTensor();
  }
  return at::linear(x, w);
}

// workers/models/moe_experts.py expert_loop, op for op (the same kernels, the same order).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids,
                       const std::optional<at::Tensor>& w_gate, const at::Tensor& w_up,
                       const at::Tensor& w_down, std::string act) {
  const int64_t k = ids.size(1);
  at::Tensor flat_ids = ids.reshape({-1});
  at::Tensor order = at::argsort(flat_ids, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  at::Tensor counts = at::bincount(flat_ids, {}, w_up.size(0)).contiguous();
  const int64_t* n_rows = counts.data_ptr<int64_t>();
  at::Tensor flat_weights = weights.reshape({-1});
  at::Tensor out = at::zeros({x.size(0), w_down.size(1)}, x.options());
  int64_t start = 0;
  for (int64_t e = 0; e < counts.size(0); ++e) {
    const int64_t n = n_rows[e];
    if (n == 0) continue;
    at::Tensor rows = order.slice(0, start, start + n);
    start += n;
    at::Tensor tokens = at::div(rows, k, "floor");
    at::Tensor h = at::index(x, {tokens});
    at::Tensor up = dense(h, w_up.select(0, e));
    at::Tensor inner = w_gate.has_value()
        ? activate(dense(h, w_gate->select(0, e)), act) * up : activate(up, act);
    at::Tensor y = dense(inner, w_down.select(0, e));
    at::Tensor acc = at::index(out, {tokens});
    acc.add_(y * at::index(flat_weights, {rows}).unsqueeze(1));
    out.index_put_({tokens}, acc);
  }
  return out;
}

TORCH_LIBRARY(hybridserve_native, m) {
  m.def("scatter_rows(Tensor(a!) dst, Tensor index, Tensor src) -> ()");
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor? w_gate, Tensor w_up, "
        "Tensor w_down, str act) -> Tensor");
}

TORCH_LIBRARY_IMPL(hybridserve_native, CPU, m) {
  m.impl("scatter_rows", &scatter_rows);
  m.impl("moe_experts", &moe_experts);
}
"""

SOURCE = SOURCE.replace("@MIN_ROWS@", str(cpu_linear.MIN_ROWS)).replace("@MIN_MACS@", str(cpu_linear.MIN_MACS))

_lock = threading.Lock()
_state: dict[str, object] = {}       # "loaded": bool, once load() ran; "error": str


def build_dir() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(base) / f"{NAME}-torch{torch.__version__.replace('+', '_')}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load() -> bool:
    """Build and load the native ops (at most once per process); True when they are usable."""
    with _lock:
        if "loaded" not in _state:
            _state["loaded"] = _build()
        return bool(_state["loaded"])


def loaded() -> bool:
    """Whether ``load()`` ran and the native ops are usable (what tracing reads)."""
    return bool(_state.get("loaded"))


def failure() -> str | None:
    """Why the native ops could not be built, if ``load()`` failed."""
    error = _state.get("error")
    return None if error is None else str(error)


def _build() -> bool:
    try:
        from torch.utils.cpp_extension import load_inline

        load_inline(NAME, cpp_sources=SOURCE, is_python_module=False, build_directory=str(build_dir()),
                    extra_cflags=["-O2"], verbose=False)
    except Exception as exc:          # no compiler / ninja / headers: the Python op stays
        _state["error"] = f"{type(exc).__name__}: {exc}"
        logger.warning("compiled CPU steps keep the Python pool-write and expert-loop ops (each "
                       "call takes the GIL): the native ops did not build: %s", _state["error"])
        return False
    torch.library.register_fake(f"{NAME}::scatter_rows")(_scatter_rows_fake)
    torch.library.register_fake(f"{NAME}::moe_experts")(_moe_experts_fake)
    return True


def _scatter_rows_fake(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    return None


def _moe_experts_fake(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate: torch.Tensor | None,
                      w_up: torch.Tensor, w_down: torch.Tensor, act: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], w_down.shape[1])
