// Unit test of csrc/cuda/grid_steps.h, the step loop of the CUDA kernels that spread each step
// over the whole GPU, on any machine: every GPU thread of a launch runs as a host thread (the
// block barrier a std::barrier, the async copies plain copies, the mbarriers and the row
// tiles' counters atomics, a warp's mma.sync from PTX's fragment layouts), over a grid of
// flags, activations, tiles (products on the FMA lanes and on the tensor cores) and sizes that
// leave partial tiles and chunks, against a double-precision loop of the spec
// (docs/semantics.md). It checks the kernels' indexing, time order, masks, lengths and
// hand-over; not the GPU's memory ordering or timing, which need a GPU (tests/test_cuda.py,
// tests/cpp/cuda_sanitize.cu). Built and run by tests/test_cpp_units.py; prints each failed
// check and exits non-zero.
#include "cuda/grid_steps.h"

#include "checks.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace sgrnn;
using namespace sgrnn::cuda;
using unit_test::Check;

// A warp's registers as its mma instructions see them: each lane's fragments.
struct WarpExchange {
  std::barrier<> barrier{32};
  std::array<std::array<float, 32>, 32> a;  // per lane: MT x 4 values of A
  std::array<std::array<float, 8>, 32> b;   // per lane: NT x 2 values of B
};

thread_local std::barrier<>* block_barrier = nullptr;
thread_local WarpExchange* warp_exchange = nullptr;
thread_local int lane_id = 0;

// What the tensor cores read of a float32 register given as tf32: its top 19 bits.
float AsTf32(float x) { return std::bit_cast<float>(std::bit_cast<uint32_t>(x) & 0xffffe000u); }

// grid_steps.h's machine interface, for host threads.
struct HostMachine {
  static void Sync() { block_barrier->arrive_and_wait(); }
  static void CopyAsync16(float* to, const float* from) { std::memcpy(to, from, 16); }
  // An mbarrier as 64 bits: its completed phases (the high 32), the arrivals a phase expects
  // (bits 16-31) and those still to come (the low 16). Copies land at once, so ArriveOnCopies
  // arrives at once.
  static void InitBarrier(uint64_t* bar, int count) {
    *bar = static_cast<uint64_t>(count) << 16 | static_cast<uint64_t>(count);
  }
  static void ArriveOnCopies(uint64_t* bar) { ArriveOn(bar); }
  static void Release(uint64_t* bar) { ArriveOn(bar); }
  static void WaitPhase(uint64_t* bar, uint32_t parity) {
    while ((std::atomic_ref<uint64_t>(*bar).load(std::memory_order_acquire) >> 32 & 1) == parity) {
      std::this_thread::yield();
    }
  }
  static void ArriveOn(uint64_t* bar) {
    std::atomic_ref<uint64_t> b(*bar);
    uint64_t seen = b.load(std::memory_order_relaxed), next;
    do {
      const uint64_t count = seen >> 16 & 0xffff, left = (seen & 0xffff) - 1;
      next = left > 0 ? (seen & ~uint64_t{0xffff}) | left
                      : ((seen >> 32) + 1) << 32 | count << 16 | count;
    } while (!b.compare_exchange_weak(seen, next, std::memory_order_acq_rel,
                                      std::memory_order_relaxed));
  }
  static void Arrive(uint32_t* counter) {
    std::atomic_ref<uint32_t>(*counter).fetch_add(1, std::memory_order_release);
  }
  static void WaitFor(uint32_t* counter, uint32_t value) {
    while (std::atomic_ref<uint32_t>(*counter).load(std::memory_order_acquire) < value) {
      std::this_thread::yield();
    }
  }
  // mma.sync m16n8k8 from the PTX ISA's tf32 fragment layouts: lane 4g + t holds A's (g, t),
  // (g + 8, t), (g, t + 4), (g + 8, t + 4) and B's (t, g), (t + 4, g), and gets C's (g, 2t),
  // (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1); each product as the GPU's three of tf32 values.
  template <int MT, int NT>
  static void WarpMultiplyAdd(float (&acc)[MT][NT][4], const float (&a)[MT][4],
                              const float (&b)[NT][2]) {
    static_assert(MT * 4 <= 32 && NT * 2 <= 8);
    WarpExchange& x = *warp_exchange;
    for (int m = 0; m < MT; ++m) std::copy_n(a[m], 4, &x.a[lane_id][m * 4]);
    for (int n = 0; n < NT; ++n) std::copy_n(b[n], 2, &x.b[lane_id][n * 2]);
    x.barrier.arrive_and_wait();
    const int g = lane_id / 4, t = lane_id % 4;
    for (int m = 0; m < MT; ++m) {
      for (int n = 0; n < NT; ++n) {
        for (int i = 0; i < 4; ++i) {
          const int row = g + 8 * (i / 2), column = 2 * t + i % 2;
          float terms[3] = {};  // the three mma's: small x big, big x small, big x big
          for (int k = 0; k < 8; ++k) {
            const Tf32Split p = SplitTf32(x.a[row % 8 * 4 + k % 4][m * 4 + row / 8 + 2 * (k / 4)]);
            const Tf32Split q = SplitTf32(x.b[column * 4 + k % 4][n * 2 + k / 4]);
            terms[0] += AsTf32(p.small) * AsTf32(q.big);
            terms[1] += AsTf32(p.big) * AsTf32(q.small);
            terms[2] += AsTf32(p.big) * AsTf32(q.big);
          }
          for (float term : terms) acc[m][n][i] += term;
        }
      }
    }
    x.barrier.arrive_and_wait();  // every lane has read the fragments before any writes again
  }
};

// Runs body(block, thread, shared) for every thread of `blocks` blocks at once, each block with
// its own shared memory (filled with NaN: what the kernels read must have been written).
template <typename Body>
void Launch(int64_t blocks, int64_t shared_bytes, Body body) {
  constexpr int kWarps = kGridThreads / 32;
  std::vector<std::unique_ptr<std::barrier<>>> barriers;
  std::vector<std::unique_ptr<WarpExchange[]>> warps;
  std::vector<std::vector<float>> shared(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    barriers.push_back(std::make_unique<std::barrier<>>(kGridThreads));
    warps.push_back(std::make_unique<WarpExchange[]>(kWarps));
    shared[b].assign(shared_bytes / sizeof(float), std::nanf(""));
  }
  std::vector<std::thread> threads;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int t = 0; t < kGridThreads; ++t) {
      threads.emplace_back([&, b, t] {
        block_barrier = barriers[b].get();
        warp_exchange = &warps[b][t / 32];
        lane_id = t % 32;
        body(static_cast<int>(b), t, shared[b].data());
      });
    }
  }
  for (std::thread& t : threads) t.join();
}

struct Case {
  Config c;
  Dims d;
  GridTileShape tile;
  bool tensor_cores, mask, lengths;

  std::string Name() const {
    return "T=" + std::to_string(d.T) + " N=" + std::to_string(d.N) + " H=" +
           std::to_string(d.H) + " D=" + std::to_string(d.D) + " tile " +
           std::to_string(tile.rows) + "x" + std::to_string(tile.units) +
           (tensor_cores ? " tensor cores" : "") + " act " +
           std::to_string(static_cast<int>(c.activation)) + (c.reverse ? " reverse" : "") +
           (c.has_init_state ? " h0" : "") + (mask ? " mask" : "") + (lengths ? " lengths" : "");
  }
};

struct Inputs {
  std::vector<float> x, R, h0, mask, dy;
  std::vector<int32_t> lengths;
};

// The spec's forward for one call, in double: y and z [T, N, D*H].
template <Activation A>
void ReferenceForward(const Case& k, const Inputs& in, std::vector<double>& y,
                      std::vector<double>& z) {
  const Dims& d = k.d;
  const int64_t DH = d.D * d.H;
  y.assign(d.T * d.N * DH, 0.0);
  z.assign(d.T * d.N * DH, 0.0);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    const bool read_reversed = dir == 1 || (k.c.reverse && !k.c.bidirectional);
    const bool store_flipped = dir == 1;
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t L = k.lengths ? std::clamp<int64_t>(in.lengths[n], 0, d.T) : d.T;
      std::vector<double> h(d.H, 0.0), next(d.H);
      if (k.c.has_init_state) {
        for (int64_t j = 0; j < d.H; ++j) h[j] = in.h0[n * DH + dir * d.H + j];
      }
      for (int64_t s = 0; s < L; ++s) {
        const int64_t in_time = read_reversed ? L - 1 - s : s;
        const int64_t slot = store_flipped ? L - 1 - s : s;
        for (int64_t j = 0; j < d.H; ++j) {
          double sum = in.x[(in_time * d.N + n) * DH + dir * d.H + j];
          for (int64_t i = 0; i < d.H; ++i) {
            const double m = k.mask ? in.mask[(s * d.N + n) * DH + dir * d.H + i] : 1.0;
            sum += static_cast<double>(in.R[(dir * d.H + j) * d.H + i]) * h[i] * m;
          }
          z[(slot * d.N + n) * DH + dir * d.H + j] = sum;
          next[j] = Activate<A>(sum);
          y[(slot * d.N + n) * DH + dir * d.H + j] = next[j];
        }
        h.swap(next);
      }
    }
  }
}

// Backpropagation of sum(y * dy) through the spec's forward, in double, with z as given:
// d_source [T, N, D*H] (in source time) and dh0 [N, D*H].
template <Activation A>
void ReferenceGradients(const Case& k, const Inputs& in, const std::vector<float>& z,
                        std::vector<double>& d_source, std::vector<double>& dh0) {
  const Dims& d = k.d;
  const int64_t DH = d.D * d.H;
  d_source.assign(d.T * d.N * DH, 0.0);
  dh0.assign(d.N * DH, 0.0);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    const bool read_reversed = dir == 1 || (k.c.reverse && !k.c.bidirectional);
    const bool store_flipped = dir == 1;
    for (int64_t n = 0; n < d.N; ++n) {
      const int64_t L = k.lengths ? std::clamp<int64_t>(in.lengths[n], 0, d.T) : d.T;
      std::vector<double> later(d.H, 0.0), dz(d.H);  // later: d/dh_s from steps after s
      for (int64_t s = L - 1; s >= 0; --s) {
        const int64_t in_time = read_reversed ? L - 1 - s : s;
        const int64_t slot = store_flipped ? L - 1 - s : s;
        for (int64_t j = 0; j < d.H; ++j) {
          const int64_t at = (slot * d.N + n) * DH + dir * d.H + j;
          dz[j] = (in.dy[at] + later[j]) * ActivateGrad<A>(z[at]);
          d_source[(in_time * d.N + n) * DH + dir * d.H + j] = dz[j];
        }
        for (int64_t i = 0; i < d.H; ++i) {
          double sum = 0.0;
          for (int64_t j = 0; j < d.H; ++j) sum += dz[j] * in.R[(dir * d.H + j) * d.H + i];
          const double m = k.mask ? in.mask[(s * d.N + n) * DH + dir * d.H + i] : 1.0;
          later[i] = sum * m;
        }
      }
      for (int64_t i = 0; i < d.H; ++i) dh0[n * DH + dir * d.H + i] = later[i];
    }
  }
}

template <typename Got>
void Compare(const Got& got, const std::vector<double>& want, const std::string& what) {
  double worst = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double error = std::abs(got[i] - want[i]) / (1.0 + std::abs(want[i]));
    worst = std::isnan(error) ? INFINITY : std::max(worst, error);
  }
  Check(worst < 2e-5, what + ": worst relative error " + std::to_string(worst));
}

// DispatchGridTile for the case's tile and products.
template <typename F>
void DispatchCaseTile(const Case& k, F&& f) {
  if (k.tensor_cores) {
    DispatchGridTile<true>(k.tile, f);
  } else {
    DispatchGridTile(k.tile, f);
  }
}

template <Activation A>
void Run(const Case& k, std::mt19937& rng) {
  const Dims& d = k.d;
  const int64_t DH = d.D * d.H;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const float scale = 0.5f / std::sqrt(static_cast<float>(d.H));
  Inputs in;
  in.x.resize(d.T * d.N * DH);
  in.R.resize(d.D * d.H * d.H);
  in.h0.resize(d.N * DH);
  in.mask.resize(d.T * d.N * DH);
  in.dy.resize(d.T * d.N * DH);
  in.lengths.resize(d.N);
  for (float& v : in.x) v = normal(rng);
  for (float& v : in.R) v = scale * normal(rng);
  for (float& v : in.h0) v = 0.5f * normal(rng);
  for (float& v : in.dy) v = normal(rng);
  const float mask_values[] = {0.0f, 1.0f, 1.0f, 0.5f};
  for (float& v : in.mask) v = mask_values[rng() % 4];
  for (int32_t& v : in.lengths) v = static_cast<int32_t>(rng() % (d.T + 2)) - 1;  // -1 .. T

  const GridPlan plan = GridPlanOf(d.H, d.N, k.tile);
  const MaskView<float> mask = k.mask ? MaskView<float>(in.mask.data(), d.T, d.N, DH)
                                      : MaskView<float>();
  const int32_t* lengths = k.lengths ? in.lengths.data() : nullptr;
  std::vector<char> workspace(plan.WorkspaceBytes(d.D));
  const auto run_directions = [&](auto&& body) {
    std::fill(workspace.begin(), workspace.end(), 0);
    const GridWorkspace w(workspace.data(), plan, d.D);
    for (int direction = 0; direction < d.D; ++direction) {
      const GridGeometry g = GridGeometryOf(d, plan, direction);
      Launch(plan.blocks(), plan.shared_bytes, [&](int block, int thread, float* shared) {
        body(g, w.states, w.CountersOf(plan, direction), block, thread, shared);
      });
    }
  };

  std::vector<float> y(d.T * d.N * DH, std::nanf("")), z(y);
  const ForwardArgs<float> forward{in.x.data(), in.R.data(),
                                   k.c.has_init_state ? in.h0.data() : nullptr, mask, lengths,
                                   y.data(), z.data()};
  DispatchCaseTile(k, [&]<typename Tile>() {
    run_directions([&](const GridGeometry& g, float* states, uint32_t* counters, int block,
                       int thread, float* shared) {
      GridForwardSteps<A, Tile, HostMachine>(k.c, g, forward, states, counters, block, thread,
                                             shared);
    });
  });
  std::vector<double> y_want, z_want;
  ReferenceForward<A>(k, in, y_want, z_want);
  Compare(y, y_want, k.Name() + ": y");
  Compare(z, z_want, k.Name() + ": z");

  std::vector<float> z_given(z_want.begin(), z_want.end());
  std::vector<float> d_source(d.T * d.N * DH, std::nanf("")), dh0(d.N * DH, std::nanf(""));
  const GradientArgs<float> gradients{in.R.data(), in.dy.data(), z_given.data(), mask, lengths,
                                      d_source.data(), dh0.data()};
  DispatchCaseTile(k, [&]<typename Tile>() {
    run_directions([&](const GridGeometry& g, float* states, uint32_t* counters, int block,
                       int thread, float* shared) {
      GridGradientSteps<A, Tile, HostMachine>(k.c, g, gradients, states, counters, block,
                                              thread, shared);
    });
  });
  std::vector<double> d_source_want, dh0_want;
  ReferenceGradients<A>(k, in, z_given, d_source_want, dh0_want);
  Compare(d_source, d_source_want, k.Name() + ": dz");
  Compare(dh0, dh0_want, k.Name() + ": dh0");
}

// Sizes that leave partial row tiles, unit tiles and chunks, more chunks than stages (H = 300),
// one row, and each tile shape, with the products on the FMA lanes and on the tensor cores; per
// size, flags from plain to every option.
#if defined(__SANITIZE_THREAD__)
constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
constexpr bool kThreadSanitizer = __has_feature(thread_sanitizer);
#else
constexpr bool kThreadSanitizer = false;
#endif

void StepLoopsMatchTheSpec() {
  struct Size {
    int64_t T, N, H;
    GridTileShape tile;
  };
  const Size sizes[] = {{4, 70, 40, {64, 32}}, {3, 2, 300, {64, 32}}, {3, 130, 20, {128, 16}},
                        {5, 3, 33, {64, 16}},  {3, 129, 9, {128, 8}},  {6, 1, 70, {64, 32}},
                        {4, 40, 50, {32, 32}}};
  std::mt19937 rng(7);
  int variant = 0;
  for (const bool tensor_cores : {false, true}) {
    for (size_t at = 0; at < std::size(sizes); ++at) {
      const Size& s = sizes[at];
      for (int flags = 0; flags < 4; ++flags, ++variant) {
        // ThreadSanitizer makes the emulation about 20 times slower. The tensor-core form
        // shares the barriers and counters that the FMA form's cases check. So, under it, the
        // tensor-core form runs one flag set for each size. Every tile shape still runs.
        if (tensor_cores && kThreadSanitizer && flags != static_cast<int>(at % 4)) continue;
        Config c{};
        c.activation = static_cast<Activation>(variant % kActivationCount);
        c.bidirectional = flags >= 2;
        c.reverse = flags == 1;
        c.training = true;
        c.has_init_state = flags != 3;
        const bool masked = flags % 2 == 1, lengths = flags >= 1;
        c.has_mask = masked;
        c.has_seq_lengths = lengths;
        const Case k{c, Dims{s.T, s.N, s.H, s.H, c.directions()}, s.tile, tensor_cores, masked,
                     lengths};
        DispatchActivation(c.activation, [&]<Activation A>() { Run<A>(k, rng); });
      }
    }
  }
}

// The parts' sums at a step's end: each warp's 16-byte stores, 8 lanes a cycle, and its 4-byte
// loads, 32 lanes a cycle, meet every bank at most once (GridTile::SumIndex).
template <typename Tile>
void SumsMeetEachBankOnce(const std::string& name) {
  constexpr int kChunk = kGridChunk;
  const GridGeometry g{1, Tile::BM, Tile::BN, 1, 0, 1, kChunk, Tile::BM * kChunk};
  std::vector<float> shared(GridSharedBytes(kGridChunk, {Tile::BM, Tile::BN}) / sizeof(float));
  bool stores_once = true, loads_once = true;
  for (int warp = 0; warp < Tile::kThreads / 32; ++warp) {
    std::vector<GridBlock<Tile>> lanes;
    for (int lane = 0; lane < 32; ++lane) lanes.emplace_back(g, 0, warp * 32 + lane, shared.data());
    for (int i = 0; i < Tile::TM; ++i) {
      for (int v = 0; v < Tile::kUnitVectors; ++v) {
        for (int phase = 0; phase < 4; ++phase) {
          std::vector<int> quads;  // the 4-bank group each of the phase's 8 lanes stores to
          for (int lane = phase * 8; lane < phase * 8 + 8; ++lane) {
            const GridBlock<Tile>& b = lanes[lane];
            const int at = Tile::SumIndex(b.row_group + i * Tile::kRowGroups,
                                          Tile::UnitOf(b.unit_group, 4 * v));
            quads.push_back(at / 4 % 8);
          }
          std::sort(quads.begin(), quads.end());
          stores_once &= std::adjacent_find(quads.begin(), quads.end()) == quads.end();
        }
      }
    }
    for (int e = 0; e < Tile::kOutputs; ++e) {
      std::vector<int> banks;
      for (const GridBlock<Tile>& b : lanes) {
        banks.push_back(Tile::SumIndex(b.OutputRow(e), b.OutputUnit(e)) % 32);
      }
      std::sort(banks.begin(), banks.end());
      loads_once &= std::adjacent_find(banks.begin(), banks.end()) == banks.end();
    }
  }
  Check(stores_once, name + ": the sums' stores meet each bank once a phase");
  Check(loads_once, name + ": the sums' loads meet each bank once a warp");
}

void SumsOfEveryTileMeetEachBankOnce() {
  for (const GridTileShape& tile : kGridTiles) {
    DispatchGridTile(tile, [&]<typename Tile>() {
      SumsMeetEachBankOnce<Tile>(std::to_string(tile.rows) + " x " + std::to_string(tile.units));
    });
  }
}

// Whether the lanes' indices of 4-byte words (or of 8-byte words, halved) meet each bank once.
bool EachBankOnce(std::vector<int> banks) {
  std::sort(banks.begin(), banks.end());
  return std::adjacent_find(banks.begin(), banks.end()) == banks.end();
}

// The tensor-core tiles' shared-memory accesses meet each bank once: a warp's loads of A's
// fragments from a chunk (rows kStride apart) and of B's from R_units, a 4-byte word a lane;
// its 8-byte stores of the parts' sums, 16 lanes a phase; the owners' loads of the sums. And
// Swizzled permutes each line's units.
template <typename Tile>
void TensorTileMeetsEachBankOnce(const std::string& name) {
  bool a_once = true, b_once = true, stores_once = true, loads_once = true, permutes = true;
  for (int part = 0; part < Tile::KS; ++part) {
    const int entry0 = 3 * Tile::KC + part * Tile::kPartEntries;  // any chunk
    for (int i = 0; i < 4; ++i) {
      for (int m = 0; m < Tile::MT; ++m) {
        std::vector<int> banks;
        for (int lane = 0; lane < 32; ++lane) {
          const int row = m * 16 + lane / 4 + 8 * (i % 2);
          const int entry = part * Tile::kPartEntries + lane % 4 + 4 * (i / 2);
          banks.push_back((row * Tile::kStride + entry) % 32);
        }
        a_once &= EachBankOnce(banks);
      }
      for (int n = 0; n < Tile::NT && i < 2; ++n) {
        std::vector<int> banks;
        for (int lane = 0; lane < 32; ++lane) {
          banks.push_back(Tile::Swizzled(entry0 + lane % 4 + 4 * i, n * 8 + lane / 4) % 32);
        }
        b_once &= EachBankOnce(banks);
      }
    }
    for (int m = 0; m < Tile::MT; ++m) {
      for (int n = 0; n < Tile::NT; ++n) {
        for (int half = 0; half < 2; ++half) {
          for (int phase = 0; phase < 2; ++phase) {
            std::vector<int> pairs;
            for (int lane = phase * 16; lane < phase * 16 + 16; ++lane) {
              const int row = m * 16 + lane / 4 + 8 * half, unit = n * 8 + 2 * (lane % 4);
              pairs.push_back(Tile::SumIndex(row, unit) / 2 % 16);
            }
            stores_once &= EachBankOnce(pairs);
          }
        }
      }
    }
  }
  for (int warp = 0; warp < Tile::kThreads / 32; ++warp) {
    for (int e = 0; e < Tile::kOutputs; ++e) {
      std::vector<int> banks;
      for (int lane = 0; lane < 32; ++lane) {
        const int v = warp * 32 + lane + e * Tile::kThreads;
        banks.push_back(Tile::SumIndex(v / Tile::BN, v % Tile::BN) % 32);
      }
      loads_once &= EachBankOnce(banks);
    }
  }
  for (int line = 0; line < 16; ++line) {
    std::vector<int> at;
    for (int u = 0; u < Tile::BN; ++u) at.push_back(Tile::Swizzled(line, u) - line * Tile::BN);
    std::sort(at.begin(), at.end());
    for (int u = 0; u < Tile::BN; ++u) permutes &= at[u] == u;
    permutes &= Tile::Swizzled(line + 4, 5 % Tile::BN) == Tile::Swizzled(line, 5 % Tile::BN) +
                                                          4 * Tile::BN;
  }
  Check(a_once, name + ": A's fragments meet each bank once");
  Check(b_once, name + ": B's fragments meet each bank once");
  Check(stores_once, name + ": the sums' stores meet each bank once a phase");
  Check(loads_once, name + ": the sums' loads meet each bank once a warp");
  Check(permutes, name + ": Swizzled permutes each line's units, repeating every 4 lines");
}

void TensorTilesMeetEachBankOnce() {
  for (const GridTileShape& tile : kGridTiles) {
    DispatchGridTile<true>(tile, [&]<typename Tile>() {
      TensorTileMeetsEachBankOnce<Tile>(std::to_string(tile.rows) + " x " +
                                        std::to_string(tile.units) + " (tensor cores)");
    });
  }
}

// SplitTf32: big is tf32 and big + small is x; what the tensor cores read of small (its top 19
// bits) leaves under 2^-22 |x|; infinities are all big, NaN stays in small.
void SplitsAreTf32() {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> significand(1.0f, 2.0f);
  bool tf32 = true, exact = true, close = true;
  for (int i = 0; i < 100000; ++i) {
    const float x = std::ldexp(significand(rng), static_cast<int>(rng() % 60) - 30) *
                    (rng() % 2 ? 1.0f : -1.0f);
    const Tf32Split s = SplitTf32(x);
    tf32 &= (std::bit_cast<uint32_t>(s.big) & 0x1fffu) == 0;
    exact &= s.big + s.small == x;
    close &= std::abs(static_cast<double>(x) - s.big - AsTf32(s.small)) <=
             std::ldexp(std::abs(x), -22);
  }
  Check(tf32, "SplitTf32: big is tf32");
  Check(exact, "SplitTf32: big + small is x");
  Check(close, "SplitTf32: big and small's tf32 within 2^-22 |x| of x");
  const Tf32Split inf = SplitTf32(-INFINITY);
  Check(inf.big == -INFINITY && inf.small == 0.0f, "SplitTf32: an infinity is all big");
  for (const uint32_t bits : {0x7fffffffu, 0x7fc00000u, 0xffffffffu}) {
    Check(std::isnan(SplitTf32(std::bit_cast<float>(bits)).small), "SplitTf32: NaN in small");
  }
}

// The plan: the first tile whose blocks all fit the device at once, float32 only.
void GridPlans() {
  const auto plan = [](int64_t H, int64_t N, int64_t bytes = 4) {
    return PlanGrid(H, N, bytes, 132, 227 * 1024);
  };
  const std::optional<GridPlan> large = plan(1024, 256);
  Check(large && large->tile.rows == 64 && large->tile.units == 32 && large->blocks() == 128 &&
            large->padded_hidden == 1024,
        "(N=256, H=1024): 4 x 32 tiles of 64 x 32");
  Check(large && large->shared_bytes == 4 * (1024 * 32 + 4 * 64 * 68) + 8 * 2 * 4 + 4 * 64,
        "(N=256, H=1024): shared memory");
  const std::optional<GridPlan> wide = plan(2048, 64);
  Check(wide && wide->tile.rows == 64 && wide->tile.units == 16 && wide->blocks() == 128,
        "(N=64, H=2048): tiles of 64 x 16 (R's 32 units take 256 KB)");
  const std::optional<GridPlan> few = plan(1024, 100);
  Check(few && few->tile.rows == 32 && few->tile.units == 32 && few->blocks() == 128,
        "(N=100, H=1024): 4 x 32 tiles of 32 x 32 (half a 64-row tile's work a block)");
  Check(!plan(1024, 512), "(N=512, H=1024): more tiles than SMs");
  Check(!plan(1024, 256, 8), "float64: none");
  const std::optional<GridPlan> odd = plan(700, 300);
  Check(odd && odd->padded_hidden == 704 && odd->row_tiles == 5 && odd->unit_tiles == 22,
        "(N=300, H=700): 5 x 22 tiles, rows padded to 704 entries");
  Check(odd && odd->WorkspaceBytes(2) == 48 + 2 * 5 * 64 * 704 * 4,
        "(N=300, H=700): workspace (10 counters in 48 bytes, then the state buffers)");
}

}  // namespace

int main() {
  GridPlans();
  SumsOfEveryTileMeetEachBankOnce();
  TensorTilesMeetEachBankOnce();
  SplitsAreTf32();
  StepLoopsMatchTheSpec();
  return unit_test::Report();
}
