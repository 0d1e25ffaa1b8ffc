#pragma once
// A test double for the distributed tests and the data-parallel benchmark: it counts the
// all-reduce traffic trainkit sends. Not part of the library; nothing under include/ uses it.
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainkit_testing {

/// A c10d backend that counts the all-reduce, reduce-scatter, all-gather and gather calls (and
/// bytes) that pass through it to `inner`:
/// g.over(counter) (tk::ProcessGroup: the same group, its heartbeat included, counted).
class CountingBackend final : public c10d::Backend {
 public:
  explicit CountingBackend(c10::intrusive_ptr<c10d::Backend> inner)
      : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    ++all_reduce_calls;
    for (const auto& t : tensors) all_reduce_bytes += static_cast<std::int64_t>(t.nbytes());
    return inner_->allreduce(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override {
    ++reduce_scatter_calls;
    reduce_scatter_bytes += static_cast<std::int64_t>(input.nbytes());
    if (opts.reduceOp.op_ == c10d::ReduceOp::PREMUL_SUM) ++premul_sum_calls;
    return inner_->_reduce_scatter_base(output, input, opts);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override {
    ++all_gather_calls;
    all_gather_bytes += static_cast<std::int64_t>(output.nbytes());
    return inner_->_allgather_base(output, input, opts);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    ++gather_calls;
    return inner_->gather(outputs, inputs, opts);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    return inner_->broadcast(tensors, opts);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    return inner_->barrier(opts);
  }
  const std::string getBackendName() const override { return inner_->getBackendName(); }

  std::int64_t all_reduce_calls = 0, all_reduce_bytes = 0;
  std::int64_t reduce_scatter_calls = 0, reduce_scatter_bytes = 0, all_gather_calls = 0, all_gather_bytes = 0;
  std::int64_t premul_sum_calls = 0;  ///< reduce-scatters that weight each rank's part inside (NCCL's PREMUL_SUM)
  std::int64_t gather_calls = 0;

 private:
  c10::intrusive_ptr<c10d::Backend> inner_;
};

}  // namespace trainkit_testing
