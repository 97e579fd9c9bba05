/* A stand-in for the NVIDIA driver's libcuda.so.1, for llamabundle-probe --drivers on a machine without a GPU
 * (tests/e2e/test_probe_drivers.py compiles it: gcc -shared -fPIC -o DIR/libcuda.so.1 libcuda.c).
 *
 * It answers as driver 12.8 (12080) with two devices: "NVIDIA Fake H200" (compute capability 9.0, PCI bus id
 * 0000:00:06.0, 143771 MiB) and "NVIDIA Fake A100" (8.0, 0001:c1:00.0, 80 GiB); further ones, where asked
 * for, repeat the second with the next bus numbers. As the real driver, nothing but cuDriverGetVersion and
 * cuGetErrorName answers before cuInit succeeded (CUDA_ERROR_NOT_INITIALIZED). The environment changes it:
 *   FAKECUDA_INIT_ERROR=N  cuInit returns N (100: CUDA_ERROR_NO_DEVICE)
 *   FAKECUDA_DEVICES=N     cuDeviceGetCount says N (0, or more than the probe lists)
 *   FAKECUDA_NAME0=TEXT    device 0's name (any bytes: quotes, control characters, bytes that are not UTF-8)
 *   FAKECUDA_STDOUT=TEXT   cuInit prints TEXT on stdout, as a chatty driver might
 * Built with -DFAKECUDA_OLD it is an older, poorer driver: no cuGetErrorName, no cuDeviceGetAttribute, and
 * only the 32-bit cuDeviceTotalMem of CUDA 3.1 (4 GiB - 1 for a larger device). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_UNKNOWN 999

struct fake_device {
    const char * name;
    int major, minor, domain, bus, slot;
    unsigned long long memory;
};

static const struct fake_device DEVICES[] = {
    {"NVIDIA Fake H200", 9, 0, 0x0000, 0x00, 0x06, 143771ULL << 20},
    {"NVIDIA Fake A100", 8, 0, 0x0001, 0xc1, 0x00, 80ULL << 30},
};

static int initialised;

static int env_int(const char * name, int otherwise) {
    const char * v = getenv(name);
    return v && *v ? atoi(v) : otherwise;
}

static int device_count(void) { return env_int("FAKECUDA_DEVICES", 2); }

static const struct fake_device * device(int dev) {
    if (dev < 0 || dev >= device_count()) return NULL;
    return &DEVICES[dev < 1 ? 0 : 1];
}

int cuInit(unsigned int flags) {
    const char * say = getenv("FAKECUDA_STDOUT");
    if (say) {
        printf("%s\n", say);
        fflush(stdout);
    }
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    int error = env_int("FAKECUDA_INIT_ERROR", CUDA_SUCCESS);
    initialised = error == CUDA_SUCCESS;
    return error;
}

int cuDriverGetVersion(int * version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 12080;
    return CUDA_SUCCESS;
}

int cuDeviceGetCount(int * count) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    *count = device_count();
    return CUDA_SUCCESS;
}

int cuDeviceGet(int * dev, int ordinal) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}

int cuDeviceGetName(char * name, int len, int dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    const struct fake_device * d = device(dev);
    if (!d) return CUDA_ERROR_INVALID_DEVICE;
    const char * given = dev == 0 ? getenv("FAKECUDA_NAME0") : NULL;
    if (len <= 0) return CUDA_ERROR_INVALID_VALUE;
    strncpy(name, given ? given : d->name, (size_t) len - 1);
    name[len - 1] = '\0';
    return CUDA_SUCCESS;
}

#ifndef FAKECUDA_OLD
int cuDeviceGetAttribute(int * value, int attribute, int dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    const struct fake_device * d = device(dev);
    if (!d) return CUDA_ERROR_INVALID_DEVICE;
    switch (attribute) {
        case 33: *value = d->bus + (dev > 1 ? dev - 1 : 0); return CUDA_SUCCESS;  /* PCI_BUS_ID */
        case 34: *value = d->slot; return CUDA_SUCCESS;                           /* PCI_DEVICE_ID */
        case 50: *value = d->domain; return CUDA_SUCCESS;                         /* PCI_DOMAIN_ID */
        case 75: *value = d->major; return CUDA_SUCCESS;                          /* COMPUTE_CAPABILITY_MAJOR */
        case 76: *value = d->minor; return CUDA_SUCCESS;                          /* COMPUTE_CAPABILITY_MINOR */
        default: return CUDA_ERROR_INVALID_VALUE;
    }
}

int cuDeviceTotalMem_v2(size_t * bytes, int dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    const struct fake_device * d = device(dev);
    if (!d) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = (size_t) d->memory;
    return CUDA_SUCCESS;
}

int cuGetErrorName(int error, const char ** name) {
    switch (error) {
        case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; return CUDA_SUCCESS;
        case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
        case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; return CUDA_SUCCESS;
        case CUDA_ERROR_NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
        case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; return CUDA_SUCCESS;
        case CUDA_ERROR_UNKNOWN: *name = "CUDA_ERROR_UNKNOWN"; return CUDA_SUCCESS;
        default: *name = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
}
#else
int cuDeviceTotalMem(unsigned int * bytes, int dev) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    const struct fake_device * d = device(dev);
    if (!d) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = d->memory > 0xffffffffULL ? 0xffffffffU : (unsigned int) d->memory;
    return CUDA_SUCCESS;
}
#endif
