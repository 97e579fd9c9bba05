// Minimal LD_PRELOAD workaround: cicc (CUDA 13.0) calls srand(f(time,pid)); pin it to a constant.
// Use together with ASLR disabled (setarch -R) for deterministic NVVM output.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
void srand(unsigned s) { (void)s; void (*real)(unsigned) = (void (*)(unsigned))dlsym(RTLD_NEXT, "srand"); real(12345u); }
