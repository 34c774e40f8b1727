#include "transport/ucx/ucx_status.h"

#include <gtest/gtest.h>

namespace ddp::transport::ucx {
namespace {

TEST(FromUcs, OkIsOk) { EXPECT_TRUE(FromUcs(UCS_OK, "anything").ok()); }

TEST(FromUcs, DeadPeerCodesArePeerLost) {
  for (ucs_status_t s : {UCS_ERR_ENDPOINT_TIMEOUT, UCS_ERR_CONNECTION_RESET, UCS_ERR_UNREACHABLE}) {
    Status status = FromUcs(s, "tag send to rank 3");
    EXPECT_EQ(status.code(), StatusCode::kPeerLost) << status;
    EXPECT_NE(status.message().find("tag send to rank 3"), std::string::npos) << status;
  }
}

TEST(FromUcs, ASharedMemoryErrorIsALostPeerOnlyOnPeerTraffic) {
  Status setup = FromUcs(UCS_ERR_SHMEM_SEGMENT, "creating the UCX worker");
  EXPECT_EQ(setup.code(), StatusCode::kInternal) << setup;
  Status send = FromUcsOfPeerTraffic(UCS_ERR_SHMEM_SEGMENT, "tag send to rank 2");
  EXPECT_EQ(send.code(), StatusCode::kPeerLost) << send;
  EXPECT_NE(send.message().find("tag send to rank 2"), std::string::npos) << send;
  EXPECT_NE(send.message().find(ucs_status_string(UCS_ERR_SHMEM_SEGMENT)), std::string::npos) << send;
  // Every other code maps as FromUcs maps it.
  for (ucs_status_t s : {UCS_ERR_CONNECTION_RESET, UCS_ERR_TIMED_OUT, UCS_ERR_CANCELED,
                         UCS_ERR_MESSAGE_TRUNCATED, UCS_ERR_NO_MEMORY, UCS_ERR_NO_ELEM}) {
    EXPECT_EQ(FromUcsOfPeerTraffic(s, "x").code(), FromUcs(s, "x").code()) << ucs_status_string(s);
  }
}

TEST(FromUcs, MessageCarriesUcxText) {
  Status status = FromUcs(UCS_ERR_MESSAGE_TRUNCATED, "receive");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find(ucs_status_string(UCS_ERR_MESSAGE_TRUNCATED)),
            std::string::npos);
}

TEST(FromUcs, OtherCodes) {
  EXPECT_EQ(FromUcs(UCS_ERR_TIMED_OUT, "x").code(), StatusCode::kTimedOut);
  EXPECT_EQ(FromUcs(UCS_ERR_CANCELED, "x").code(), StatusCode::kAborted);
  EXPECT_EQ(FromUcs(UCS_ERR_NO_MEMORY, "x").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(FromUcs(UCS_ERR_NO_DEVICE, "x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(FromUcs(UCS_ERR_NO_ELEM, "x").code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace ddp::transport::ucx
