// A small MLP job on synthetic data, for tests of the trainer and the generation runner.
#pragma once

#include "lockstep/v1/job.pb.h"

namespace lockstep::testing {

// Two hidden layers (32, 16, GELU) on 2048 + 512 synthetic samples of 12 features and 4
// classes; SGD with momentum; 60 steps of 64 samples in 8 micro-shards; buckets of 1 KiB, so
// even this model has several.
inline v1::JobSpec SyntheticMlpSpec() {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mlp");
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(32);
  spec.mutable_model()->mutable_mlp()->add_hidden_widths(16);
  spec.mutable_model()->mutable_mlp()->set_activation("gelu");
  spec.mutable_dataset()->set_type("synthetic");
  auto* s = spec.mutable_dataset()->mutable_synthetic();
  s->set_train_samples(2048);
  s->set_test_samples(512);
  s->set_input_dim(12);
  s->set_num_classes(4);
  s->set_seed(3);
  spec.mutable_optimizer()->set_type("sgd");
  spec.mutable_optimizer()->set_learning_rate(0.1);
  spec.mutable_optimizer()->set_momentum(0.9);
  spec.set_global_batch_size(64);
  spec.set_micro_shards(8);
  spec.set_max_steps(60);
  spec.set_seed(11);
  spec.set_bucket_size_kib(1);  // several buckets even for this small model
  return spec;
}

}  // namespace lockstep::testing
