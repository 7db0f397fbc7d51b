// The grid kernels' launches for the handler (recurrence.h): grid_launch.cuh's kernels on the
// GPU's machine, for the call's activation and the plan's tile.
#include "cuda/grid_launch.cuh"
#include "cuda/recurrence.h"

namespace sgrnn::cuda {

cudaError_t LaunchGridForward(const Config& c, const Dims& d, const GridPlan& plan,
                              const ForwardArgs<float>& args, void* workspace,
                              cudaStream_t stream) {
  if (d.T == 0 || d.N == 0) return cudaSuccess;
  cudaError_t err = cudaSuccess;
  DispatchActivation(c.activation, [&]<Activation A>() {
    err = DispatchGridTile(plan.tile, [&]<typename Tile>() {
      return LaunchDirections(GridForwardKernel<A, Tile, GpuMachine>, c, d, plan, args, workspace,
                              stream);
    });
  });
  return err;
}

cudaError_t LaunchGridGradients(const Config& c, const Dims& d, const GridPlan& plan,
                                const GradientArgs<float>& args, void* workspace,
                                cudaStream_t stream) {
  if (d.T == 0 || d.N == 0) {  // no steps: dh0 is zero
    return args.dh0 && d.N > 0 ? cudaMemsetAsync(args.dh0, 0, d.N * d.DH() * sizeof(float), stream)
                               : cudaSuccess;
  }
  cudaError_t err = cudaSuccess;
  DispatchActivation(c.activation, [&]<Activation A>() {
    err = DispatchGridTile(plan.tile, [&]<typename Tile>() {
      return LaunchDirections(GridGradientKernel<A, Tile, GpuMachine>, c, d, plan, args,
                              workspace, stream);
    });
  });
  return err;
}

}  // namespace sgrnn::cuda
