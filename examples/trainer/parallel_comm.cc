// Data parallelism straight over the transport: gradients are averaged with
// one all-reduce per dtype after backward (no overlap). Used until the
// trainer runs on ddp::dist::DistributedDataParallel.

#include <cstring>
#include <map>

#include "examples/trainer/parallel.h"
#include "nn/tensor/tensor.h"
#include "transport/communicator.h"
#include "transport/launch/env.h"

namespace ddp::examples::trainer {
namespace {

using transport::Communicator;
using transport::DataType;
using transport::ReduceOp;

DataType ToTransport(nn::DType t) {
  switch (t) {
    case nn::DType::kFloat32: return DataType::kF32;
    case nn::DType::kFloat64: return DataType::kF64;
    case nn::DType::kFloat16: return DataType::kF16;
    case nn::DType::kBFloat16: return DataType::kBF16;
    default: throw std::invalid_argument("no transport type for this dtype");
  }
}

void Check(const transport::Status& s, const char* what) {
  if (!s.ok()) throw JobError(std::string(what) + ": " + s.ToString());
}

class CommParallel : public Parallel {
 public:
  explicit CommParallel(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {}

  int rank() const override { return comm_ ? comm_->rank() : 0; }
  int world_size() const override { return comm_ ? comm_->size() : 1; }

  void Attach(std::shared_ptr<nn::modules::Module> model, const TrainConfig&) override {
    model_ = std::move(model);
    if (!comm_ || comm_->size() == 1) return;
    nn::NoGradGuard no_grad;
    for (const auto& [name, t] : model_->GetStateDict()) {
      if (!nn::IsFloating(t.dtype())) continue;
      Check(comm_->Broadcast(t.data_ptr(), t.numel(), ToTransport(t.dtype()), 0),
            "broadcast of the initial parameters");
    }
  }

  nn::Tensor Forward(const nn::Tensor& input) override { return model_->Forward(input); }

  std::unique_ptr<void, void (*)(void*)> NoSync() override {
    return {this, [](void*) {}};  // gradients are only reduced in FinishBackward
  }

  void FinishBackward() override {
    if (!comm_ || comm_->size() == 1) return;
    nn::NoGradGuard no_grad;
    std::map<nn::DType, std::vector<nn::Tensor>> by_dtype;
    for (const nn::Tensor& p : model_->Parameters()) {
      // A parameter this rank did not use contributes zeros.
      if (!p.grad().defined()) p.set_grad(nn::ZerosLike(p));
      by_dtype[p.dtype()].push_back(p.grad());
    }
    for (auto& [dtype, grads] : by_dtype) {
      size_t bytes = 0;
      for (const nn::Tensor& g : grads) bytes += g.nbytes();
      flat_.resize(bytes);
      size_t off = 0;
      for (const nn::Tensor& g : grads) {
        const nn::Tensor c = g.Contiguous();
        std::memcpy(flat_.data() + off, c.data_ptr(), c.nbytes());
        off += c.nbytes();
      }
      Check(comm_->AllReduce(flat_.data(), bytes / nn::ElementSize(dtype), ToTransport(dtype),
                             ReduceOp::kAvg),
            "gradient all-reduce");
      off = 0;
      for (const nn::Tensor& g : grads) {
        std::memcpy(g.data_ptr(), flat_.data() + off, g.nbytes());
        off += g.nbytes();
      }
    }
  }

  void SumAcrossRanks(std::vector<double>& values) override {
    if (!comm_ || comm_->size() == 1 || values.empty()) return;
    Check(comm_->AllReduce(values.data(), values.size(), DataType::kF64, ReduceOp::kSum),
          "metric all-reduce");
  }

  std::string TakeStatsLine() override { return ""; }
  double CommShare() const override { return -1; }
  double CommOverlap() const override { return -1; }
  void WriteTrace(const std::string&) override {}

 private:
  std::unique_ptr<Communicator> comm_;
  std::shared_ptr<nn::modules::Module> model_;
  std::vector<unsigned char> flat_;
};

}  // namespace

std::unique_ptr<Parallel> JoinJob() {
  if (!transport::launch::HasLaunchVariables(transport::launch::CurrentEnvironment())) {
    return std::make_unique<CommParallel>(nullptr);
  }
  auto comm = Communicator::CreateFromEnvironment();
  if (!comm.ok()) throw JobError("cannot join the job: " + comm.status().ToString());
  return std::make_unique<CommParallel>(std::move(*comm));
}

}  // namespace ddp::examples::trainer
