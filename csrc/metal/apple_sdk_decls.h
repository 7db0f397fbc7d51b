// Stand-in for Apple's framework headers, used only by the Linux compile check
// (scripts/check_metal_compile.sh defines SGRNN_APPLE_SDK_DECLS); a Mac build includes the real
// <Foundation/Foundation.h>, <Metal/Metal.h>, <MetalPerformanceShaders/...> and
// <MetalPerformanceShadersGraph/...> instead.
//
// It declares exactly what mps_handler.mm uses, transcribed with the SDK's spellings, types,
// nullability and enum values from the macOS SDK headers (public mirror: phracker/MacOSX-SDKs,
// MacOSX12.3.sdk, the first SDK with the RNN ops; these declarations are unchanged in the
// iPhoneOS 17 SDK copy in itsnebulalol/sdks):
//   MetalPerformanceShadersGraph: MPSGraph.h, MPSGraphTensor.h, MPSGraphTensorData.h,
//     MPSGraphMemoryOps.h, MPSGraphTensorShapeOps.h, MPSGraphRNNOps.h
//   MetalPerformanceShaders (MPSCore): MPSCoreTypes.h (MPSDataType, MPSShape), MPSCommandBuffer.h
//   Metal: MTLDevice.h, MTLBuffer.h, MTLResource.h, MTLCommandQueue.h, MTLCommandBuffer.h
//   Foundation: NSObjCRuntime.h (the NS_* macros, their C++ branch), NSObject.h (NSCopying),
//     NSString.h, NSArray.h, NSDictionary.h, NSValue.h, NSError.h, NSException.h
// Cut to what is used: protocol conformance lists, and MPSDataType / MTLStorageMode /
// MTLResourceOptions to the values used. Availability attributes are left out (macOS 13, the
// deployment target, is above every one). The overload with stateGradient is deliberately not
// declared, so calling it fails this check. The objc runtime headers (objc/NSObject.h: NSObject,
// NSInteger, NSUInteger, BOOL) are the real ones zig's clang ships.
#ifndef JAX_SGRNN_METAL_APPLE_SDK_DECLS_H_
#define JAX_SGRNN_METAL_APPLE_SDK_DECLS_H_

#import <objc/NSObject.h>

#include <stdint.h>

// ---- Foundation: NSObjCRuntime.h / NSObject.h -------------------------------------------------

#define NS_ASSUME_NONNULL_BEGIN _Pragma("clang assume_nonnull begin")
#define NS_ASSUME_NONNULL_END _Pragma("clang assume_nonnull end")
#define NS_RETURNS_RETAINED __attribute__((ns_returns_retained))
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))
#define NS_DESIGNATED_INITIALIZER __attribute__((objc_designated_initializer))
#define NS_UNAVAILABLE __attribute__((unavailable))
// The C++ spellings of CF_ENUM / CF_OPTIONS: options are a plain integer type in C++.
#define NS_ENUM(_type, _name) enum _name : _type _name; enum _name : _type
#define NS_OPTIONS(_type, _name) _type _name; enum : _type

NS_ASSUME_NONNULL_BEGIN

typedef struct _NSZone NSZone;

@protocol NSCopying
- (id)copyWithZone:(nullable NSZone *)zone;
@end

@interface NSString : NSObject <NSCopying>
@property (nullable, readonly) const char *UTF8String NS_RETURNS_INNER_POINTER;
@end

@interface NSArray<__covariant ObjectType> : NSObject <NSCopying>
@property (readonly) NSUInteger count;
- (ObjectType)objectAtIndexedSubscript:(NSUInteger)idx;
@end

@interface NSMutableArray<ObjectType> : NSArray<ObjectType>
- (void)addObject:(ObjectType)anObject;
+ (instancetype)arrayWithCapacity:(NSUInteger)numItems;
@end

@interface NSDictionary<__covariant KeyType, __covariant ObjectType> : NSObject <NSCopying>
@end

@interface NSMutableDictionary<KeyType, ObjectType> : NSDictionary<KeyType, ObjectType>
- (void)setObject:(ObjectType)anObject forKey:(KeyType <NSCopying>)aKey;
+ (instancetype)dictionaryWithCapacity:(NSUInteger)numItems;
@end

@interface NSValue : NSObject <NSCopying>
@end

@interface NSNumber : NSValue
@property (readonly) long long longLongValue;
+ (NSNumber *)numberWithLongLong:(long long)value;
@end

@interface NSError : NSObject <NSCopying>
@property (readonly, copy) NSString *localizedDescription;
@end

typedef NSString *NSExceptionName;

@interface NSException : NSObject <NSCopying>
@property (readonly, copy) NSExceptionName name;
@property (nullable, readonly, copy) NSString *reason;
@end

// ---- Metal --------------------------------------------------------------------------------

typedef NS_ENUM(NSUInteger, MTLStorageMode) {
  MTLStorageModeShared = 0,
};

#define MTLResourceStorageModeShift 4

typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
  MTLResourceStorageModeShared = MTLStorageModeShared << MTLResourceStorageModeShift,
};

typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
  MTLCommandBufferStatusNotEnqueued = 0,
  MTLCommandBufferStatusEnqueued = 1,
  MTLCommandBufferStatusCommitted = 2,
  MTLCommandBufferStatusScheduled = 3,
  MTLCommandBufferStatusCompleted = 4,
  MTLCommandBufferStatusError = 5,
};

@protocol MTLResource <NSObject>
@end

@protocol MTLBuffer <MTLResource>
- (void *)contents NS_RETURNS_INNER_POINTER;
@end

@protocol MTLCommandBuffer <NSObject>
@property (readonly) MTLCommandBufferStatus status;
@property (nullable, readonly) NSError *error;
- (void)commit;
- (void)waitUntilCompleted;
@end

@protocol MTLCommandQueue <NSObject>
@end

@protocol MTLDevice <NSObject>
@property (nonnull, readonly) NSString *name;
- (nullable id<MTLCommandQueue>)newCommandQueue;
- (nullable id<MTLBuffer>)newBufferWithLength:(NSUInteger)length
                                      options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytes:(const void *)pointer
                                      length:(NSUInteger)length
                                     options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytesNoCopy:(void *)pointer
                                            length:(NSUInteger)length
                                           options:(MTLResourceOptions)options
                                       deallocator:
                                           (void (^__nullable)(void *pointer,
                                                               NSUInteger length))deallocator;
@end

extern "C" id<MTLDevice> __nullable MTLCreateSystemDefaultDevice(void) NS_RETURNS_RETAINED;

// ---- MetalPerformanceShaders (MPSCore) ----------------------------------------------------

typedef NS_ENUM(uint32_t, MPSDataType) {
  MPSDataTypeInvalid = 0,
  MPSDataTypeFloatBit = 0x10000000,
  MPSDataTypeFloat32 = MPSDataTypeFloatBit | 32,
  MPSDataTypeFloat16 = MPSDataTypeFloatBit | 16,
};

typedef NSArray<NSNumber *> MPSShape;

@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
+ (__nonnull instancetype)commandBufferFromCommandQueue:
    (nonnull id<MTLCommandQueue>)commandQueue;
@end

// ---- MetalPerformanceShadersGraph ---------------------------------------------------------

@class MPSGraphOperation;
@class MPSGraphExecutionDescriptor;

@interface MPSGraphTensor : NSObject <NSCopying>
@property (nullable, readonly, copy, nonatomic) MPSShape *shape;
- (instancetype)init NS_UNAVAILABLE;
@end

@interface MPSGraphTensorData : NSObject
- (instancetype)initWithMTLBuffer:(id<MTLBuffer>)buffer
                            shape:(MPSShape *)shape
                         dataType:(MPSDataType)dataType;
@end

typedef NSDictionary<MPSGraphTensor *, MPSGraphTensorData *> MPSGraphTensorDataDictionary;

@interface MPSGraph : NSObject
- (instancetype)init;
- (void)encodeToCommandBuffer:(MPSCommandBuffer *)commandBuffer
                        feeds:(MPSGraphTensorDataDictionary *)feeds
             targetOperations:(NSArray<MPSGraphOperation *> *_Nullable)targetOperations
            resultsDictionary:(MPSGraphTensorDataDictionary *)resultsDictionary
          executionDescriptor:(MPSGraphExecutionDescriptor *_Nullable)executionDescriptor;
@end

@interface MPSGraph (MemoryOps)
- (MPSGraphTensor *)placeholderWithShape:(MPSShape *_Nullable)shape
                                dataType:(MPSDataType)dataType
                                    name:(NSString *_Nullable)name;
@end

@interface MPSGraph (MPSGraphTensorShapeOps)
- (MPSGraphTensor *)reshapeTensor:(MPSGraphTensor *)tensor
                        withShape:(MPSShape *)shape
                             name:(NSString *_Nullable)name;
@end

typedef NS_ENUM(NSUInteger, MPSGraphRNNActivation) {
  MPSGraphRNNActivationNone = 0L,
  MPSGraphRNNActivationRelu,
  MPSGraphRNNActivationTanh,
  MPSGraphRNNActivationSigmoid,
  MPSGraphRNNActivationHardSigmoid,
};

@interface MPSGraphSingleGateRNNDescriptor : NSObject <NSCopying>
@property (readwrite, nonatomic) BOOL reverse;
@property (readwrite, nonatomic) BOOL bidirectional;
@property (readwrite, nonatomic) BOOL training;
@property (readwrite, nonatomic) MPSGraphRNNActivation activation;
+ (nullable instancetype)descriptor;
@end

@interface MPSGraph (MPSGraphRNNOps)
- (NSArray<MPSGraphTensor *> *)
    singleGateRNNWithSourceTensor:(MPSGraphTensor *)source
                  recurrentWeight:(MPSGraphTensor *)recurrentWeight
                      inputWeight:(MPSGraphTensor *_Nullable)inputWeight
                             bias:(MPSGraphTensor *_Nullable)bias
                        initState:(MPSGraphTensor *_Nullable)initState
                             mask:(MPSGraphTensor *_Nullable)mask
                       descriptor:(MPSGraphSingleGateRNNDescriptor *)descriptor
                             name:(NSString *_Nullable)name;

- (NSArray<MPSGraphTensor *> *)
    singleGateRNNWithSourceTensor:(MPSGraphTensor *)source
                  recurrentWeight:(MPSGraphTensor *)recurrentWeight
                      inputWeight:(MPSGraphTensor *_Nullable)inputWeight
                             bias:(MPSGraphTensor *_Nullable)bias
                        initState:(MPSGraphTensor *_Nullable)initState
                       descriptor:(MPSGraphSingleGateRNNDescriptor *)descriptor
                             name:(NSString *_Nullable)name;

- (NSArray<MPSGraphTensor *> *)
    singleGateRNNWithSourceTensor:(MPSGraphTensor *)source
                  recurrentWeight:(MPSGraphTensor *)recurrentWeight
                        initState:(MPSGraphTensor *_Nullable)initState
                       descriptor:(MPSGraphSingleGateRNNDescriptor *)descriptor
                             name:(NSString *_Nullable)name;

- (NSArray<MPSGraphTensor *> *)
    singleGateRNNGradientsWithSourceTensor:(MPSGraphTensor *)source
                           recurrentWeight:(MPSGraphTensor *)recurrentWeight
                            sourceGradient:(MPSGraphTensor *)sourceGradient
                                    zState:(MPSGraphTensor *)zState
                               inputWeight:(MPSGraphTensor *_Nullable)inputWeight
                                      bias:(MPSGraphTensor *_Nullable)bias
                                 initState:(MPSGraphTensor *_Nullable)initState
                                      mask:(MPSGraphTensor *_Nullable)mask
                                descriptor:(MPSGraphSingleGateRNNDescriptor *)descriptor
                                      name:(NSString *_Nullable)name;

- (NSArray<MPSGraphTensor *> *)
    singleGateRNNGradientsWithSourceTensor:(MPSGraphTensor *)source
                           recurrentWeight:(MPSGraphTensor *)recurrentWeight
                            sourceGradient:(MPSGraphTensor *)sourceGradient
                                    zState:(MPSGraphTensor *)zState
                               inputWeight:(MPSGraphTensor *_Nullable)inputWeight
                                      bias:(MPSGraphTensor *_Nullable)bias
                                 initState:(MPSGraphTensor *_Nullable)initState
                                descriptor:(MPSGraphSingleGateRNNDescriptor *)descriptor
                                      name:(NSString *_Nullable)name;

- (NSArray<MPSGraphTensor *> *)
    singleGateRNNGradientsWithSourceTensor:(MPSGraphTensor *)source
                           recurrentWeight:(MPSGraphTensor *)recurrentWeight
                            sourceGradient:(MPSGraphTensor *)sourceGradient
                                    zState:(MPSGraphTensor *)zState
                                 initState:(MPSGraphTensor *_Nullable)initState
                                descriptor:(MPSGraphSingleGateRNNDescriptor *)descriptor
                                      name:(NSString *_Nullable)name;
@end

NS_ASSUME_NONNULL_END

#endif  // JAX_SGRNN_METAL_APPLE_SDK_DECLS_H_
