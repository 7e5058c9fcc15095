/*
 * launch_loop: a launch-heavy CUDA host loop for measuring what uprobes on
 * the CUDA runtime cost (cargo xtask bench). Against the stand-in
 * libcudart.so.12 with zero-length kernels, nearly all of its time is the
 * cudaLaunchKernel call itself, so a probe on it shows up in full.
 *
 *   launch_loop [COUNT] [--seconds S] [--gate]
 *
 * Launches COUNT kernels (default 1000000) on the default stream, with a
 * cudaStreamSynchronize every 1000 launches (as a real decode loop
 * synchronises once per step), then prints one JSON line:
 *   {"launches":N,"syncs":S,"seconds":T,"launches_per_s":R}
 *
 * --seconds S  launch until S seconds have passed instead (checked at every
 *              sync), so a run lasts long enough with or without probes
 * --gate       once loaded (libcudart.so.12 and libcuda.so.1 are mapped by
 *              then), print {"ready":PID} on stdout and wait for a line on
 *              stdin before the first CUDA call: a tracer started first can
 *              attach its uprobes to the libraries before anything is timed
 */
#define _GNU_SOURCE
#include "fake_cuda.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define LAUNCHES_PER_SYNC 1000

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void kernel_stub(void) {}

static int usage(const char *argv0) {
  fprintf(stderr, "usage: %s [COUNT>0] [--seconds S>0] [--gate]\n", argv0);
  return 2;
}

int main(int argc, char **argv) {
  unsigned long long count = 1000000;
  double seconds_wanted = 0.0; /* 0: run COUNT launches */
  int gate = 0;
  for (int i = 1; i < argc; i++) {
    char *end = NULL;
    if (strcmp(argv[i], "--gate") == 0) {
      gate = 1;
    } else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
      seconds_wanted = strtod(argv[++i], &end);
      if (end == argv[i] || *end != '\0' || !(seconds_wanted > 0.0))
        return usage(argv[0]);
    } else {
      count = strtoull(argv[i], &end, 10);
      if (end == argv[i] || *end != '\0' || count == 0)
        return usage(argv[0]);
    }
  }
  if (gate) {
    char line[64];
    printf("{\"ready\":%ld}\n", (long)getpid());
    fflush(stdout);
    if (fgets(line, sizeof line, stdin) == NULL) {
      fprintf(stderr, "launch_loop: stdin closed before the gate opened\n");
      return 1;
    }
  }
  /* Zero-length kernels whatever FAKECUDA_KERNEL_US says: the loop measures
   * host-side launch cost, not simulated GPU time. */
  fakecuda_set_kernel_ns(0);

  dim3 grid = {1, 1, 1}, block = {128, 1, 1};
  unsigned long long launches = 0, syncs = 0;
  double start = now_s(), seconds = 0.0;
  for (;;) {
    if (cudaLaunchKernel((const void *)kernel_stub, grid, block, NULL, 0, NULL) !=
        cudaSuccess) {
      fprintf(stderr, "cudaLaunchKernel failed at launch %llu\n", launches + 1);
      return 1;
    }
    launches++;
    int last = seconds_wanted > 0.0 ? 0 : launches == count;
    if (launches % LAUNCHES_PER_SYNC == 0 || last) {
      if (cudaStreamSynchronize(NULL) != cudaSuccess) {
        fprintf(stderr, "cudaStreamSynchronize failed\n");
        return 1;
      }
      syncs++;
      seconds = now_s() - start;
      if (last || (seconds_wanted > 0.0 && seconds >= seconds_wanted))
        break;
    }
  }
  printf("{\"launches\":%llu,\"syncs\":%llu,\"seconds\":%.6f,\"launches_per_s\":%.1f}\n",
         launches, syncs, seconds, (double)launches / seconds);
  return 0;
}
