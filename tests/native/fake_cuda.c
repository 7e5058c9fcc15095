/*
 * Stand-in CUDA libraries for tests and benchmarks on machines without a GPU.
 *
 * Built twice (cargo xtask native):
 *   -DFAKECUDA_DRIVER  -> libcuda.so.1     driver API + the simulated device
 *   -DFAKECUDA_RUNTIME -> libcudart.so.12  runtime API, linked to libcuda.so.1
 *
 * The runtime is layered over the driver as NVIDIA's is, so one process has
 * one device and stream handles work with both APIs. It reaches the device
 * model through fakecuda_* entry points, never through the exported cu*
 * symbols: a cudaLaunchKernel must hit a uprobe on cudaLaunchKernel only,
 * or a tracer attached to both libraries would count every launch twice.
 *
 * The device: every stream is an in-order queue. A launch enqueues a
 * "kernel" lasting the calling thread's kernel time (fakecuda_set_kernel_ns,
 * initially FAKECUDA_KERNEL_US): it completes at
 *     max(now, the stream's previous completion) + duration,
 * so kernels run back to back like on a busy GPU. Launches only read the
 * vDSO clock and take an uncontended mutex (no system call), so a
 * launch-heavy loop measures the cost of probes on them. A synchronisation
 * sleeps in clock_nanosleep until the completion it waits for: the thread is
 * off-CPU for the GPU time, like a real sync blocked in the driver.
 *
 * Simplifications: the default stream (NULL, cudaStreamLegacy,
 * cudaStreamPerThread) is one more independent queue, it does not serialise
 * with other streams; copies happen at once on the host (the caller passes
 * host memory) and take no device time, but are ordered on their stream.
 */
#define _GNU_SOURCE
#include "fake_cuda.h"

#include <errno.h>
#include <stddef.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

/* The layouts uprobes decode, as in NVIDIA's headers (LP64). */
_Static_assert(sizeof(dim3) == 12, "dim3 is three unsigned ints");
_Static_assert(offsetof(CUlaunchConfig, hStream) == 32, "CUlaunchConfig.hStream at 32");
_Static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig is 56 bytes");
_Static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes");

/* The objects behind the opaque handles: the time their work completes,
 * CLOCK_MONOTONIC ns. Shared by both builds (the runtime allocates them,
 * the driver's device model reads and writes them). */
struct CUstream_st {
  uint64_t done_ns;
};
struct CUevent_st {
  uint64_t done_ns;
};

/* Device model, implemented by libcuda.so.1 and used by libcudart.so.12. */
uint64_t fakecuda_kernel_ns(void);
void fakecuda_enqueue(struct CUstream_st *stream, uint64_t duration_ns);
void fakecuda_sync_stream(struct CUstream_st *stream);
void fakecuda_sync_device(void);
void fakecuda_record(struct CUevent_st *event, struct CUstream_st *stream);
void fakecuda_sync_event(const struct CUevent_st *event);

#if defined(FAKECUDA_DRIVER)

static uint64_t default_kernel_ns; /* FAKECUDA_KERNEL_US, read at load */
/* UINT64_MAX: this thread has not set its own kernel time. */
static __thread uint64_t thread_kernel_ns = UINT64_MAX;

static pthread_mutex_t device_lock = PTHREAD_MUTEX_INITIALIZER;
static struct CUstream_st default_stream; /* guarded by device_lock */
static uint64_t device_done_ns;           /* latest completion, all streams */

__attribute__((constructor)) static void fakecuda_load(void) {
  const char *us = getenv("FAKECUDA_KERNEL_US");
  if (us != NULL && *us != '\0') {
    char *end = NULL;
    unsigned long long v = strtoull(us, &end, 10);
    if (end != NULL && *end == '\0')
      default_kernel_ns = (uint64_t)v * 1000u;
  }
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Blocks off-CPU until CLOCK_MONOTONIC reaches deadline_ns; returns at once
 * (without a system call) when the work is already complete. */
static void sleep_until(uint64_t deadline_ns) {
  if (deadline_ns <= now_ns())
    return;
  struct timespec ts = {
      .tv_sec = (time_t)(deadline_ns / 1000000000u),
      .tv_nsec = (long)(deadline_ns % 1000000000u),
  };
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
  }
}

/* NULL, cudaStreamLegacy (0x1) and cudaStreamPerThread (0x2) name the
 * default stream; anything else is a stream cudaStreamCreate made. */
static struct CUstream_st *lane(struct CUstream_st *stream) {
  return (uintptr_t)stream <= 2 ? &default_stream : stream;
}

EXPORT void fakecuda_set_kernel_ns(uint64_t ns) { thread_kernel_ns = ns; }

EXPORT uint64_t fakecuda_kernel_ns(void) {
  return thread_kernel_ns == UINT64_MAX ? default_kernel_ns : thread_kernel_ns;
}

EXPORT void fakecuda_enqueue(struct CUstream_st *stream, uint64_t duration_ns) {
  struct CUstream_st *s = lane(stream);
  uint64_t now = now_ns();
  pthread_mutex_lock(&device_lock);
  s->done_ns = (s->done_ns > now ? s->done_ns : now) + duration_ns;
  if (s->done_ns > device_done_ns)
    device_done_ns = s->done_ns;
  pthread_mutex_unlock(&device_lock);
}

EXPORT void fakecuda_sync_stream(struct CUstream_st *stream) {
  struct CUstream_st *s = lane(stream);
  pthread_mutex_lock(&device_lock);
  uint64_t done = s->done_ns;
  pthread_mutex_unlock(&device_lock);
  sleep_until(done);
}

EXPORT void fakecuda_sync_device(void) {
  pthread_mutex_lock(&device_lock);
  uint64_t done = device_done_ns;
  pthread_mutex_unlock(&device_lock);
  sleep_until(done);
}

EXPORT void fakecuda_record(struct CUevent_st *event, struct CUstream_st *stream) {
  struct CUstream_st *s = lane(stream);
  pthread_mutex_lock(&device_lock);
  event->done_ns = s->done_ns;
  pthread_mutex_unlock(&device_lock);
}

EXPORT void fakecuda_sync_event(const struct CUevent_st *event) {
  pthread_mutex_lock(&device_lock);
  uint64_t done = event->done_ns;
  pthread_mutex_unlock(&device_lock);
  sleep_until(done);
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX,
                               unsigned int gridDimY, unsigned int gridDimZ,
                               unsigned int blockDimX, unsigned int blockDimY,
                               unsigned int blockDimZ, unsigned int sharedMemBytes,
                               CUstream hStream, void **kernelParams, void **extra) {
  (void)f, (void)gridDimX, (void)gridDimY, (void)gridDimZ, (void)blockDimX,
      (void)blockDimY, (void)blockDimZ, (void)sharedMemBytes, (void)kernelParams,
      (void)extra;
  fakecuda_enqueue(hStream, fakecuda_kernel_ns());
  return CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f,
                                 void **kernelParams, void **extra) {
  (void)f, (void)kernelParams, (void)extra;
  if (config == NULL)
    return CUDA_ERROR_INVALID_VALUE;
  fakecuda_enqueue(config->hStream, fakecuda_kernel_ns());
  return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream hStream) {
  fakecuda_sync_stream(hStream);
  return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize(void) {
  fakecuda_sync_device();
  return CUDA_SUCCESS;
}

#elif defined(FAKECUDA_RUNTIME)

EXPORT cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim,
                                    void **args, size_t sharedMem,
                                    cudaStream_t stream) {
  (void)func, (void)gridDim, (void)blockDim, (void)args, (void)sharedMem;
  fakecuda_enqueue(stream, fakecuda_kernel_ns());
  return cudaSuccess;
}

/* A graph replays as one unit of work of the thread's kernel time. */
EXPORT cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
  (void)graphExec;
  fakecuda_enqueue(stream, fakecuda_kernel_ns());
  return cudaSuccess;
}

EXPORT cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                   enum cudaMemcpyKind kind, cudaStream_t stream) {
  if (kind > cudaMemcpyDefault || (count > 0 && (dst == NULL || src == NULL)))
    return cudaErrorInvalidValue;
  memmove(dst, src, count);
  fakecuda_enqueue(stream, 0);
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  fakecuda_sync_stream(stream);
  return cudaSuccess;
}

EXPORT cudaError_t cudaDeviceSynchronize(void) {
  fakecuda_sync_device();
  return cudaSuccess;
}

EXPORT cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (event == NULL)
    return cudaErrorInvalidValue;
  fakecuda_sync_event(event);
  return cudaSuccess;
}

EXPORT cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
  if (pStream == NULL)
    return cudaErrorInvalidValue;
  *pStream = calloc(1, sizeof(struct CUstream_st));
  return *pStream == NULL ? cudaErrorInvalidValue : cudaSuccess;
}

EXPORT cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if ((uintptr_t)stream <= 2)
    return cudaErrorInvalidValue;
  free(stream);
  return cudaSuccess;
}

EXPORT cudaError_t cudaEventCreate(cudaEvent_t *event) {
  if (event == NULL)
    return cudaErrorInvalidValue;
  *event = calloc(1, sizeof(struct CUevent_st));
  return *event == NULL ? cudaErrorInvalidValue : cudaSuccess;
}

EXPORT cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == NULL)
    return cudaErrorInvalidValue;
  fakecuda_record(event, stream);
  return cudaSuccess;
}

EXPORT cudaError_t cudaEventDestroy(cudaEvent_t event) {
  free(event);
  return cudaSuccess;
}

#else
#error "build with -DFAKECUDA_DRIVER (libcuda.so.1) or -DFAKECUDA_RUNTIME (libcudart.so.12)"
#endif
