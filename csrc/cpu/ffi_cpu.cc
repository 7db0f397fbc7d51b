// The native XLA FFI handlers for the CPU platform (module.cc exports them to Python).
// Each handler validates its buffers (ffi_schema.cc), then runs the kernels of kernels.cc.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <thread>

#include "cpu/kernels.h"
#include "sgrnn/ffi_dispatch.h"
#include "sgrnn/ffi_schema.h"
#include "sgrnn/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace sgrnn::cpu {
namespace {

namespace ffi = ::xla::ffi;
constexpr ffi::DataType kF32 = ffi::DataType::F32, kF64 = ffi::DataType::F64;

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

ffi::Error ForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer W, ffi::AnyBuffer b,
                       ffi::AnyBuffer h0, ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths,
                       Config c, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z,
                       ffi::ThreadPool pool) {
  const ForwardBuffers buffers{x, R, W, b, h0, mask, seq_lengths, *y, *z};
  CheckedDims checked;
  if (ffi::Error status = CheckForward(c, buffers, &checked); status.failure()) return status;
  const XlaPoolExecutor executor(pool);
  return DispatchFloat<kF32, kF64>(x.element_type(), "CPU", [&]<typename T>() {
    Forward<T>(executor, c, checked.dims, TypedOperands<T>(c, buffers, checked));
  });
}

ffi::Error GradientsImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer dy, ffi::AnyBuffer z,
                         ffi::AnyBuffer W, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                         ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths, Config c,
                         ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> dR, ffi::Result<ffi::AnyBuffer> dW,
                         ffi::Result<ffi::AnyBuffer> db, ffi::Result<ffi::AnyBuffer> dh0,
                         ffi::ThreadPool pool) {
  const GradientBuffers buffers{x, R, dy, z, W, b, h0, mask, seq_lengths, *dx, *dR, *dW, *db, *dh0};
  CheckedDims checked;
  if (ffi::Error status = CheckGradients(c, buffers, &checked); status.failure()) return status;
  const XlaPoolExecutor executor(pool);
  return DispatchFloat<kF32, kF64>(x.element_type(), "CPU", [&]<typename T>() {
    for (int64_t g = 0; g < checked.G; ++g) {
      Gradients<T>(executor, c, checked.dims, TypedOperands<T>(c, buffers, checked, g));
    }
  });
}

}  // namespace

}  // namespace sgrnn::cpu

namespace sgrnn {

XLA_FFI_DEFINE_HANDLER_SYMBOL(NativeForward, cpu::ForwardImpl,
                              BindForward().Ctx<ffi::ThreadPool>());  // XLA's intra-op pool
XLA_FFI_DEFINE_HANDLER_SYMBOL(NativeGradients, cpu::GradientsImpl,
                              BindGradients().Ctx<ffi::ThreadPool>());

}  // namespace sgrnn
