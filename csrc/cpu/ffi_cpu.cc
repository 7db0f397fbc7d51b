// XLA FFI handlers for the CPU platform and the Python module that exports them.
// Each handler validates its buffers (ffi_schema.cc), then runs the kernels of kernels.cc.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <thread>

#include "cblas.h"
#include "cpu/kernels.h"
#include "pybind11/pybind11.h"
#include "sgrnn/ffi_schema.h"
#include "xla/ffi/api/ffi.h"

namespace sgrnn::cpu {
namespace {

namespace ffi = ::xla::ffi;

// Items of one ForEach, claimed by whichever threads get to them first. The calling thread
// claims too, so it never waits on a pool thread that has not started (a busy machine may
// start it late; by then it finds nothing left and returns).
class SharedWork {
 public:
  SharedWork(int64_t n, const std::function<void(int64_t)>* body) : n_(n), body_(body) {}

  void Run() {
    for (int64_t i; (i = next_.fetch_add(1, std::memory_order_relaxed)) < n_;) {
      (*body_)(i);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  // Returns once every claimed item has finished (the caller's Run() left none unclaimed).
  void Wait() const {
    while (done_.load(std::memory_order_acquire) < n_) std::this_thread::yield();
  }

 private:
  const int64_t n_;
  const std::function<void(int64_t)>* body_;  // only dereferenced for claimed items
  std::atomic<int64_t> next_{0}, done_{0};
};

// The kernels' Executor on XLA's intra-op thread pool.
class XlaPoolExecutor final : public Executor {
 public:
  explicit XlaPoolExecutor(ffi::ThreadPool pool)
      : pool_(pool), width_(std::max<int64_t>(1, pool.num_threads())) {}

  int64_t width() const override { return width_; }

  void ForEach(int64_t n, const std::function<void(int64_t)>& body) const override {
    if (n <= 1 || width_ <= 1) {
      for (int64_t i = 0; i < n; ++i) body(i);
      return;
    }
    auto work = std::make_shared<SharedWork>(n, &body);
    for (int64_t t = 1; t < std::min(width_, n); ++t) pool_.Schedule([work] { work->Run(); });
    work->Run();
    work->Wait();
  }

 private:
  mutable ffi::ThreadPool pool_;
  int64_t width_;
};

template <typename T>
const T* DataOrNull(bool present, const ffi::AnyBuffer& b) {
  return present ? reinterpret_cast<const T*>(b.untyped_data()) : nullptr;
}
template <typename T>
T* MutableOrNull(bool present, ffi::AnyBuffer b) {
  return present ? reinterpret_cast<T*>(b.untyped_data()) : nullptr;
}

// Runs `body.template operator()<T>()` for the buffer's float type; half types are widened to
// float32 in Python before they get here.
template <typename F>
ffi::Error DispatchFloat(ffi::DataType dtype, F&& body) {
  try {
    switch (dtype) {
      case ffi::DataType::F32: body.template operator()<float>(); break;
      case ffi::DataType::F64: body.template operator()<double>(); break;
      default:
        return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                          "jax_sgrnn: the CPU handler takes float32 or float64");
    }
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, "jax_sgrnn: out of memory");
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_sgrnn: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer W, ffi::AnyBuffer b,
                       ffi::AnyBuffer h0, ffi::AnyBuffer mask, Config c,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z,
                       ffi::ThreadPool pool) {
  CheckedDims checked;
  ffi::Error status = CheckForward(c, x, R, W, b, h0, mask, *y, *z, &checked);
  if (status.failure()) return status;
  const XlaPoolExecutor executor(pool);
  return DispatchFloat(x.element_type(), [&]<typename T>() {
    const int64_t* ms = checked.mask_shape;
    Forward<T>(executor, c, checked.dims,
               ForwardArgs<T>{
                   DataOrNull<T>(true, x), DataOrNull<T>(true, R),
                   DataOrNull<T>(c.has_input_weight, W), DataOrNull<T>(c.has_bias, b),
                   DataOrNull<T>(c.has_init_state, h0),
                   c.has_mask ? MaskView<T>(DataOrNull<T>(true, mask), ms[1], ms[2], ms[3])
                              : MaskView<T>(),
                   MutableOrNull<T>(true, *y), MutableOrNull<T>(c.training, *z)});
  });
}

ffi::Error GradientsImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer dy, ffi::AnyBuffer z,
                         ffi::AnyBuffer W, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                         ffi::AnyBuffer mask, Config c, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> dR, ffi::Result<ffi::AnyBuffer> dW,
                         ffi::Result<ffi::AnyBuffer> db, ffi::Result<ffi::AnyBuffer> dh0,
                         ffi::ThreadPool pool) {
  CheckedDims checked;
  ffi::Error status =
      CheckGradients(c, x, R, dy, z, W, b, h0, mask, *dx, *dR, *dW, *db, *dh0, &checked);
  if (status.failure()) return status;
  const XlaPoolExecutor executor(pool);
  return DispatchFloat(x.element_type(), [&]<typename T>() {
    const Dims& d = checked.dims;
    const int64_t* ms = checked.mask_shape;
    const int64_t state = d.rows() * d.DH(), mask_group = ms[0] == 1 ? 0 : ms[1] * ms[2] * ms[3];
    // The G problems share the weights; each gets its own weight gradients.
    for (int64_t g = 0; g < checked.G; ++g) {
      GradientArgs<T> a{
          DataOrNull<T>(true, x) + g * d.rows() * d.I,
          DataOrNull<T>(true, R),
          DataOrNull<T>(true, dy) + g * state,
          DataOrNull<T>(true, z) + g * state,
          DataOrNull<T>(c.has_input_weight, W),
          c.has_init_state ? DataOrNull<T>(true, h0) + g * d.N * d.DH() : nullptr,
          c.has_mask ? MaskView<T>(DataOrNull<T>(true, mask) + g * mask_group, ms[1], ms[2],
                                   ms[3])
                     : MaskView<T>(),
          MutableOrNull<T>(true, *dx) + g * d.rows() * d.I,
          MutableOrNull<T>(true, *dR) + g * d.D * d.H * d.H,
          c.has_input_weight ? MutableOrNull<T>(true, *dW) + g * d.DH() * d.I : nullptr,
          c.has_bias ? MutableOrNull<T>(true, *db) + g * d.DH() : nullptr,
          c.has_init_state ? MutableOrNull<T>(true, *dh0) + g * d.N * d.DH() : nullptr};
      Gradients<T>(executor, c, d, a);
    }
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SgrnnForwardCpu, ForwardImpl,
                              BindForward().Ctx<ffi::ThreadPool>());  // XLA's intra-op pool
XLA_FFI_DEFINE_HANDLER_SYMBOL(SgrnnGradientsCpu, GradientsImpl,
                              BindGradients().Ctx<ffi::ThreadPool>());

}  // namespace sgrnn::cpu

namespace py = pybind11;

PYBIND11_MODULE(_sgrnn_cpu, m) {
  m.doc() = "jax_sgrnn's XLA FFI handlers for the CPU platform";
  // Parallel work goes through XLA's thread pool (XlaPoolExecutor); a second pool inside
  // OpenBLAS would oversubscribe the cores. This OpenBLAS copy is private to jax_sgrnn.
  scipy_openblas_set_num_threads(1);
  m.def("selected_isa", &sgrnn::cpu::SelectedIsa,
        "The instruction-set build of the CPU kernels in use (SGRNN_CPU_ISA overrides).");
  m.def("registrations", []() {
    py::dict targets;
    targets["jax_sgrnn_forward"] =
        py::capsule(reinterpret_cast<void*>(sgrnn::cpu::SgrnnForwardCpu));
    targets["jax_sgrnn_gradients"] =
        py::capsule(reinterpret_cast<void*>(sgrnn::cpu::SgrnnGradientsCpu));
    return targets;
  });
}
