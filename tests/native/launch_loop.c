/*
 * launch_loop: a launch-heavy CUDA host loop for measuring what uprobes on
 * the CUDA runtime cost (cargo xtask bench). Against the stand-in
 * libcudart.so.12 with zero-length kernels, nearly all of its time is the
 * cudaLaunchKernel call itself, so a probe on it shows up in full.
 *
 *   launch_loop [COUNT]        (default 1000000)
 *
 * Launches COUNT kernels on the default stream, with a
 * cudaStreamSynchronize every 1000 launches (as a real decode loop
 * synchronises once per step), then prints one JSON line:
 *   {"launches":N,"syncs":S,"seconds":T,"launches_per_s":R}
 */
#define _GNU_SOURCE
#include "fake_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define LAUNCHES_PER_SYNC 1000

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void kernel_stub(void) {}

int main(int argc, char **argv) {
  unsigned long long count = 1000000;
  if (argc > 1) {
    char *end = NULL;
    count = strtoull(argv[1], &end, 10);
    if (argc > 2 || end == argv[1] || *end != '\0' || count == 0) {
      fprintf(stderr, "usage: %s [COUNT>0]\n", argv[0]);
      return 2;
    }
  }
  /* Zero-length kernels whatever FAKECUDA_KERNEL_US says: the loop measures
   * host-side launch cost, not simulated GPU time. */
  fakecuda_set_kernel_ns(0);

  dim3 grid = {1, 1, 1}, block = {128, 1, 1};
  unsigned long long syncs = 0;
  double start = now_s();
  for (unsigned long long i = 1; i <= count; i++) {
    if (cudaLaunchKernel((const void *)kernel_stub, grid, block, NULL, 0, NULL) !=
        cudaSuccess) {
      fprintf(stderr, "cudaLaunchKernel failed at launch %llu\n", i);
      return 1;
    }
    if (i % LAUNCHES_PER_SYNC == 0 || i == count) {
      if (cudaStreamSynchronize(NULL) != cudaSuccess) {
        fprintf(stderr, "cudaStreamSynchronize failed\n");
        return 1;
      }
      syncs++;
    }
  }
  double seconds = now_s() - start;
  printf("{\"launches\":%llu,\"syncs\":%llu,\"seconds\":%.6f,\"launches_per_s\":%.1f}\n",
         count, syncs, seconds, (double)count / seconds);
  return 0;
}
