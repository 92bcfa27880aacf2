// How a gradient crosses the wire: consecutive ranges of the flat gradient buffer in backward
// order, each closed at a ready point of the model once it holds at least the transport's
// minimum (shared memory and Gloo: the job's bucket_size_kib, 256 KiB by default; NCCL: 16
// MiB, which it needs to reach its bandwidth), the last one ending at the gradient's end plus
// `tail` values (the loss, and in deterministic mode the out-of-range count). One plan serves
// every engine, so the partition, and with it the bits of a float sum, is decided in one place.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

namespace lockstep::worker {

class BucketPlan {
 public:
  struct Bucket {
    size_t offset = 0;
    size_t count = 0;
  };
  // `ready_points`: a model's ReadyPoints, ascending, the last one the gradient's size.
  BucketPlan(const std::vector<size_t>& ready_points, size_t min_values, size_t tail);

  const std::vector<Bucket>& buckets() const { return buckets_; }
  size_t largest() const;

  // Walks the plan as backward produces the gradient: Ready(end) sends every bucket that lies
  // within [0, end), except the last one, which Finish sends (its tail is written only after
  // backward). Not thread-safe; one per step.
  class Cursor {
   public:
    Cursor(const BucketPlan& plan, std::function<void(const Bucket&)> send)
        : plan_(plan), send_(std::move(send)) {}
    void Ready(size_t end);
    void Finish();

   private:
    const BucketPlan& plan_;
    const std::function<void(const Bucket&)> send_;
    size_t next_ = 0;
  };

 private:
  std::vector<Bucket> buckets_;
};

}  // namespace lockstep::worker
