// Writes the initial parameters a GPT (or MLP) job spec gives, as Lockstep initialises them, to
// DIR/model.safetensors and DIR/config.json: what the PyTorch twin loads for the parity check
// (bench/torch/gpt_parity.sh). Usage: gpt_init_export --spec=JOB.json --out=DIR
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/safetensors.h"
#include "google/protobuf/util/json_util.h"
#include "worker/model/model.h"

ABSL_FLAG(std::string, spec, "", "the job spec (protobuf JSON of lockstep.v1.JobSpec)");
ABSL_FLAG(std::string, out, "", "directory to write model.safetensors and config.json into");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::ifstream in(absl::GetFlag(FLAGS_spec));
  std::stringstream json;
  json << in.rdbuf();
  lockstep::v1::JobSpec spec;
  if (!in || !google::protobuf::util::JsonStringToMessage(json.str(), &spec).ok()) {
    std::cerr << "gpt_init_export: cannot read the job spec " << absl::GetFlag(FLAGS_spec) << "\n";
    return 2;
  }
  if (spec.model().type() != "gpt") {
    std::cerr << "gpt_init_export: model.type must be gpt\n";
    return 2;
  }
  auto model = lockstep::worker::CreateModel(spec.model(), {});
  if (!model.ok()) {
    std::cerr << "gpt_init_export: " << model.status() << "\n";
    return 2;
  }
  (*model)->Initialize(spec.model().init_seed() != 0 ? spec.model().init_seed() : spec.seed());
  auto path = lockstep::WriteModelExport(absl::GetFlag(FLAGS_out), lockstep::worker::Manifest(**model),
                                         (*model)->params(), (*model)->num_params(),
                                         {{"format", "pt"}, {"lockstep_step", "0"}});
  if (!path.ok()) {
    std::cerr << "gpt_init_export: " << path.status() << "\n";
    return 1;
  }
  std::cout << *path << "\n";
  return 0;
}
