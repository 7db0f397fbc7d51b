// The CBLAS the CPU kernels call: Apple's Accelerate on macOS (tuned for Apple's cores and
// always present there), elsewhere OpenBLAS from the scipy-openblas32 wheel (a build made to
// be linked by Python extensions: prefixed symbols, run-time CPU dispatch). Both run on one
// thread: the kernels split work over XLA's own pool.
#ifndef JAX_SGRNN_CPU_BLAS_H_
#define JAX_SGRNN_CPU_BLAS_H_

#if defined(__APPLE__)
#define ACCELERATE_NEW_LAPACK
#include <Accelerate/Accelerate.h>
#define SGRNN_CBLAS(name) cblas_##name
#else
#include "cblas.h"  // scipy-openblas32: symbols carry a scipy_ prefix
#define SGRNN_CBLAS(name) scipy_cblas_##name
#endif

namespace sgrnn::cpu {

// Once per process, from the module's import.
inline void MakeBlasSingleThreaded() {
#if !defined(__APPLE__)
  scipy_openblas_set_num_threads(1);
#endif
}

}  // namespace sgrnn::cpu

// Before a thread's first BLAS call. Accelerate's threading model is per thread (macOS 15 and
// later; before that only VECLIB_MAXIMUM_THREADS=1 sets it). A macro, not an inline function,
// so that each instruction-set build of kernels.cc expands its own copy (kernels.h).
#if defined(__APPLE__) && defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && \
    __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
#define SGRNN_BLAS_THREAD_SETUP()                                                             \
  do {                                                                                        \
    if (__builtin_available(macOS 15.0, *)) {                                                 \
      static thread_local const int single = BLASSetThreading(BLAS_THREADING_SINGLE_THREADED); \
      (void)single;                                                                           \
    }                                                                                         \
  } while (0)
#else
#define SGRNN_BLAS_THREAD_SETUP() \
  do {                            \
  } while (0)
#endif

#endif  // JAX_SGRNN_CPU_BLAS_H_
