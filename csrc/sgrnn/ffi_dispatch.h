// What every handler does around its kernels: map C++ exceptions to FFI errors, run a typed
// body for the buffers' element type, and read optional buffers.
#ifndef JAX_SGRNN_FFI_DISPATCH_H_
#define JAX_SGRNN_FFI_DISPATCH_H_

#include <exception>
#include <new>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace sgrnn {

namespace ffi = ::xla::ffi;

// Every error a handler returns starts with the package's name, so that a user reading it in a
// JAX traceback knows where it came from. The codes are XLA's: kInvalidArgument for input the
// schema refuses, kInternal for a failure of ours or of the device.
inline ffi::Error Failure(ffi::ErrorCode code, const std::string& what) {
  return ffi::Error(code, "jax_sgrnn: " + what);
}
inline ffi::Error InvalidArgument(const std::string& what) {
  return Failure(ffi::ErrorCode::kInvalidArgument, what);
}

// Runs body(), which returns an ffi::Error; an exception becomes an FFI error instead of
// unwinding into XLA (which would end the process).
template <typename F>
ffi::Error GuardExceptions(F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return Failure(ffi::ErrorCode::kResourceExhausted, "out of memory");
  } catch (const std::exception& e) {
    return Failure(ffi::ErrorCode::kInternal, e.what());
  }
}

// The C++ type of each float element type a handler may take.
template <ffi::DataType kType>
struct FloatOf;
template <>
struct FloatOf<ffi::DataType::F32> {
  using type = float;
  static constexpr const char* kName = "float32";
};
template <>
struct FloatOf<ffi::DataType::F64> {
  using type = double;
  static constexpr const char* kName = "float64";
};

// Runs `body.template operator()<T>()` for `dtype` if it is one of kTypes, else returns an
// error naming the handler (`who`) and what it takes: the lowering widens or hands off the
// other dtypes (jax_sgrnn/_backends.py), so reaching that error is a bug, not a crash.
template <ffi::DataType... kTypes, typename F>
ffi::Error DispatchFloat(ffi::DataType dtype, const char* who, F&& body) {
  return GuardExceptions([&]() -> ffi::Error {
    bool ran = false;
    ((dtype == kTypes ? (body.template operator()<typename FloatOf<kTypes>::type>(), ran = true)
                      : false),
     ...);
    if (ran) return ffi::Error::Success();
    std::string takes;
    ((takes += (takes.empty() ? "" : " or ") + std::string(FloatOf<kTypes>::kName)), ...);
    return InvalidArgument(std::string("the ") + who + " handler takes " + takes);
  });
}

// A buffer's data as T, or null for an absent operand (its [0] placeholder is never read).
template <typename T>
const T* DataOrNull(bool present, const ffi::AnyBuffer& b) {
  return present ? reinterpret_cast<const T*>(b.untyped_data()) : nullptr;
}
template <typename T>
T* MutableOrNull(bool present, ffi::AnyBuffer b) {
  return present ? reinterpret_cast<T*>(b.untyped_data()) : nullptr;
}

}  // namespace sgrnn

#endif  // JAX_SGRNN_FFI_DISPATCH_H_
