/* Minimal fake NVML (libnvidia-ml.so.1): one device, no fabric / NVLink / processes. */
#include <stdio.h>
#include <stdlib.h>
#define NVML_SUCCESS 0
#define NVML_ERROR_NOT_SUPPORTED 3
static int dev_token;
static void tr(const char *n) { if (getenv("STUB_CUDA_TRACE")) fprintf(stderr, "[stubnvml] %s\n", n); }
int nvmlInit_v2(void) { tr("nvmlInit_v2"); return NVML_SUCCESS; }
int nvmlInit(void) { return nvmlInit_v2(); }
int nvmlShutdown(void) { return NVML_SUCCESS; }
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **dev) { (void)bus; tr("GetHandleByPciBusId"); *dev = &dev_token; return NVML_SUCCESS; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **dev) { (void)i; *dev = &dev_token; return NVML_SUCCESS; }
int nvmlDeviceGetGpuFabricInfoV(void *dev, void *info) { (void)dev; (void)info; tr("GetGpuFabricInfoV"); return NVML_ERROR_NOT_SUPPORTED; }
int nvmlDeviceGetGpuFabricInfo(void *dev, void *info) { (void)dev; (void)info; return NVML_ERROR_NOT_SUPPORTED; }
int nvmlDeviceGetNvLinkRemoteDeviceType(void *dev, unsigned int l, int *t) { (void)dev; (void)l; (void)t; return NVML_ERROR_NOT_SUPPORTED; }
int nvmlDeviceGetNvLinkRemotePciInfo_v2(void *dev, unsigned int l, void *pci) { (void)dev; (void)l; (void)pci; return NVML_ERROR_NOT_SUPPORTED; }
int nvmlDeviceGetComputeRunningProcesses(void *dev, unsigned int *n, void *info) { (void)dev; (void)info; *n = 0; return NVML_SUCCESS; }
int nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 13020; return NVML_SUCCESS; }
int nvmlSystemGetCudaDriverVersion(int *v) { *v = 13020; return NVML_SUCCESS; }
