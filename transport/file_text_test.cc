#include "transport/file_text.h"

#include <fcntl.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "transport/testing/reader_descriptor_flags.h"

namespace ddp::transport {
namespace {

namespace fs = std::filesystem;

// Longer than one 4 KiB block, with a NUL inside: all of it comes back.
TEST(ReadWholeFile, ReturnsEveryByteOfAFileLongerThanOneBlock) {
  const std::string path = ::testing::TempDir() + "/file_text_long";
  std::string text(10000, 'x');
  text[5000] = '\0';
  text.back() = '\n';
  std::ofstream(path, std::ios::binary) << text;
  EXPECT_EQ(ReadWholeFile(path), text);
  fs::remove(path);
}

TEST(ReadWholeFile, AnEmptyFileIsAnEmptyText) {
  const std::string path = ::testing::TempDir() + "/file_text_empty";
  std::ofstream{path};
  EXPECT_EQ(ReadWholeFile(path), std::string());
  fs::remove(path);
}

TEST(ReadWholeFile, AMissingFileIsNullopt) {
  EXPECT_EQ(ReadWholeFile(::testing::TempDir() + "/file_text_not_there"), std::nullopt);
}

// A directory opens but fails at the first read: nullopt, not "".
TEST(ReadWholeFile, ADirectoryIsNullopt) {
  EXPECT_EQ(ReadWholeFile(::testing::TempDir()), std::nullopt);
}

TEST(ReadWholeFile, OpensTheFileCloseOnExec) {
  const std::string path = ::testing::TempDir() + "/file_text_fifo";
  const int flags = testing::FlagsOfTheReadersDescriptor(path, [&] { static_cast<void>(ReadWholeFile(path)); });
  ASSERT_GE(flags, 0) << "the reader's descriptor was not seen";
  EXPECT_NE(flags & O_CLOEXEC, 0) << std::oct << flags;
}

}  // namespace
}  // namespace ddp::transport
