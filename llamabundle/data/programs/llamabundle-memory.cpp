// llamabundle-memory: llama.cpp's own memory figures for one llama-server launch, without loading it.
//
// Written into the build tree by llamabundle and built beside llama-server (build.py: MEMORY_PROGRAM), so
// that `llamabundle plan` can size each -ngl it weighs on the machine that will run it. It takes
// llama-server's flags as llama-server parses them, sets the output limits llama-server sets before it
// loads a model (tools/server/server-context.cpp: server_output_limits), and prints what llama.cpp's
// no_alloc dry run places on each device (common/fit.cpp: common_fit_print): one line per device,
// "DEVICE MODEL CONTEXT COMPUTE" in whole MiB, and a last "Host" line. Nothing is read from the weights and
// nothing is allocated. llama-fit-params --fit-print prints the same table, but for a context that keeps
// the logits of every token of a batch (n_outputs_max = n_batch): on a GPU that holds the output layer
// its compute buffer is larger than llama-server's.
#include "arg.h"
#include "common.h"
#include "fit.h"
#include "llama.h"
#include "speculative.h"

#include <algorithm>

int main(int argc, char ** argv) {
    common_params params;
    common_init();
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_SERVER)) {
        return 1;
    }
    // what llama-server's main does to its parsed flags (tools/server/server.cpp) before it loads a model
    if (params.embedding && params.n_batch > params.n_ubatch) {
        params.n_batch = params.n_ubatch;
    }
    if (params.n_parallel < 0) {  // -np auto: 4 slots sharing one unified KV cache
        params.n_parallel = 4;
        params.kv_unified = true;
    }
    if (params.embedding ||
            (params.pooling_type != LLAMA_POOLING_TYPE_UNSPECIFIED && params.pooling_type != LLAMA_POOLING_TYPE_NONE)) {
        params.n_outputs_max = params.n_batch;
        params.n_outputs_max_per_seq = 1;
    } else {
        const auto limits = common_speculative_get_output_limits(
                params.n_batch, params.n_parallel, common_speculative_n_max(&params.speculative));
        params.n_outputs_max = std::max<int32_t>(1, limits.total);
        params.n_outputs_max_per_seq = std::max<int32_t>(1, limits.per_seq);
    }
    llama_backend_init();
    llama_numa_init(params.numa);
    llama_model_params mparams = common_model_params_to_llama(params);
    llama_context_params cparams = common_context_params_to_llama(params);
    common_fit_print(params.model.path.c_str(), &mparams, &cparams);
    llama_backend_free();
    return 0;
}
