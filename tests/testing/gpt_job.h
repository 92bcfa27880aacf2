// A small GPT job for tests on CPU and GPU workers: byte-level text with structure to learn
// (lines of words from a small vocabulary, fixed by seed), written once per process, and a
// spec that trains a 2-block GPT on it with AdamW, decay, warm-up, cosine and clipping.
#pragma once

#include <unistd.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "lockstep/v1/job.pb.h"
#include "common/random.h"

namespace lockstep::testing {

inline std::string GptCorpus(size_t bytes) {
  const char* words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat ", "and ", "dog ", "ran ",
                         "far ", "away ", "home "};
  SplitMix64 rng(11);
  std::string text;
  while (text.size() < bytes) {
    const int n = 3 + static_cast<int>(rng.Below(6));
    for (int i = 0; i < n; ++i) text += words[rng.Below(12)];
    text += ".\n";
  }
  text.resize(bytes);
  return text;
}

// 40,000 bytes of GptCorpus in the test's temporary directory.
inline std::string GptCorpusFile() {
  static const std::string path = [] {
    const std::string p = absl::StrCat(::testing::TempDir(), "/gpt-corpus-", getpid(), ".txt");
    std::ofstream(p, std::ios::binary) << GptCorpus(40000);
    return p;
  }();
  return path;
}

// 256 tokens (bytes), context 16, 2 blocks of 2 heads over 32 values; batch 16 in 4
// micro-shards, 40 steps.
inline v1::JobSpec SmallGptSpec() {
  v1::JobSpec spec;
  v1::ModelSpec* m = spec.mutable_model();
  m->set_type("gpt");
  m->mutable_gpt()->set_vocab_size(256);
  m->mutable_gpt()->set_context_length(16);
  m->mutable_gpt()->set_n_layer(2);
  m->mutable_gpt()->set_n_head(2);
  m->mutable_gpt()->set_d_model(32);
  spec.mutable_dataset()->set_type("text");
  spec.mutable_dataset()->set_path(GptCorpusFile());
  spec.mutable_dataset()->set_validation_fraction(0.1);
  v1::OptimizerSpec* o = spec.mutable_optimizer();
  o->set_type("adamw");
  o->set_learning_rate(0.01);
  o->set_beta1(0.9);
  o->set_beta2(0.99);
  o->set_epsilon(1e-8);
  o->set_weight_decay(0.1);
  o->set_warmup_steps(5);
  o->set_cosine_decay(true);
  o->set_grad_clip_norm(1.0);
  spec.set_global_batch_size(16);
  spec.set_micro_shards(4);
  spec.set_max_steps(40);
  spec.set_seed(2);
  spec.set_bucket_size_kib(16);
  return spec;
}

}  // namespace lockstep::testing
