/* verify --level ops through RPC (llamabundle): llama.cpp's test-backend-ops has no option naming an RPC server, so
 * this library, preloaded into it (LD_PRELOAD), adds the servers in LLAMABUNDLE_RPC_SERVERS ("HOST:PORT[,...]")
 * once ggml has loaded its backend modules, as llama-server's --rpc does (common/arg.cpp, add_rpc_devices): each
 * becomes a device RPC0, RPC1, ... that `test-backend-ops -b RPC0` tests against the local CPU backend.
 * It replaces ggml_backend_load_all, calls the real one (the next definition, libggml's), then looks up ggml's
 * registry functions at run time, so it is built without ggml's headers or libraries. Any failure exits with 3
 * and says why on stderr: a test that silently ran without its RPC device would prove nothing.
 *
 * LLAMABUNDLE_RPC_SUPPORTS_AS names the local device the server serves (CPU, CUDA0, ...): an RPC device is asked
 * nothing about an op, its answer is that device's. At the pinned commit ggml's RPC client says every op is supported
 * (ggml_backend_rpc_device_supports_op returns true), so test-backend-ops would send a CUDA server cases CUDA lacks,
 * and the server aborts. The server runs on this machine, so the local device's own answer is the remote one's. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *reg_t;
typedef void *dev_t_;
typedef void *backend_t;
typedef const void *tensor_t;

static void *need(void *handle, const char *name) {
    void *f = dlsym(handle, name);
    if (!f) {
        fprintf(stderr, "llamabundle rpc preload: %s not found (%s)\n", name, dlerror());
        exit(3);
    }
    return f;
}

void ggml_backend_load_all(void) {
    void (*real)(void) = (void (*)(void))need(RTLD_NEXT, "ggml_backend_load_all");
    real();
    const char *servers = getenv("LLAMABUNDLE_RPC_SERVERS");
    if (!servers || !*servers) {
        return;
    }
    reg_t (*by_name)(const char *) = (reg_t (*)(const char *))need(RTLD_DEFAULT, "ggml_backend_reg_by_name");
    void *(*proc_address)(reg_t, const char *) =
        (void *(*)(reg_t, const char *))need(RTLD_DEFAULT, "ggml_backend_reg_get_proc_address");
    void (*register_reg)(reg_t) = (void (*)(reg_t))need(RTLD_DEFAULT, "ggml_backend_register");
    reg_t rpc = by_name("RPC");
    if (!rpc) {
        fprintf(stderr, "llamabundle rpc preload: the RPC backend module did not load\n");
        exit(3);
    }
    reg_t (*add_server)(const char *) = (reg_t (*)(const char *))proc_address(rpc, "ggml_backend_rpc_add_server");
    if (!add_server) {
        fprintf(stderr, "llamabundle rpc preload: the RPC backend has no ggml_backend_rpc_add_server\n");
        exit(3);
    }
    char buf[4096];
    if (strlen(servers) >= sizeof buf) {
        fprintf(stderr, "llamabundle rpc preload: LLAMABUNDLE_RPC_SERVERS is too long\n");
        exit(3);
    }
    strcpy(buf, servers);
    for (char *save = NULL, *endpoint = strtok_r(buf, ",", &save); endpoint; endpoint = strtok_r(NULL, ",", &save)) {
        reg_t reg = add_server(endpoint);
        if (!reg) {
            fprintf(stderr, "llamabundle rpc preload: could not add the RPC server %s\n", endpoint);
            exit(3);
        }
        register_reg(reg);
    }
}

/* The device whose answers an RPC device gives (LLAMABUNDLE_RPC_SUPPORTS_AS), NULL where none is named; looked up once
 * the backends are loaded, by ggml_backend_load_all above. A name that is not a device here exits 3. */
static dev_t_ supports_as;

static bool is_rpc(dev_t_ dev) {
    static const char *(*dev_name)(dev_t_);
    if (!dev_name) {
        dev_name = (const char *(*)(dev_t_))need(RTLD_DEFAULT, "ggml_backend_dev_name");
    }
    const char *name = dev ? dev_name(dev) : NULL;
    return name && strncmp(name, "RPC", 3) == 0;
}

static dev_t_ answering(dev_t_ dev) {
    const char *as = getenv("LLAMABUNDLE_RPC_SUPPORTS_AS");
    if (!as || !*as || !is_rpc(dev)) {
        return dev;
    }
    if (!supports_as) {
        dev_t_ (*by_name)(const char *) = (dev_t_ (*)(const char *))need(RTLD_DEFAULT, "ggml_backend_dev_by_name");
        supports_as = by_name(as);
        if (!supports_as) {
            fprintf(stderr, "llamabundle rpc preload: LLAMABUNDLE_RPC_SUPPORTS_AS names %s, not a device here\n", as);
            exit(3);
        }
    }
    return supports_as;
}

bool ggml_backend_dev_supports_op(dev_t_ dev, tensor_t op) {  /* bool: ggml's own return type (C's _Bool) */
    static bool (*real)(dev_t_, tensor_t);
    if (!real) {
        real = (bool (*)(dev_t_, tensor_t))need(RTLD_NEXT, "ggml_backend_dev_supports_op");
    }
    return real(answering(dev), op);
}

bool ggml_backend_supports_op(backend_t backend, tensor_t op) {
    static bool (*real)(backend_t, tensor_t);
    static dev_t_ (*device_of)(backend_t);
    if (!real) {
        real = (bool (*)(backend_t, tensor_t))need(RTLD_NEXT, "ggml_backend_supports_op");
        device_of = (dev_t_ (*)(backend_t))need(RTLD_DEFAULT, "ggml_backend_get_device");
    }
    dev_t_ dev = device_of(backend);
    dev_t_ as = answering(dev);
    return as == dev ? real(backend, op) : ggml_backend_dev_supports_op(as, op);
}
