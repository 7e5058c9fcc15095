/*
 * fake_cuda.h - the slice of the CUDA runtime (cuda_runtime_api.h) and
 * driver (cuda.h) API that the stand-in libraries implement, with the real
 * symbol names, signatures and type layouts, so a uprobe written against
 * the stand-in reads arguments exactly where it would in NVIDIA's libraries.
 *
 * Where the agent finds the stream argument on x86-64 (SysV ABI), at entry:
 *   cudaLaunchKernel  dim3 (12 bytes) travels in two registers each: func rdi,
 *                     gridDim rsi+rdx, blockDim rcx+r8, args r9; sharedMem
 *                     at [rsp+8], stream at [rsp+16]
 *   cudaGraphLaunch   stream rsi          cudaMemcpyAsync   stream r8
 *   cudaStreamSynchronize stream rdi      cudaEventSynchronize event rdi
 *   cuLaunchKernel    f rdi, grid/block x..y in rsi,rdx,rcx,r8,r9;
 *                     blockDimZ [rsp+8], sharedMemBytes [rsp+16],
 *                     hStream [rsp+24], kernelParams [rsp+32], extra [rsp+40]
 *   cuLaunchKernelEx  config rdi; config->hStream at offset 32
 *   cuStreamSynchronize hStream rdi
 */
#ifndef FAKE_CUDA_H
#define FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

/* ---- runtime API (libcudart.so.12) ---- */

typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1 } cudaError_t;

typedef struct dim3 {
  unsigned int x, y, z;
} dim3;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;

cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim,
                             void **args, size_t sharedMem, cudaStream_t stream);
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                            enum cudaMemcpyKind kind, cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
/* What makes the synchronisations above meaningful: */
cudaError_t cudaStreamCreate(cudaStream_t *pStream);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventDestroy(cudaEvent_t event);

/* ---- driver API (libcuda.so.1) ---- */

typedef enum cudaError_enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1
} CUresult;

typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;

/* CUlaunchAttribute: an id, padding to 8, a 64-byte value union. */
typedef struct CUlaunchAttribute_st {
  int id;
  char pad[8 - sizeof(int)];
  union {
    char pad[64];
  } value;
} CUlaunchAttribute;

typedef struct CUlaunchConfig_st {
  unsigned int gridDimX;
  unsigned int gridDimY;
  unsigned int gridDimZ;
  unsigned int blockDimX;
  unsigned int blockDimY;
  unsigned int blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream; /* offset 32 on LP64 */
  CUlaunchAttribute *attrs;
  unsigned int numAttrs;
} CUlaunchConfig;

CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                        unsigned int gridDimZ, unsigned int blockDimX,
                        unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra);
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f,
                          void **kernelParams, void **extra);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuCtxSynchronize(void);

/* ---- stand-in only (libcuda.so.1; libcudart.so.12 depends on it, so a
 * program or a ctypes handle of either library reaches it) ---- */

/* Duration of the "kernels" the calling thread launches from now on, with
 * either API. The initial value of every thread is FAKECUDA_KERNEL_US
 * (microseconds, read once at load; default 0). */
void fakecuda_set_kernel_ns(uint64_t ns);

#endif /* FAKE_CUDA_H */
