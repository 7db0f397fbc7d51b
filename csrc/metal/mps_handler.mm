// The MPSGraph backend: XLA FFI handlers, registered on XLA's cpu platform, that run MPSGraph's
// own singleGateRNN / singleGateRNNGradients on the Apple GPU. XLA's host buffers live in
// unified memory, so they are handed to Metal in place where possible (else through one staged
// copy), and a handler returns only once the GPU work has completed. Every decision that is not
// an Apple call lives in mps_plan.h; this file only talks to Metal and MPSGraph. ARC.
#ifdef SGRNN_APPLE_SDK_DECLS
#include "metal/apple_sdk_decls.h"  // the Linux compile check (scripts/check_metal_compile.sh)
#else
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#import <MetalPerformanceShaders/MetalPerformanceShaders.h>
#import <MetalPerformanceShadersGraph/MetalPerformanceShadersGraph.h>
#endif

#include <unistd.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

#include "metal/mps_device.h"
#include "metal/mps_plan.h"
#include "metal/self_check.h"
#include "sgrnn/ffi_dispatch.h"
#include "sgrnn/ffi_schema.h"
#include "sgrnn/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace sgrnn {
namespace {

using mps::Op;
using mps::Operand;

// mps_plan.h spells these numbers without Apple's or XLA's headers; here both are in sight.
static_assert(mps::kMpsFloat32 == MPSDataTypeFloat32 && mps::kMpsFloat16 == MPSDataTypeFloat16);
static_assert(mps::kFfiF32 == static_cast<int32_t>(ffi::DataType::F32) &&
              mps::kFfiF16 == static_cast<int32_t>(ffi::DataType::F16));
static_assert(MPSGraphRNNActivationNone == static_cast<NSUInteger>(Activation::kNone) &&
              MPSGraphRNNActivationRelu == static_cast<NSUInteger>(Activation::kRelu) &&
              MPSGraphRNNActivationTanh == static_cast<NSUInteger>(Activation::kTanh) &&
              MPSGraphRNNActivationSigmoid == static_cast<NSUInteger>(Activation::kSigmoid) &&
              MPSGraphRNNActivationHardSigmoid ==
                  static_cast<NSUInteger>(Activation::kHardSigmoid));

constexpr int kMaxOutputs = 5;  // the gradient op's dx, dR, dW, db, dh0

ffi::Error Fail(ffi::ErrorCode code, const std::string& what) {
  return Failure(code, "MPSGraph: " + what);
}

std::string Utf8(NSString* text) {
  const char* bytes = text ? text.UTF8String : nullptr;
  return bytes ? bytes : "";
}

MPSShape* ToShape(const std::vector<int64_t>& dims) {
  NSMutableArray<NSNumber*>* shape = [NSMutableArray arrayWithCapacity:dims.size()];
  for (int64_t v : dims) [shape addObject:[NSNumber numberWithLongLong:v]];
  return shape;
}

// An unranked tensor (nil shape) reads as {}, which CheckResultShapes refuses.
std::vector<int64_t> FromShape(MPSShape* shape) {
  std::vector<int64_t> dims;
  for (NSUInteger i = 0; i < shape.count; ++i) dims.push_back(shape[i].longLongValue);
  return dims;
}

// One Metal device and command queue for the process, made on first use (thread-safe static);
// never destroyed, as handlers may still run while the process exits.
struct Gpu {
  id<MTLDevice> device;
  id<MTLCommandQueue> queue;
};

const Gpu& DefaultGpu() {
  static const Gpu* gpu = [] {
    @autoreleasepool {
      auto* g = new Gpu{MTLCreateSystemDefaultDevice(), nil};
      if (g->device) g->queue = [g->device newCommandQueue];
      return g;
    }
  }();
  return *gpu;
}

// A built graph: its placeholders (nil for operands the op does not take) and its results,
// each reshaped to the flat size of its ResultSlot.
struct Graph {
  Op op;
  MPSGraph* graph;
  MPSGraphTensor* placeholders[mps::kOperandCount];
  MPSShape* placeholder_shapes[mps::kOperandCount];
  int64_t placeholder_elements[mps::kOperandCount] = {};
  std::vector<mps::ResultSlot> slots;
  std::vector<MPSGraphTensor*> results;
  std::vector<MPSShape*> result_shapes;
  std::mutex run;  // MPSGraph is not documented thread-safe: one run of a graph at a time
};

MPSGraphTensor* Placeholder(const Graph& g, Operand operand) {
  return g.placeholders[static_cast<int>(operand)];
}

NSArray<MPSGraphTensor*>* AddForward(const Graph& g, MPSGraphSingleGateRNNDescriptor* descriptor,
                                     const Config& c) {
  MPSGraphTensor* x = Placeholder(g, Operand::kSource);
  MPSGraphTensor* R = Placeholder(g, Operand::kRecurrentWeight);
  MPSGraphTensor* W = Placeholder(g, Operand::kInputWeight);
  MPSGraphTensor* b = Placeholder(g, Operand::kBias);
  MPSGraphTensor* h0 = Placeholder(g, Operand::kInitState);
  switch (mps::ChooseOverload(c)) {
    case mps::Overload::kWithMask:
      return [g.graph singleGateRNNWithSourceTensor:x
                                    recurrentWeight:R
                                        inputWeight:W
                                               bias:b
                                          initState:h0
                                               mask:Placeholder(g, Operand::kMask)
                                         descriptor:descriptor
                                               name:nil];
    case mps::Overload::kWithoutMask:
      return [g.graph singleGateRNNWithSourceTensor:x
                                    recurrentWeight:R
                                        inputWeight:W
                                               bias:b
                                          initState:h0
                                         descriptor:descriptor
                                               name:nil];
    case mps::Overload::kInitStateOnly:
      return [g.graph singleGateRNNWithSourceTensor:x
                                    recurrentWeight:R
                                          initState:h0
                                         descriptor:descriptor
                                               name:nil];
  }
  return nil;
}

NSArray<MPSGraphTensor*>* AddGradients(const Graph& g,
                                       MPSGraphSingleGateRNNDescriptor* descriptor,
                                       const Config& c) {
  MPSGraphTensor* x = Placeholder(g, Operand::kSource);
  MPSGraphTensor* R = Placeholder(g, Operand::kRecurrentWeight);
  MPSGraphTensor* dy = Placeholder(g, Operand::kSourceGradient);
  MPSGraphTensor* z = Placeholder(g, Operand::kZState);
  MPSGraphTensor* W = Placeholder(g, Operand::kInputWeight);
  MPSGraphTensor* b = Placeholder(g, Operand::kBias);
  MPSGraphTensor* h0 = Placeholder(g, Operand::kInitState);
  switch (mps::ChooseOverload(c)) {
    case mps::Overload::kWithMask:
      return [g.graph singleGateRNNGradientsWithSourceTensor:x
                                             recurrentWeight:R
                                              sourceGradient:dy
                                                      zState:z
                                                 inputWeight:W
                                                        bias:b
                                                   initState:h0
                                                        mask:Placeholder(g, Operand::kMask)
                                                  descriptor:descriptor
                                                        name:nil];
    case mps::Overload::kWithoutMask:
      return [g.graph singleGateRNNGradientsWithSourceTensor:x
                                             recurrentWeight:R
                                              sourceGradient:dy
                                                      zState:z
                                                 inputWeight:W
                                                        bias:b
                                                   initState:h0
                                                  descriptor:descriptor
                                                        name:nil];
    case mps::Overload::kInitStateOnly:
      return [g.graph singleGateRNNGradientsWithSourceTensor:x
                                             recurrentWeight:R
                                              sourceGradient:dy
                                                      zState:z
                                                   initState:h0
                                                  descriptor:descriptor
                                                        name:nil];
  }
  return nil;
}

// Builds the graph of `op` for one problem; returns "" or what went wrong. May raise an
// NSException (MPSGraph's way to refuse), which the caller catches.
std::string BuildGraph(Op op, const Config& c, const Dims& d, MPSDataType type, Graph& g,
                       int* bad_output) {
  g.op = op;
  g.graph = [[MPSGraph alloc] init];
  for (int i = 0; i < mps::kOperandCount; ++i) {
    const auto operand = static_cast<Operand>(i);
    if (!mps::OperandPresent(op, operand, c)) continue;
    const std::vector<int64_t> shape = mps::PlaceholderShape(operand, c, d);
    g.placeholder_shapes[i] = ToShape(shape);
    g.placeholder_elements[i] = mps::ElementCount(shape);
    g.placeholders[i] = [g.graph placeholderWithShape:g.placeholder_shapes[i]
                                             dataType:type
                                                 name:nil];
  }
  MPSGraphSingleGateRNNDescriptor* descriptor = [MPSGraphSingleGateRNNDescriptor descriptor];
  if (!descriptor) return "could not create an MPSGraphSingleGateRNNDescriptor";
  descriptor.reverse = c.reverse;
  descriptor.bidirectional = c.bidirectional;
  descriptor.training = mps::DescriptorTraining(op, c);
  // Always set: +descriptor defaults to relu, alloc/init to none.
  descriptor.activation = static_cast<MPSGraphRNNActivation>(c.activation);
  NSArray<MPSGraphTensor*>* raw =
      op == Op::kForward ? AddForward(g, descriptor, c) : AddGradients(g, descriptor, c);

  g.slots = mps::ExpectedResults(op, c, d);
  std::vector<std::vector<int64_t>> shapes;
  for (NSUInteger i = 0; i < raw.count; ++i) shapes.push_back(FromShape(raw[i].shape));
  if (std::string problem = mps::CheckResultShapes(op, g.slots, shapes, bad_output);
      !problem.empty()) {
    return problem;
  }
  for (size_t i = 0; i < g.slots.size(); ++i) {
    MPSShape* flat = ToShape({g.slots[i].elements});
    g.result_shapes.push_back(flat);
    g.results.push_back([g.graph reshapeTensor:raw[i] withShape:flat name:nil]);
  }
  return "";
}

// Graphs by key, built once and kept for the process. A graph is built under the cache's lock
// (so at most one MPSGraph is being built at a time) and only a complete one is inserted.
class GraphCache {
 public:
  // Returns the graph, or nullptr with `problem` set when it could not be built (and
  // `bad_output`, when given, set to the schema output whose shape was wrong, or -1).
  Graph* Get(const mps::GraphKey& key, const Config& c, const Dims& d, std::string* problem,
             int* bad_output = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = graphs_.find(key);
    if (found != graphs_.end()) return found->second.get();
    auto graph = std::make_unique<Graph>();
    *problem = BuildGraph(key.op, c, d, static_cast<MPSDataType>(key.mps_data_type), *graph,
                          bad_output);
    if (!problem->empty()) return nullptr;
    return graphs_.emplace(key, std::move(graph)).first->second.get();
  }

 private:
  std::mutex mutex_;
  std::unordered_map<mps::GraphKey, std::unique_ptr<Graph>, mps::GraphKeyHash> graphs_;
};

GraphCache& Cache() {
  static auto* cache = new GraphCache;  // never destroyed, like the device
  return *cache;
}

// The MTLBuffers of one run: XLA's memory wrapped in place where PlanBuffer allows it and Metal
// accepts it, else staged through a shared buffer; staged outputs are copied back after the run.
// MPSGraphTensorData takes no offset, so each group's slice gets its own buffer.
class RunBuffers {
 public:
  RunBuffers(id<MTLDevice> device, MPSDataType type)
      : device_(device), type_(type), page_size_(static_cast<size_t>(getpagesize())) {}

  MPSGraphTensorData* Input(const void* data, size_t bytes, MPSShape* shape) {
    id<MTLBuffer> buffer = Wrap(const_cast<void*>(data), bytes);
    if (!buffer) {
      buffer = Allocated([device_ newBufferWithBytes:data
                                              length:bytes
                                             options:MTLResourceStorageModeShared]);
    }
    return Data(buffer, shape);
  }

  // A new buffer that `fill` writes (the expanded mask).
  template <typename Fill>
  MPSGraphTensorData* Filled(size_t bytes, MPSShape* shape, Fill&& fill) {
    id<MTLBuffer> buffer =
        Allocated([device_ newBufferWithLength:bytes options:MTLResourceStorageModeShared]);
    fill(buffer.contents);
    return Data(buffer, shape);
  }

  MPSGraphTensorData* Output(void* data, size_t bytes, MPSShape* shape) {
    id<MTLBuffer> buffer = Wrap(data, bytes);
    if (!buffer) {
      buffer = Allocated([device_ newBufferWithLength:bytes options:MTLResourceStorageModeShared]);
      staged_outputs_.push_back({buffer, data, bytes});
    }
    return Data(buffer, shape);
  }

  void CopyOutStaged() const {
    for (const StagedOutput& s : staged_outputs_) {
      std::memcpy(s.destination, s.buffer.contents, s.bytes);
    }
  }

 private:
  struct StagedOutput {
    id<MTLBuffer> buffer;
    void* destination;
    size_t bytes;
  };

  // nil when the memory cannot be wrapped; XLA owns it, so no deallocator.
  id<MTLBuffer> Wrap(void* data, size_t bytes) const {
    if (mps::PlanBuffer(reinterpret_cast<uintptr_t>(data), bytes, page_size_) !=
        mps::BufferPlan::kWrap) {
      return nil;
    }
    return [device_ newBufferWithBytesNoCopy:data
                                      length:bytes
                                     options:MTLResourceStorageModeShared
                                 deallocator:nil];
  }

  static id<MTLBuffer> Allocated(id<MTLBuffer> buffer) {
    if (!buffer) throw std::bad_alloc();  // GuardExceptions: kResourceExhausted
    return buffer;
  }

  MPSGraphTensorData* Data(id<MTLBuffer> buffer, MPSShape* shape) const {
    return [[MPSGraphTensorData alloc] initWithMTLBuffer:buffer shape:shape dataType:type_];
  }

  id<MTLDevice> device_;
  MPSDataType type_;
  size_t page_size_;
  std::vector<StagedOutput> staged_outputs_;
};

// The memory of one call's operands (indexed by Operand) and outputs (by FFI result index).
struct CallBuffers {
  const void* operands[mps::kOperandCount] = {};
  void* outputs[kMaxOutputs] = {};
  size_t output_bytes[kMaxOutputs] = {};
};

// Element offset of group g's slice of an operand; the weights are shared by every group.
int64_t OperandOffset(Operand operand, const GroupOffsets& at) {
  switch (operand) {
    case Operand::kSource: return at.source;
    case Operand::kInitState: return at.init_state;
    case Operand::kMask: return at.mask;
    case Operand::kSourceGradient:
    case Operand::kZState: return at.state;
    case Operand::kRecurrentWeight:
    case Operand::kInputWeight:
    case Operand::kBias: return 0;
  }
  return 0;
}

int64_t OutputOffset(Op op, int output, const GroupOffsets& at) {
  if (op == Op::kForward) return at.state;  // y and z; the forward has one group
  const int64_t offsets[kMaxOutputs] = {at.source, at.d_recurrent_weight, at.d_input_weight,
                                        at.d_bias, at.init_state};
  return offsets[output];
}

// Encodes the graph on group g's slices into `commands`; `io` holds the group's buffers until
// the command buffer has completed.
void EncodeGroup(Graph& g, const CheckedDims& checked, mps::ElementType type,
                 const CallBuffers& call, const GroupOffsets& at, RunBuffers& io,
                 MPSCommandBuffer* commands) {
  const Dims& d = checked.dims;
  const int64_t* mask_tnh = checked.mask_shape + 1;
  NSMutableDictionary<MPSGraphTensor*, MPSGraphTensorData*>* feeds =
      [NSMutableDictionary dictionaryWithCapacity:mps::kOperandCount];
  for (int i = 0; i < mps::kOperandCount; ++i) {
    if (!g.placeholders[i]) continue;
    const auto operand = static_cast<Operand>(i);
    const size_t bytes = static_cast<size_t>(g.placeholder_elements[i]) * type.bytes;
    const auto* data = static_cast<const char*>(call.operands[i]) +
                       OperandOffset(operand, at) * static_cast<int64_t>(type.bytes);
    MPSGraphTensorData* fed;
    if (operand == Operand::kMask && !mps::MaskIsFull(mask_tnh, d)) {
      fed = io.Filled(bytes, g.placeholder_shapes[i],
                      [&](void* out) { mps::ExpandMask(data, mask_tnh, d, type.bytes, out); });
    } else {
      fed = io.Input(data, bytes, g.placeholder_shapes[i]);
    }
    [feeds setObject:fed forKey:g.placeholders[i]];
  }
  NSMutableDictionary<MPSGraphTensor*, MPSGraphTensorData*>* results =
      [NSMutableDictionary dictionaryWithCapacity:g.slots.size()];
  for (size_t i = 0; i < g.slots.size(); ++i) {
    const mps::ResultSlot& slot = g.slots[i];
    auto* data = static_cast<char*>(call.outputs[slot.output]) +
                 OutputOffset(g.op, slot.output, at) * static_cast<int64_t>(type.bytes);
    [results setObject:io.Output(data, static_cast<size_t>(slot.elements) * type.bytes,
                                 g.result_shapes[i])
                forKey:g.results[i]];
  }
  [g.graph encodeToCommandBuffer:commands
                           feeds:feeds
                targetOperations:nil
               resultsDictionary:results
             executionDescriptor:nil];
}

// Runs the graph on every group: all encoded into one command buffer, one wait.
ffi::Error RunGroups(const Gpu& gpu, Graph& g, const CheckedDims& checked, mps::ElementType type,
                     const CallBuffers& call) {
  std::vector<std::unique_ptr<RunBuffers>> buffers;
  MPSCommandBuffer* commands;
  {
    std::lock_guard<std::mutex> lock(g.run);
    commands = [MPSCommandBuffer commandBufferFromCommandQueue:gpu.queue];
    for (int64_t group = 0; group < checked.G; ++group) {
      buffers.push_back(
          std::make_unique<RunBuffers>(gpu.device, static_cast<MPSDataType>(type.mps_data_type)));
      EncodeGroup(g, checked, type, call, checked.Group(group), *buffers.back(), commands);
    }
    [commands commit];
    [commands waitUntilCompleted];
  }
  if (commands.status != MTLCommandBufferStatusCompleted) {
    return Fail(ffi::ErrorCode::kInternal,
                "the Metal command buffer failed: " + Utf8(commands.error.localizedDescription));
  }
  for (const auto& io : buffers) io->CopyOutStaged();
  return ffi::Error::Success();
}

ffi::Error Run(Op op, const Config& c, const CheckedDims& checked, ffi::DataType dtype,
               const CallBuffers& call) {
  const std::optional<mps::ElementType> type = mps::ElementTypeFor(static_cast<int32_t>(dtype));
  if (!type) {
    return Fail(ffi::ErrorCode::kInvalidArgument, "the handler takes float32 or float16");
  }
  if (const std::optional<std::string> why = mps::Unsupported(c)) {
    return Fail(ffi::ErrorCode::kUnimplemented, *why);
  }
  if (mps::IsEmptyProblem(checked.dims, checked.G)) {
    for (int i = 0; i < kMaxOutputs; ++i) {
      if (call.output_bytes[i] > 0) std::memset(call.outputs[i], 0, call.output_bytes[i]);
    }
    return ffi::Error::Success();
  }
  const Gpu& gpu = DefaultGpu();
  if (!gpu.device || !gpu.queue) {
    return Fail(ffi::ErrorCode::kFailedPrecondition, "this machine has no Metal device");
  }
  @autoreleasepool {
    @try {
      std::string problem;
      Graph* graph = Cache().Get(mps::MakeGraphKey(op, c, checked.dims, type->mps_data_type), c,
                                 checked.dims, &problem);
      if (!graph) return Fail(ffi::ErrorCode::kInternal, problem);
      return RunGroups(gpu, *graph, checked, *type, call);
    } @catch (NSException* e) {
      return Fail(ffi::ErrorCode::kInternal,
                  "MPSGraph raised " + Utf8(e.name) + ": " + Utf8(e.reason));
    }
  }
}

void SetOutput(CallBuffers& call, int output, ffi::AnyBuffer buffer) {
  call.outputs[output] = buffer.untyped_data();
  call.output_bytes[output] = buffer.size_bytes();
}

// The schema's buffers in mps::Operand's order and the outputs in the schema's.
CallBuffers CallOf(const ForwardBuffers& f) {
  CallBuffers call{.operands = {f.x.untyped_data(), f.R.untyped_data(), f.W.untyped_data(),
                                f.b.untyped_data(), f.h0.untyped_data(), f.mask.untyped_data()}};
  SetOutput(call, 0, f.y);
  SetOutput(call, 1, f.z);
  return call;
}

CallBuffers CallOf(const GradientBuffers& g) {
  CallBuffers call{.operands = {g.x.untyped_data(), g.R.untyped_data(), g.W.untyped_data(),
                                g.b.untyped_data(), g.h0.untyped_data(), g.mask.untyped_data(),
                                g.dy.untyped_data(), g.z.untyped_data()}};
  int output = 0;
  for (const ffi::AnyBuffer& b : {g.dx, g.dR, g.dW, g.db, g.dh0}) SetOutput(call, output++, b);
  return call;
}

ffi::Error ForwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer W, ffi::AnyBuffer b,
                       ffi::AnyBuffer h0, ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths,
                       Config c, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> z) {
  return GuardExceptions([&]() -> ffi::Error {
    const ForwardBuffers buffers{x, R, W, b, h0, mask, seq_lengths, *y, *z};
    CheckedDims checked;
    if (ffi::Error status = CheckForward(c, buffers, &checked); status.failure()) return status;
    return Run(Op::kForward, c, checked, x.element_type(), CallOf(buffers));
  });
}

ffi::Error GradientsImpl(ffi::AnyBuffer x, ffi::AnyBuffer R, ffi::AnyBuffer dy, ffi::AnyBuffer z,
                         ffi::AnyBuffer W, ffi::AnyBuffer b, ffi::AnyBuffer h0,
                         ffi::AnyBuffer mask, ffi::AnyBuffer seq_lengths, Config c,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dR,
                         ffi::Result<ffi::AnyBuffer> dW, ffi::Result<ffi::AnyBuffer> db,
                         ffi::Result<ffi::AnyBuffer> dh0) {
  return GuardExceptions([&]() -> ffi::Error {
    const GradientBuffers buffers{x,  R,   dy,  z,   W,   b,  h0, mask, seq_lengths,
                                  *dx, *dR, *dW, *db, *dh0};
    CheckedDims checked;
    if (ffi::Error status = CheckGradients(c, buffers, &checked); status.failure()) return status;
    return Run(Op::kGradients, c, checked, x.element_type(), CallOf(buffers));
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MpsForward, ForwardImpl, BindForward());
XLA_FFI_DEFINE_HANDLER_SYMBOL(MpsGradients, GradientsImpl, BindGradients());

namespace {

// The self-check's runner: one problem through the path an XLA call takes (the graph cache,
// the buffers, Run), on copies of its operands in the problem's precision.
class MpsRunner : public mps::Runner {
 public:
  mps::RunError Run(Op op, const Config& c, const Dims& d, mps::Precision precision,
                    const mps::RunOperands& in, const mps::RunOutputs& out) override {
    const bool half = precision == mps::Precision::kFloat16;
    const ffi::DataType dtype = half ? ffi::DataType::F16 : ffi::DataType::F32;
    const size_t element_bytes = half ? 2 : 4;
    CheckedDims checked;
    checked.dims = d;
    const int64_t mask_elements = in.mask_tnh[0] * in.mask_tnh[1] * in.mask_tnh[2];
    for (int a = 0; a < 3; ++a) checked.mask_shape[a + 1] = in.mask_tnh[a];

    std::vector<std::vector<char>> storage;  // every operand and output, in `dtype`
    auto buffer = [&](int64_t elements) {
      storage.emplace_back(static_cast<size_t>(elements) * element_bytes);
      return storage.back().data();
    };
    storage.reserve(mps::kOperandCount + kMaxOutputs);
    CallBuffers call;
    const float* operands[mps::kOperandCount] = {in.x, in.R, in.W, in.b, in.h0, in.mask, in.dy,
                                                 in.z};  // Operand's order
    for (int i = 0; i < mps::kOperandCount; ++i) {
      const auto operand = static_cast<Operand>(i);
      if (!mps::OperandPresent(op, operand, c)) continue;
      const int64_t elements = operand == Operand::kMask
                                   ? mask_elements
                                   : mps::ElementCount(mps::PlaceholderShape(operand, c, d));
      void* data = buffer(elements);
      mps::StoreAs(precision, operands[i], elements, data);
      call.operands[i] = data;
    }
    float* outputs[kMaxOutputs] = {};
    if (op == Op::kForward) {
      outputs[0] = out.y;
      outputs[1] = out.z;
    } else {
      float* gradients[] = {out.dx, out.dR, out.dW, out.db, out.dh0};
      std::copy(std::begin(gradients), std::end(gradients), outputs);
    }
    const std::vector<mps::ResultSlot> slots = mps::ExpectedResults(op, c, d);
    for (const mps::ResultSlot& slot : slots) {
      call.outputs[slot.output] = buffer(slot.elements);
      call.output_bytes[slot.output] = static_cast<size_t>(slot.elements) * element_bytes;
    }

    // Built first, so that a result of the wrong shape is reported against its output.
    std::string problem;
    int bad_output = -1;
    @try {
      if (!Cache().Get(mps::MakeGraphKey(op, c, d, mps::ElementTypeFor(
                                                       static_cast<int32_t>(dtype))->mps_data_type),
                       c, d, &problem, &bad_output)) {
        return {problem, bad_output};
      }
    } @catch (NSException* e) {
      return {"MPSGraph raised " + Utf8(e.name) + ": " + Utf8(e.reason), -1};
    }
    if (ffi::Error status = sgrnn::Run(op, c, checked, dtype, call); status.failure()) {
      return {status.message(), -1};
    }
    for (const mps::ResultSlot& slot : slots) {
      mps::LoadFrom(precision, call.outputs[slot.output], slot.elements, outputs[slot.output]);
    }
    return {};
  }
};

}  // namespace

mps::Report MpsSelfCheck() {
  @autoreleasepool {
    MpsRunner runner;
    return mps::RunSelfCheck(runner);
  }
}

std::string MpsDeviceName() {
  @autoreleasepool {
    const Gpu& gpu = DefaultGpu();
    return gpu.device ? Utf8(gpu.device.name) : "";
  }
}

}  // namespace sgrnn
