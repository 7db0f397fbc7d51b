// Unit test of csrc/cpu/isa_detect.h's BestIsaFor, the x86-64 level that CPUID and XCR0 values
// show, on any machine. Built and run by tests/test_cpp_units.py; prints each failed check and
// exits non-zero.
#include "cpu/isa_detect.h"

#include "checks.h"

#include <cstdint>
#include <string>

namespace {

using sgrnn::cpu::BestIsaFor;
using sgrnn::cpu::CpuidRegisters;
using sgrnn::cpu::Isa;
using unit_test::Check;

static_assert(BestIsaFor(CpuidRegisters{}) == Isa::kBaseline, "usable at compile time");

// Register values of real CPUs (published CPUID dumps), with the XCR0 Linux sets on each.
// Xeon Gold 6000 (Cascade Lake); leaf 0x80000001 as on Intel's cores since Haswell.
constexpr CpuidRegisters kCascadeLakeXeon = {0x16, 0x80000008, 0x7FFEFBFF, 0xD39FFFFB, 0x121,
                                             0x2E7};
constexpr CpuidRegisters kHaswellXeon = {0xF, 0x80000008, 0x7FFEFBFF, 0x37AB, 0x21, 0x7};
constexpr CpuidRegisters kZen3Ryzen = {0x10, 0x80000023, 0x7ED8320B, 0x219C97A9, 0x75C237FF,
                                       0x207};
constexpr CpuidRegisters kExcavator = {0xD, 0x8000001E, 0x7ED8320B, 0x1A9, 0x2FABBFFF, 0x7};
constexpr CpuidRegisters kSandyBridge = {0xD, 0x80000008, 0x1F9AE3BF, 0, 0x1, 0x7};
constexpr CpuidRegisters kPiledriver = {0xD, 0x8000001E, 0x3E98320B, 0x8, 0x01EBBFFF, 0x7};
constexpr CpuidRegisters kNehalem = {0xB, 0x80000008, 0x00BCE3BD, 0, 0x1, 0};

void RealCpus() {
  Check(BestIsaFor(kCascadeLakeXeon) == Isa::kX86_64_V4, "Cascade Lake Xeon: v4");
  Check(BestIsaFor(kHaswellXeon) == Isa::kX86_64_V3, "Haswell Xeon: v3");
  Check(BestIsaFor(kZen3Ryzen) == Isa::kX86_64_V3, "Zen 3 Ryzen: v3");
  Check(BestIsaFor(kExcavator) == Isa::kX86_64_V3, "Excavator: v3 (AVX2, BMI2, MOVBE)");
  Check(BestIsaFor(kSandyBridge) == Isa::kBaseline, "Sandy Bridge (AVX, no AVX2): baseline");
  Check(BestIsaFor(kPiledriver) == Isa::kBaseline, "Piledriver (FMA, no AVX2): baseline");
  Check(BestIsaFor(kNehalem) == Isa::kBaseline, "Nehalem (no AVX): baseline");
}

// What an OS that does not save a register state takes away.
void OsSavedState() {
  CpuidRegisters r = kCascadeLakeXeon;
  r.xcr0 = 0x7;
  Check(BestIsaFor(r) == Isa::kX86_64_V3, "AVX-512 CPU, OS saving no opmask/ZMM state: v3");
  r.xcr0 = 0x3;
  Check(BestIsaFor(r) == Isa::kBaseline, "OS saving no YMM state: baseline");
  r = kHaswellXeon;
  r.leaf1_ecx &= ~(1u << 27);
  r.xcr0 = 0;
  Check(BestIsaFor(r) == Isa::kBaseline, "AVX2 without OSXSAVE: baseline");
  r.xcr0 = 0x7;
  Check(BestIsaFor(r) == Isa::kBaseline, "AVX2 without OSXSAVE, stale XCR0: baseline");
}

// Leaves above the CPU's maximum are not read.
void MaximumLeaves() {
  CpuidRegisters r = kCascadeLakeXeon;
  r.max_basic_leaf = 6;
  Check(BestIsaFor(r) == Isa::kBaseline, "max basic leaf 6: baseline");
  r = kCascadeLakeXeon;
  r.max_extended_leaf = 0x80000000;
  Check(BestIsaFor(r) == Isa::kBaseline, "no leaf 0x80000001: baseline");
  r = kCascadeLakeXeon;
  r.max_basic_leaf = 0;
  Check(BestIsaFor(r) == Isa::kBaseline, "max basic leaf 0: baseline");
}

// The psABI's list, bit by bit: each of these bits cleared from an AVX-512 CPU drops it to the
// level given, and clearing any other bit of the same registers keeps it at v4.
struct Requirement {
  const char* feature;
  uint32_t CpuidRegisters::*reg;
  int bit;
  Isa without;
};

constexpr uint32_t CpuidRegisters::*kLeaf1Ecx = &CpuidRegisters::leaf1_ecx;
constexpr uint32_t CpuidRegisters::*kLeaf7Ebx = &CpuidRegisters::leaf7_ebx;
constexpr uint32_t CpuidRegisters::*kLeaf80000001Ecx = &CpuidRegisters::leaf80000001_ecx;
constexpr Isa kBaseline = Isa::kBaseline;
constexpr Isa kV3 = Isa::kX86_64_V3;

constexpr Requirement kRequirements[] = {
    {"SSE3", kLeaf1Ecx, 0, kBaseline},       {"SSSE3", kLeaf1Ecx, 9, kBaseline},
    {"FMA", kLeaf1Ecx, 12, kBaseline},       {"CMPXCHG16B", kLeaf1Ecx, 13, kBaseline},
    {"SSE4.1", kLeaf1Ecx, 19, kBaseline},    {"SSE4.2", kLeaf1Ecx, 20, kBaseline},
    {"MOVBE", kLeaf1Ecx, 22, kBaseline},     {"POPCNT", kLeaf1Ecx, 23, kBaseline},
    {"OSXSAVE", kLeaf1Ecx, 27, kBaseline},   {"AVX", kLeaf1Ecx, 28, kBaseline},
    {"F16C", kLeaf1Ecx, 29, kBaseline},      {"BMI1", kLeaf7Ebx, 3, kBaseline},
    {"AVX2", kLeaf7Ebx, 5, kBaseline},       {"BMI2", kLeaf7Ebx, 8, kBaseline},
    {"AVX512F", kLeaf7Ebx, 16, kV3},         {"AVX512DQ", kLeaf7Ebx, 17, kV3},
    {"AVX512CD", kLeaf7Ebx, 28, kV3},        {"AVX512BW", kLeaf7Ebx, 30, kV3},
    {"AVX512VL", kLeaf7Ebx, 31, kV3},        {"LAHF/SAHF", kLeaf80000001Ecx, 0, kBaseline},
    {"LZCNT", kLeaf80000001Ecx, 5, kBaseline},
};

void EveryRequiredBit() {
  const struct {
    const char* name;
    uint32_t CpuidRegisters::*reg;
  } registers[] = {{"leaf 1 ECX", kLeaf1Ecx},
                   {"leaf 7 EBX", kLeaf7Ebx},
                   {"leaf 0x80000001 ECX", kLeaf80000001Ecx}};
  for (const auto& [name, reg] : registers) {
    for (int bit = 0; bit < 32; ++bit) {
      std::string what = std::string(name) + " bit " + std::to_string(bit);
      Isa want = Isa::kX86_64_V4;
      for (const Requirement& q : kRequirements) {
        if (q.reg == reg && q.bit == bit) {
          what += std::string(" (") + q.feature + ")";
          want = q.without;
        }
      }
      CpuidRegisters r = kCascadeLakeXeon;
      r.*reg &= ~(1u << bit);
      Check(BestIsaFor(r) == want, what + " cleared");
    }
  }
  for (int bit = 0; bit < 64; ++bit) {
    const Isa want = bit == 1 || bit == 2               ? kBaseline  // XMM, YMM
                     : bit == 5 || bit == 6 || bit == 7 ? kV3        // opmask, ZMM
                                                        : Isa::kX86_64_V4;
    CpuidRegisters r = kCascadeLakeXeon;
    r.xcr0 &= ~(uint64_t{1} << bit);
    Check(BestIsaFor(r) == want, "XCR0 bit " + std::to_string(bit) + " cleared");
  }
}

}  // namespace

int main() {
  RealCpus();
  OsSavedState();
  MaximumLeaves();
  EveryRequiredBit();
  return unit_test::Report();
}
