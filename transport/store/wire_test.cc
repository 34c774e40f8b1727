#include "transport/store/wire.h"

#include <gtest/gtest.h>

namespace ddp::transport::store::wire {
namespace {

TEST(WireTest, RoundTripsFields) {
  Writer w;
  w.U8(7);
  w.U16(0xbeef);
  w.U32(0xdeadbeef);
  w.I64(-42);
  w.String("key");
  w.String("");
  const std::string frame = w.Frame();
  ASSERT_EQ(PeekFrameLength(frame), frame.size() - kFrameHeaderBytes);
  Reader r(std::string_view(frame).substr(kFrameHeaderBytes));
  uint8_t a;
  uint16_t b;
  uint32_t c;
  int64_t d;
  std::string_view e, f;
  ASSERT_TRUE(r.U8(a) && r.U16(b) && r.U32(c) && r.I64(d) && r.String(e, 10) && r.String(f, 10));
  EXPECT_EQ(a, 7);
  EXPECT_EQ(b, 0xbeef);
  EXPECT_EQ(c, 0xdeadbeefu);
  EXPECT_EQ(d, -42);
  EXPECT_EQ(e, "key");
  EXPECT_EQ(f, "");
  EXPECT_TRUE(r.at_end());
}

TEST(WireTest, LittleEndianOnTheWire) {
  Writer w;
  w.U32(0x01020304);
  EXPECT_EQ(w.body(), std::string("\x04\x03\x02\x01", 4));
}

TEST(WireTest, ReadsNeverPassTheEnd) {
  const std::string body("\x05\x00\x00\x00" "abc", 7);  // claims 5 bytes, has 3
  Reader r(body);
  std::string_view s;
  EXPECT_FALSE(r.String(s, 100));
  Reader r2(std::string_view("\x01", 1));
  uint32_t v;
  EXPECT_FALSE(r2.U32(v));
  EXPECT_FALSE(PeekFrameLength(std::string_view("\x01\x02", 2)).has_value());
}

TEST(WireTest, StringLongerThanItsBoundIsFlagged) {
  Writer w;
  w.String("0123456789");
  Reader r(w.body());
  std::string_view s;
  bool too_long = false;
  EXPECT_FALSE(r.String(s, 4, &too_long));
  EXPECT_TRUE(too_long);
}

TEST(WireTest, TokensEqual) {
  EXPECT_TRUE(TokensEqual("", ""));
  EXPECT_TRUE(TokensEqual("abc", "abc"));
  EXPECT_FALSE(TokensEqual("abc", "abd"));
  EXPECT_FALSE(TokensEqual("abc", "ab"));
  EXPECT_FALSE(TokensEqual("abc", "abcd"));
  EXPECT_FALSE(TokensEqual("abc", ""));
  EXPECT_FALSE(TokensEqual("", "x"));
  EXPECT_FALSE(TokensEqual(std::string("a\0b", 3), "a"));
}

TEST(WireTest, OpNames) {
  EXPECT_STREQ(OpName(static_cast<uint8_t>(Op::kWait)), "wait");
  EXPECT_STREQ(OpName(200), "unknown");
}

}  // namespace
}  // namespace ddp::transport::store::wire
