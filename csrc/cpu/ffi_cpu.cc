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
  CheckedDims checked;
  ffi::Error status = CheckForward(c, x, R, W, b, h0, mask, seq_lengths, *y, *z, &checked);
  if (status.failure()) return status;
  const XlaPoolExecutor executor(pool);
  return DispatchFloat<kF32, kF64>(x.element_type(), "CPU", [&]<typename T>() {
    const int64_t* ms = checked.mask_shape;
    Forward<T>(executor, c, checked.dims,
               ForwardArgs<T>{
                   .x = DataOrNull<T>(true, x),
                   .R = DataOrNull<T>(true, R),
                   .W = DataOrNull<T>(c.has_input_weight, W),
                   .b = DataOrNull<T>(c.has_bias, b),
                   .h0 = DataOrNull<T>(c.has_init_state, h0),
                   .mask = c.has_mask ? MaskView<T>(DataOrNull<T>(true, mask), ms[1], ms[2], ms[3])
                                      : MaskView<T>(),
                   .seq_lengths = DataOrNull<int32_t>(c.has_seq_lengths, seq_lengths),
                   .y = MutableOrNull<T>(true, *y),
                   .z = MutableOrNull<T>(c.training, *z)});
  });
}

ffi::Error GradientsImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer dy, ffi::AnyBuffer z,
                         ffi::AnyBuffer W, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                         ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths, Config c,
                         ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> dR, ffi::Result<ffi::AnyBuffer> dW,
                         ffi::Result<ffi::AnyBuffer> db, ffi::Result<ffi::AnyBuffer> dh0,
                         ffi::ThreadPool pool) {
  CheckedDims checked;
  ffi::Error status =
      CheckGradients(c, x, R, dy, z, W, b, h0, mask, seq_lengths, *dx, *dR, *dW, *db, *dh0,
                     &checked);
  if (status.failure()) return status;
  const XlaPoolExecutor executor(pool);
  return DispatchFloat<kF32, kF64>(x.element_type(), "CPU", [&]<typename T>() {
    const Dims& d = checked.dims;
    const int64_t* ms = checked.mask_shape;
    for (int64_t g = 0; g < checked.G; ++g) {
      const GroupOffsets o = checked.Group(g);
      Gradients<T>(executor, c, d,
                   GradientArgs<T>{
                       .x = DataOrNull<T>(true, x) + o.source,
                       .R = DataOrNull<T>(true, R),
                       .dy = DataOrNull<T>(true, dy) + o.state,
                       .z = DataOrNull<T>(true, z) + o.state,
                       .W = DataOrNull<T>(c.has_input_weight, W),
                       .h0 = c.has_init_state ? DataOrNull<T>(true, h0) + o.init_state : nullptr,
                       .mask = c.has_mask ? MaskView<T>(DataOrNull<T>(true, mask) + o.mask,
                                                        ms[1], ms[2], ms[3])
                                          : MaskView<T>(),
                       .seq_lengths = c.has_seq_lengths
                                          ? DataOrNull<int32_t>(true, seq_lengths) + o.seq_lengths
                                          : nullptr,
                       .dx = MutableOrNull<T>(true, *dx) + o.source,
                       .dR = MutableOrNull<T>(true, *dR) + o.d_recurrent_weight,
                       .dW = c.has_input_weight ? MutableOrNull<T>(true, *dW) + o.d_input_weight
                                                : nullptr,
                       .db = c.has_bias ? MutableOrNull<T>(true, *db) + o.d_bias : nullptr,
                       .dh0 = c.has_init_state ? MutableOrNull<T>(true, *dh0) + o.init_state
                                               : nullptr});
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
