// This machine's peak float32 FMA rate, the physical ceiling that docs/performance.md's CPU
// floors are stated against: per thread 12 independent chains of 16-float FMAs (enough to hide
// the FMA latency on every x86 core of the last decade), one thread per core.
//
//   gcc -O2 -march=native benchmarks/peak_fma.c -o peak_fma -lpthread && ./peak_fma 2
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef float Vec16 __attribute__((vector_size(64)));  // one zmm, or two ymm on AVX2
enum { kChains = 12 };
static const long kIterations = 20000000;  // per chain

static double Seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void* Chains(void* out) {
  Vec16 acc[kChains];
  const Vec16 scale = {0}, shift = {0};  // overwritten below, so the compiler cannot fold
  Vec16 m = scale + 0.999999f, c = shift + 1e-7f;
  for (int i = 0; i < kChains; ++i) acc[i] = m * (float)i;
  for (long k = 0; k < kIterations; ++k) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * m + c;  // contracted to one FMA
  }
  float sum = 0;
  for (int i = 0; i < kChains; ++i) {
    for (int e = 0; e < 16; ++e) sum += acc[i][e];
  }
  *(float*)out = sum;  // keeps the chains alive
  return NULL;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  if (threads < 1 || threads > 256) return fprintf(stderr, "threads: 1 to 256\n"), 2;
  pthread_t* ids = malloc(threads * sizeof(pthread_t));
  float* sums = malloc(threads * sizeof(float));
  for (int round = 0; round < 3; ++round) {
    const double start = Seconds();
    for (int t = 0; t < threads; ++t) pthread_create(&ids[t], NULL, Chains, &sums[t]);
    for (int t = 0; t < threads; ++t) pthread_join(ids[t], NULL);
    const double flops = 2.0 * 16 * kChains * kIterations * threads;
    printf("%d thread(s): %.1f GFLOP/s (check %g)\n", threads,
           flops / (Seconds() - start) / 1e9, sums[0]);
  }
  free(ids);
  free(sums);
  return 0;
}
