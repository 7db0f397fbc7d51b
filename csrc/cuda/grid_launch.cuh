// The grid kernels on the GPU (grid_steps.h: the step loop; recurrence_plan.h: PlanGrid):
// grid_steps.h's machine interface for the GPU, the kernels over any such machine, and their
// launch, one cooperative launch a direction. grid_recurrence.cu instantiates them with
// GpuMachine; benchmarks/probe_grid_step.cu with machines that leave parts of a step out.
#ifndef JAX_SGRNN_CUDA_GRID_LAUNCH_CUH_
#define JAX_SGRNN_CUDA_GRID_LAUNCH_CUH_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/grid_steps.h"

namespace sgrnn::cuda {

struct GpuMachine {
  static __device__ void Sync() { __syncthreads(); }
  static __device__ unsigned SharedAddress(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
  }
  // Through L2 only (.cg): the state was written by other SMs, whose stores L1 does not see.
  static __device__ void CopyAsync16(float* to, const float* from) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(SharedAddress(to)), "l"(from)
                 : "memory");
  }
  // The chunk ring's mbarriers (grid_steps.h's StepProducts), in the block's shared memory.
  static __device__ void InitBarrier(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(SharedAddress(bar)), "r"(count)
                 : "memory");
  }
  // .noinc: the arrival is one of the `count` the phase expects (one a thread).
  static __device__ void ArriveOnCopies(uint64_t* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(SharedAddress(bar))
                 : "memory");
  }
  // Every thread arrives after its own reads: one lane a warp arriving after `__syncwarp`
  // does not order the other lanes' reads before the arrival (racecheck saw the buffer's next
  // copies overlap them).
  static __device__ void Release(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared.b64 _, [%0];\n" ::"r"(SharedAddress(bar)) : "memory");
  }
  static __device__ void WaitPhase(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(SharedAddress(bar)),
        "r"(parity)
        : "memory");
  }
  // Cooperative groups' grid barrier, for one counter: the fence orders the block's stores,
  // which the barrier before made visible to this thread, before the count.
  static __device__ void Arrive(uint32_t* counter) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
  static __device__ void WaitFor(uint32_t* counter, uint32_t value) {
    uint32_t seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
    } while (seen < value);
    __threadfence();
  }
  // The tensor-core tiles' products (grid_steps.h): the operands split as they arrive, then
  // each tile's three products, the small ones first (so that they meet the accumulator
  // before the large one).
  template <int MT, int NT>
  static __device__ void WarpMultiplyAdd(float (&acc)[MT][NT][4], const float (&a)[MT][4],
                                         const float (&b)[NT][2]) {
    Tf32Split x[MT][4], y[NT][2];
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) x[m][i] = SplitTf32(a[m][i]);
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int i = 0; i < 2; ++i) y[n][i] = SplitTf32(b[n][i]);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        Mma(acc[m][n], {x[m][0].small, x[m][1].small, x[m][2].small, x[m][3].small},
            {y[n][0].big, y[n][1].big});
        Mma(acc[m][n], {x[m][0].big, x[m][1].big, x[m][2].big, x[m][3].big},
            {y[n][0].small, y[n][1].small});
        Mma(acc[m][n], {x[m][0].big, x[m][1].big, x[m][2].big, x[m][3].big},
            {y[n][0].big, y[n][1].big});
      }
    }
  }
  // d += A B for one m16n8k8 tile; the tensor cores read each operand's top 19 bits (tf32).
  static __device__ void Mma(float (&d)[4], const Float4& a, const Float2& b) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(BitsOf(a.v[0])), "r"(BitsOf(a.v[1])), "r"(BitsOf(a.v[2])), "r"(BitsOf(a.v[3])),
          "r"(BitsOf(b.x)), "r"(BitsOf(b.y)));
  }
};

template <Activation A, typename Tile, typename Machine>
__global__ void __launch_bounds__(kGridThreads, 1)
    GridForwardKernel(Config c, GridGeometry g, ForwardArgs<float> a, float* states,
                      uint32_t* counters) {
  extern __shared__ __align__(16) float grid_shared[];
  GridForwardSteps<A, Tile, Machine>(c, g, a, states, counters, blockIdx.x, threadIdx.x,
                                     grid_shared);
}

template <Activation A, typename Tile, typename Machine>
__global__ void __launch_bounds__(kGridThreads, 1)
    GridGradientKernel(Config c, GridGeometry g, GradientArgs<float> a, float* states,
                       uint32_t* counters) {
  extern __shared__ __align__(16) float grid_shared[];
  GridGradientSteps<A, Tile, Machine>(c, g, a, states, counters, blockIdx.x, threadIdx.x,
                                      grid_shared);
}

// One launch a direction, after the workspace is zeroed. Cooperative: the launch fails rather
// than start blocks that could not all be resident at once, since a block that waits for one
// that never starts would wait forever.
template <typename Args, typename Kernel>
cudaError_t LaunchDirections(Kernel kernel, const Config& c, const Dims& d, const GridPlan& plan,
                             const Args& args, void* workspace, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(workspace, 0, plan.WorkspaceBytes(d.D), stream);
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(plan.shared_bytes));
  }
  const GridWorkspace w(workspace, plan, d.D);
  for (int direction = 0; err == cudaSuccess && direction < d.D; ++direction) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(static_cast<unsigned>(plan.blocks()), 1, 1);
    config.blockDim = dim3(static_cast<unsigned>(kGridThreads), 1, 1);
    config.dynamicSmemBytes = static_cast<size_t>(plan.shared_bytes);
    config.stream = stream;
    cudaLaunchAttribute cooperative;
    cooperative.id = cudaLaunchAttributeCooperative;
    cooperative.val.cooperative = 1;
    config.attrs = &cooperative;
    config.numAttrs = 1;
    err = cudaLaunchKernelEx(&config, kernel, c, GridGeometryOf(d, plan, direction), args,
                             w.states, w.CountersOf(plan, direction));
    if (err == cudaSuccess) err = cudaGetLastError();
  }
  return err;
}

}  // namespace sgrnn::cuda

#endif  // JAX_SGRNN_CUDA_GRID_LAUNCH_CUH_
