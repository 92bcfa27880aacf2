// The agreement on a job's result (coordinator/core/agreement.h), case by case.
#include "coordinator/core/agreement.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace lockstep::coordinator {
namespace {

struct Case {
  const char* what;
  std::vector<FinishedResult> results;
  // Empty: they agree. Otherwise the whole message.
  std::string disagreement;
};

TEST(AgreementTest, EveryFinishedMemberMustReportTheSameResult) {
  const FinishedResult a{"w0", 40, "ab12", "eval-1"};
  const Case cases[] = {
      {"no member finished", {}, ""},
      {"one member", {a}, ""},
      {"two agree", {a, {"w1", 40, "ab12", "eval-1"}}, ""},
      {"three agree", {a, {"w1", 40, "ab12", "eval-1"}, {"w2", 40, "ab12", "eval-1"}}, ""},
      {"other parameters",
       {a, {"w1", 40, "cd34", "eval-1"}},
       "the members disagree on the result (w0: step 40, parameters ab12; w1: step 40, "
       "parameters cd34)"},
      {"another step",
       {a, {"w1", 39, "ab12", "eval-1"}},
       "the members disagree on the result (w0: step 40, parameters ab12; w1: step 39, "
       "parameters ab12)"},
      {"another evaluation only",
       {a, {"w1", 40, "ab12", "eval-2"}},
       "the members disagree on the result (w0: step 40, parameters ab12; w1: step 40, "
       "parameters ab12, a different evaluation)"},
      {"one outlier of three, last",
       {a, {"w1", 40, "ab12", "eval-1"}, {"w2", 40, "ff00", "eval-1"}},
       "the members disagree on the result (w0: step 40, parameters ab12; w1: step 40, "
       "parameters ab12; w2: step 40, parameters ff00)"},
      {"the first is the outlier: evaluations compare with the first's",
       {{"w0", 40, "ab12", "eval-0"}, {"w1", 40, "ab12", "eval-1"}, {"w2", 40, "ab12", "eval-1"}},
       "the members disagree on the result (w0: step 40, parameters ab12; w1: step 40, "
       "parameters ab12, a different evaluation; w2: step 40, parameters ab12, a different "
       "evaluation)"},
      {"an empty checksum is a checksum like any other",
       {a, {"w1", 40, "", "eval-1"}},
       "the members disagree on the result (w0: step 40, parameters ab12; w1: step 40, "
       "parameters )"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Disagreement(c.results), c.disagreement) << c.what;
  }
}

}  // namespace
}  // namespace lockstep::coordinator
