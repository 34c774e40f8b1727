// TraceRecorder's file: the events it kept, and how many it dropped once
// full, in the document's metadata.

#include "ddp/trace.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

namespace ddp::dist {
namespace {

nlohmann::json WriteAndRead(const TraceRecorder& trace, const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  trace.Write(path, 3);
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

int CompleteEvents(const nlohmann::json& doc) {
  int n = 0;
  for (const auto& e : doc["traceEvents"]) n += e["ph"] == "X";
  return n;
}

TEST(TraceTest, DroppedEventsAreCountedInTheFile) {
  TraceRecorder trace(2);
  const auto now = TraceRecorder::Clock::now();
  for (int i = 0; i < 3; ++i) trace.Complete("event " + std::to_string(i), "compute", now, now);
  EXPECT_EQ(trace.size(), 2u);
  EXPECT_EQ(trace.dropped(), 1u);
  const nlohmann::json doc = WriteAndRead(trace, "trace_full.json");
  EXPECT_EQ(CompleteEvents(doc), 2);
  ASSERT_TRUE(doc.contains("otherData")) << doc.dump();
  EXPECT_EQ(doc["otherData"]["dropped_events"], 1) << doc.dump();
  EXPECT_EQ(doc["otherData"]["max_events"], 2) << doc.dump();
}

TEST(TraceTest, NothingDroppedIsWrittenAsZero) {
  TraceRecorder trace(4);
  const auto now = TraceRecorder::Clock::now();
  trace.Complete("forward", "compute", now, now, "\"bytes\": 4096");
  const nlohmann::json doc = WriteAndRead(trace, "trace_room.json");
  EXPECT_EQ(CompleteEvents(doc), 1);
  ASSERT_TRUE(doc.contains("otherData")) << doc.dump();
  EXPECT_EQ(doc["otherData"]["dropped_events"], 0) << doc.dump();
}

}  // namespace
}  // namespace ddp::dist
