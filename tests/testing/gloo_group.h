// An in-process Gloo group for unit tests: `world` threads, one rank each, formed through an
// in-process bootstrap store on 127.0.0.1.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "tests/testing/local_store.h"
#include "worker/comm/gloo_communicator.h"

namespace lockstep::testing {

// Runs fn(rank, communicator) on every rank's thread and joins them.
inline void RunInGlooGroup(
    int world, const std::function<void(int, std::unique_ptr<worker::GlooCommunicator>)>& fn,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(20000)) {
  coordinator::BootstrapStore store;
  const coordinator::StoreScope scope{"test-job", 1};
  store.Open(scope);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto gloo = worker::GlooCommunicator::Create(
          r, world, std::make_shared<LocalStoreClient>(&store, scope), "127.0.0.1", timeout);
      ASSERT_TRUE(gloo.ok()) << gloo.status();
      fn(r, *std::move(gloo));
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace lockstep::testing
