// metrale-top1: llama.cpp's greedy top-1 at every position of given token sequences (teacher-forced).
//   metrale-top1 MODEL.gguf SEQS.txt OUT.txt NGL MODE      MODE: batch (one decode of the whole
//   sequence, logits at every position) or step (one token a decode, as generation runs).
// SEQS.txt: one sequence a line, token ids separated by spaces. OUT.txt: the argmax ids, a line each.
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static int argmax(const float * row, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i) if (row[i] > row[best]) best = i;
    return best;
}

int main(int argc, char ** argv) {
    if (argc != 6) { fprintf(stderr, "usage: %s MODEL SEQS OUT NGL batch|step\n", argv[0]); return 2; }
    const bool step = std::strcmp(argv[5], "step") == 0;
    std::vector<std::vector<llama_token>> seqs;
    std::ifstream in(argv[2]);
    for (std::string line; std::getline(in, line);) {
        std::istringstream ss(line);
        std::vector<llama_token> s;
        for (llama_token t; ss >> t;) s.push_back(t);
        if (!s.empty()) seqs.push_back(s);
    }
    size_t longest = 0;
    for (auto & s : seqs) longest = s.size() > longest ? s.size() : longest;

    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = std::atoi(argv[4]);
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) (longest + 16);
    cp.n_batch = cp.n_ubatch = (uint32_t) (longest + 16);
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot make a context\n"); return 1; }

    std::ofstream out(argv[3]);
    llama_batch batch = llama_batch_init((int32_t) longest, 0, 1);
    for (auto & s : seqs) {
        llama_memory_clear(llama_get_memory(ctx), true);
        std::vector<int> top;
        const size_t chunk = step ? 1 : s.size();
        for (size_t lo = 0; lo < s.size(); lo += chunk) {
            batch.n_tokens = 0;
            for (size_t i = lo; i < lo + chunk && i < s.size(); ++i) {
                const int j = batch.n_tokens++;
                batch.token[j] = s[i]; batch.pos[j] = (llama_pos) i;
                batch.n_seq_id[j] = 1; batch.seq_id[j][0] = 0; batch.logits[j] = 1;
            }
            if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "llama_decode failed\n"); return 1; }
            for (int j = 0; j < batch.n_tokens; ++j) top.push_back(argmax(llama_get_logits_ith(ctx, j), n_vocab));
        }
        for (size_t i = 0; i < top.size(); ++i) out << (i ? " " : "") << top[i];
        out << "\n";
    }
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
