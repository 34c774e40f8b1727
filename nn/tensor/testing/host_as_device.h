#ifndef DDP_NN_TENSOR_TESTING_HOST_AS_DEVICE_H_
#define DDP_NN_TENSOR_TESTING_HOST_AS_DEVICE_H_

// For tests without a GPU: registers host memory as the cuda backend, so
// that tensors "on cuda:0" exist and reach code paths that look at a
// tensor's device. Process-wide and permanent: call it in a child process
// (EXPECT_EXIT) when other tests of the binary count on there being no
// cuda backend.

namespace ddp::nn::testing {

void RegisterHostAsCuda();

}  // namespace ddp::nn::testing

#endif  // DDP_NN_TENSOR_TESTING_HOST_AS_DEVICE_H_
