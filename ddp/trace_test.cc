// TraceRecorder's file: the events it kept, and how many it dropped once
// full, in the document's metadata.

#include "ddp/trace.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

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

// Names hold whatever a label or module path held. Quotes, backslashes and
// control characters are escaped; well-formed UTF-8 passes through as it is;
// a byte that is not part of well-formed UTF-8 (JSON text must be UTF-8, and
// strict readers refuse the whole file otherwise) reads back as U+FFFD.
TEST(TraceTest, AnyBytesInANameGiveValidJson) {
  std::string controls;
  for (char c = 1; c < 0x20; ++c) controls += c;
  const std::string replacement = "\xef\xbf\xbd";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"say \"hi\" \\ back\\slash", "say \"hi\" \\ back\\slash"},
      {controls + "\x7f", controls + "\x7f"},
      {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"},
      {"latin-1 caf\xe9", "latin-1 caf" + replacement},
      {"stray \x80 and \xff", "stray " + replacement + " and " + replacement},
      {"cut \xe2\x82", "cut " + replacement + replacement},
      {"overlong \xc0\xaf", "overlong " + replacement + replacement},
      {"surrogate \xed\xa0\x80", "surrogate " + replacement + replacement + replacement},
  };
  TraceRecorder trace;
  const auto now = TraceRecorder::Clock::now();
  for (const auto& [name, expected] : cases) trace.Complete(name, "comm", now, now);
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = WriteAndRead(trace, "trace_names.json"));
  std::vector<std::string> names;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "X") names.push_back(e["name"].get<std::string>());
  }
  ASSERT_EQ(names.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(names[i], cases[i].second) << "case " << i;
}

// The stream holds, after each flush, every event so far exactly once and
// each lane's name once, and reads as JSON once its closing bracket is
// added; EndStream(true) removes it, EndStream(false) keeps it.
TEST(TraceTest, FlushAppendsOnlyTheNewEvents) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/trace_stream.json";
  auto read = [&] {
    std::ifstream in(path);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return nlohmann::json::parse(text + "]");
  };
  for (const bool remove : {false, true}) {
    TraceRecorder trace;
    const auto now = TraceRecorder::Clock::now();
    trace.Complete("before", "compute", now, now);
    trace.StreamTo(path, 5);
    EXPECT_THROW(trace.StreamTo(path, 5), std::logic_error);
    trace.Flush();
    trace.Complete("a", "comm", now, now);
    trace.Complete("b", "compute", now, now);
    trace.Flush();
    trace.Flush();
    const nlohmann::json events = read();
    std::vector<std::string> names;
    int lanes = 0;
    for (const auto& e : events) {
      EXPECT_EQ(e["pid"], 5);
      if (e["ph"] == "X") names.push_back(e["name"].get<std::string>());
      lanes += e["name"] == "thread_name";
    }
    EXPECT_EQ(names, (std::vector<std::string>{"before", "a", "b"}));
    EXPECT_EQ(lanes, 2);
    trace.EndStream(remove);
    EXPECT_EQ(std::ifstream(path).good(), !remove);
  }
  TraceRecorder trace;
  EXPECT_THROW(trace.StreamTo("/nonexistent-dir/trace.json", 0), std::runtime_error);
}

}  // namespace
}  // namespace ddp::dist
