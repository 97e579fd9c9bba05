/* verify --level ops through RPC (llamabundle): llama.cpp's test-backend-ops has no option naming an RPC server, so
 * this library, preloaded into it (LD_PRELOAD), adds the servers in LLAMABUNDLE_RPC_SERVERS ("HOST:PORT[,...]")
 * once ggml has loaded its backend modules, as llama-server's --rpc does (common/arg.cpp, add_rpc_devices): each
 * becomes a device RPC0, RPC1, ... that `test-backend-ops -b RPC0` tests against the local CPU backend.
 * It replaces ggml_backend_load_all, calls the real one (the next definition, libggml's), then looks up ggml's
 * registry functions at run time, so it is built without ggml's headers or libraries. Any failure exits with 3
 * and says why on stderr: a test that silently ran without its RPC device would prove nothing. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *reg_t;

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
