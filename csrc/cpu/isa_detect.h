// Which x86-64 microarchitecture level (the psABI's x86-64-v3, x86-64-v4) this CPU and its OS
// run, read with CPUID and XGETBV. dispatch.cc uses this rather than __builtin_cpu_supports,
// which zig's clang runtime answers with false on every CPU.
#ifndef JAX_SGRNN_CPU_ISA_DETECT_H_
#define JAX_SGRNN_CPU_ISA_DETECT_H_

#include <cstdint>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace sgrnn::cpu {

// The instruction-set builds of kernels.cc, each level containing the one before.
enum class Isa { kBaseline, kX86_64_V3, kX86_64_V4 };

// The register values that decide the level.
struct CpuidRegisters {
  uint32_t max_basic_leaf = 0;     // CPUID 0: EAX
  uint32_t max_extended_leaf = 0;  // CPUID 0x80000000: EAX
  uint32_t leaf1_ecx = 0;
  uint32_t leaf7_ebx = 0;  // subleaf 0
  uint32_t leaf80000001_ecx = 0;
  uint64_t xcr0 = 0;  // the register state the OS saves (XGETBV 0); 0 when OSXSAVE is clear
};

namespace cpuid_bits {
// CPUID 1, ECX.
inline constexpr uint32_t kSse3 = 1u << 0;
inline constexpr uint32_t kSsse3 = 1u << 9;
inline constexpr uint32_t kFma = 1u << 12;
inline constexpr uint32_t kCmpxchg16b = 1u << 13;
inline constexpr uint32_t kSse41 = 1u << 19;
inline constexpr uint32_t kSse42 = 1u << 20;
inline constexpr uint32_t kMovbe = 1u << 22;
inline constexpr uint32_t kPopcnt = 1u << 23;
inline constexpr uint32_t kOsxsave = 1u << 27;  // the OS enabled XGETBV
inline constexpr uint32_t kAvx = 1u << 28;
inline constexpr uint32_t kF16c = 1u << 29;
// CPUID 7 subleaf 0, EBX.
inline constexpr uint32_t kBmi1 = 1u << 3;
inline constexpr uint32_t kAvx2 = 1u << 5;
inline constexpr uint32_t kBmi2 = 1u << 8;
inline constexpr uint32_t kAvx512f = 1u << 16;
inline constexpr uint32_t kAvx512dq = 1u << 17;
inline constexpr uint32_t kAvx512cd = 1u << 28;
inline constexpr uint32_t kAvx512bw = 1u << 30;
inline constexpr uint32_t kAvx512vl = 1u << 31;
// CPUID 0x80000001, ECX.
inline constexpr uint32_t kLahfSahf = 1u << 0;
inline constexpr uint32_t kLzcnt = 1u << 5;  // "ABM" on AMD
// XCR0: the OS saves these registers on a context switch.
inline constexpr uint64_t kXmmState = 1u << 1;
inline constexpr uint64_t kYmmState = 1u << 2;     // upper halves of YMM0-15
inline constexpr uint64_t kOpmaskState = 1u << 5;  // k0-k7
inline constexpr uint64_t kZmmHi256State = 1u << 6;  // upper halves of ZMM0-15
inline constexpr uint64_t kHi16ZmmState = 1u << 7;   // ZMM16-31
}  // namespace cpuid_bits

// The best level the registers show, by the psABI's definition (x86-64-v2 is folded into v3:
// there is no v2 build).
constexpr Isa BestIsaFor(const CpuidRegisters& r) {
  using namespace cpuid_bits;
  const auto HasAll = [](uint64_t value, uint64_t bits) { return (value & bits) == bits; };
  // A leaf above the CPU's maximum answers with other data (on Intel, the highest leaf's).
  const uint32_t leaf1_ecx = r.max_basic_leaf >= 1 ? r.leaf1_ecx : 0;
  const uint32_t leaf7_ebx = r.max_basic_leaf >= 7 ? r.leaf7_ebx : 0;
  const uint32_t leaf80000001_ecx = r.max_extended_leaf >= 0x80000001u ? r.leaf80000001_ecx : 0;
  const bool v2 = HasAll(leaf1_ecx, kSse3 | kSsse3 | kCmpxchg16b | kSse41 | kSse42 | kPopcnt) &&
                  HasAll(leaf80000001_ecx, kLahfSahf);
  const bool v3 = v2 && HasAll(leaf1_ecx, kFma | kMovbe | kOsxsave | kAvx | kF16c) &&
                  HasAll(leaf7_ebx, kBmi1 | kAvx2 | kBmi2) && HasAll(leaf80000001_ecx, kLzcnt) &&
                  HasAll(r.xcr0, kXmmState | kYmmState);
  const bool v4 = v3 &&
                  HasAll(leaf7_ebx, kAvx512f | kAvx512dq | kAvx512cd | kAvx512bw | kAvx512vl) &&
                  HasAll(r.xcr0, kOpmaskState | kZmmHi256State | kHi16ZmmState);
  return v4 ? Isa::kX86_64_V4 : v3 ? Isa::kX86_64_V3 : Isa::kBaseline;
}

#if defined(__x86_64__)
// This CPU's registers. Leaves above the maximum are read too; BestIsaFor ignores them.
inline CpuidRegisters ReadCpuidRegisters() {
  CpuidRegisters r;
  unsigned eax, ebx, ecx, edx;
  r.max_basic_leaf = __get_cpuid_max(0, nullptr);
  r.max_extended_leaf = __get_cpuid_max(0x80000000u, nullptr);
  __cpuid_count(1, 0, eax, ebx, r.leaf1_ecx, edx);
  __cpuid_count(7, 0, eax, r.leaf7_ebx, ecx, edx);
  __cpuid_count(0x80000001u, 0, eax, ebx, r.leaf80000001_ecx, edx);
  if (r.leaf1_ecx & cpuid_bits::kOsxsave) {  // XGETBV faults without it
    // The instruction in asm rather than _xgetbv(), which needs -mxsave.
    uint32_t low, high;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    r.xcr0 = (uint64_t{high} << 32) | low;
  }
  return r;
}
#endif

}  // namespace sgrnn::cpu

#endif  // JAX_SGRNN_CPU_ISA_DETECT_H_
