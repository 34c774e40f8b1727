#include "nn/io/atomic_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <zlib.h>

#include "nn/io/safetensors.h"
#include "nn/io/testing/io_test_util.h"

namespace ddp::nn::io {
namespace {

using test_util::ErrorOf;
using ::testing::AllOf;
using ::testing::HasSubstr;

// A new, empty folder of this test's own under TEST_TMPDIR: every file the
// tests make or let the writer replace lies inside it.
std::string FreshDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string templ = std::string(base ? base : "/tmp") + "/atomic_XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << templ << ": " << std::strerror(errno);
    return "";
  }
  return templ;
}

std::vector<std::string> SortedFilesIn(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  while (dirent* e = d != nullptr ? ::readdir(d) : nullptr) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
  }
  if (d != nullptr) ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

void MakeFile(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size())) << path;
  ::close(fd);
}

// Sets `path`'s access and modification times to `seconds_ago` before now.
void MakeOld(const std::string& path, time_t seconds_ago) {
  timespec now{};
  ASSERT_EQ(::clock_gettime(CLOCK_REALTIME, &now), 0);
  const timespec times[2] = {{now.tv_sec - seconds_ago, 0}, {now.tv_sec - seconds_ago, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), times, 0), 0) << path << ": " << std::strerror(errno);
}

// Writes `bytes` to `path` through an AtomicFileWriter and commits.
void SaveThroughWriter(const std::string& path, const std::string& bytes) {
  AtomicFileWriter out(path);
  out.Write(bytes.data(), bytes.size());
  out.Commit();
}

// A listening-free UNIX socket bound at `dir`/`name`, its descriptor
// returned. Bound through /proc/self/fd so that a long TEST_TMPDIR does not
// overflow sun_path's 108 bytes.
int BindUnixSocket(const std::string& dir, const std::string& name) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) {
    ADD_FAILURE() << dir << ": " << std::strerror(errno);
    return -1;
  }
  const std::string via = "/proc/self/fd/" + std::to_string(dfd) + "/" + name;
  const int sfd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (sfd < 0 || via.size() >= sizeof(addr.sun_path)) {
    ADD_FAILURE() << "socket for " << via << ": " << std::strerror(errno);
    ::close(dfd);
    return -1;
  }
  std::memcpy(addr.sun_path, via.c_str(), via.size() + 1);
  if (::bind(sfd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    ADD_FAILURE() << "bind " << via << ": " << std::strerror(errno);
  }
  ::close(dfd);
  return sfd;
}

// Before, only a folder was refused: a FIFO or a socket at the target (or
// at the end of a symbolic link) was replaced by the new regular file
// through the rename, as a checkpoint saved to /dev/null once replaced the
// system's /dev/null. Now the writer refuses it before making any file,
// naming the path and what it is, and leaves it as it was.
TEST(AtomicFileWriter, AFifoASocketOrALinkToOneIsRefusedAndLeftAsItIs) {
  const std::string dir = FreshDir();
  ASSERT_FALSE(dir.empty());
  const std::string fifo = dir + "/c.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0) << std::strerror(errno);
  const std::string sock = dir + "/c.sock";
  const int sfd = BindUnixSocket(dir, "c.sock");
  ASSERT_GE(sfd, 0);
  const std::string link = dir + "/link";
  ASSERT_EQ(::symlink("c.fifo", link.c_str()), 0) << std::strerror(errno);
  struct stat fifo_before{}, sock_before{};
  ASSERT_EQ(::lstat(fifo.c_str(), &fifo_before), 0);
  ASSERT_EQ(::lstat(sock.c_str(), &sock_before), 0);
  ASSERT_TRUE(S_ISSOCK(sock_before.st_mode));
  const std::vector<std::string> all = {"c.fifo", "c.sock", "link"};
  ASSERT_EQ(SortedFilesIn(dir), all);

  EXPECT_EQ(ErrorOf([&] { SaveThroughWriter(fifo, "new"); }),
            "cannot write a file at '" + fifo + "': it is a FIFO, not a regular file; it was left as it is");
  EXPECT_EQ(ErrorOf([&] { SaveThroughWriter(sock, "new"); }),
            "cannot write a file at '" + sock + "': it is a socket, not a regular file; it was left as it is");
  EXPECT_EQ(ErrorOf([&] { SaveThroughWriter(link, "new"); }),
            "cannot write a file at '" + link + "': it is a symbolic link to '" + fifo +
                "', which is a FIFO, not a regular file; both were left as they are");

  struct stat fifo_after{}, sock_after{}, link_after{};
  ASSERT_EQ(::lstat(fifo.c_str(), &fifo_after), 0);
  ASSERT_EQ(::lstat(sock.c_str(), &sock_after), 0);
  ASSERT_EQ(::lstat(link.c_str(), &link_after), 0);
  EXPECT_TRUE(S_ISFIFO(fifo_after.st_mode));
  EXPECT_EQ(fifo_after.st_ino, fifo_before.st_ino);
  EXPECT_TRUE(S_ISSOCK(sock_after.st_mode));
  EXPECT_EQ(sock_after.st_ino, sock_before.st_ino);
  EXPECT_TRUE(S_ISLNK(link_after.st_mode));
  // No temporary left behind, nothing new made.
  EXPECT_EQ(SortedFilesIn(dir), all);
  ::close(sfd);
}

// The target was looked at only when the writer was made: a FIFO put in
// its place during a long write was replaced by the rename in Commit. Now
// Commit looks again before the rename and refuses the same way, leaving
// the FIFO as it is and no temporary behind.
TEST(AtomicFileWriter, AFifoPutAtTheTargetDuringTheWriteIsRefusedByCommit) {
  const std::string dir = FreshDir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/c.bin";
  {
    AtomicFileWriter out(path);
    out.Write("new", 3);
    ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0) << path << ": " << std::strerror(errno);
    struct stat before{};
    ASSERT_EQ(::lstat(path.c_str(), &before), 0);
    const std::string temp = out.temp_path();
    EXPECT_THAT(ErrorOf([&] { out.Commit(); }),
                AllOf(HasSubstr("cannot write a file at '" + path + "'"), HasSubstr("it is a FIFO now"),
                      HasSubstr("it was left as it is")));
    struct stat after{};
    ASSERT_EQ(::lstat(path.c_str(), &after), 0) << path << ": " << std::strerror(errno);
    EXPECT_TRUE(S_ISFIFO(after.st_mode));
    EXPECT_EQ(after.st_ino, before.st_ino);
    // Gone already, not only once the writer is destroyed.
    EXPECT_NE(::access(temp.c_str(), F_OK), 0) << temp;
    // And nothing is renamed into place by a second try.
    EXPECT_THAT(ErrorOf([&] { out.Commit(); }), HasSubstr(path));
  }
  EXPECT_EQ(SortedFilesIn(dir), std::vector<std::string>{"c.bin"});
}

// CommitUnlessPresent puts the new file in place where no file is, and
// leaves one that is there (here, put there during the write, as another
// process writing the same content would), removing its temporary.
TEST(AtomicFileWriter, CommitUnlessPresentNeverReplacesAFileAtTheTarget) {
  const std::string dir = FreshDir();
  ASSERT_FALSE(dir.empty());
  const std::string placed = dir + "/placed.bin", taken = dir + "/taken.bin";
  {
    AtomicFileWriter out(placed);
    out.Write("new", 3);
    EXPECT_TRUE(out.CommitUnlessPresent());
  }
  {
    AtomicFileWriter out(taken);
    out.Write("new", 3);
    MakeFile(taken, "theirs");
    struct stat before{};
    ASSERT_EQ(::lstat(taken.c_str(), &before), 0);
    const std::string temp = out.temp_path();
    EXPECT_FALSE(out.CommitUnlessPresent());
    EXPECT_NE(::access(temp.c_str(), F_OK), 0) << temp << " was left";
    struct stat after{};
    ASSERT_EQ(::lstat(taken.c_str(), &after), 0);
    EXPECT_EQ(after.st_ino, before.st_ino) << taken << " was replaced";
    // Nothing is left to put in place by a later Commit.
    EXPECT_THAT(ErrorOf([&] { out.Commit(); }), HasSubstr(taken));
  }
  EXPECT_EQ(SortedFilesIn(dir), (std::vector<std::string>{"placed.bin", "taken.bin"}));
  for (const auto& [path, bytes] : {std::pair<std::string, std::string>{placed, "new"}, {taken, "theirs"}}) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    ASSERT_NE(f, nullptr) << path;
    char buf[16];
    const size_t n = std::fread(buf, 1, sizeof(buf), f);
    std::fclose(f);
    EXPECT_EQ(std::string(buf, n), bytes) << path;
  }
}

// A folder is refused as before, now in the same words as the others.
TEST(AtomicFileWriter, AFolderIsRefusedNamingIt) {
  const std::string dir = FreshDir();
  ASSERT_FALSE(dir.empty());
  const std::string folder = dir + "/c.bin";
  ASSERT_EQ(::mkdir(folder.c_str(), 0755), 0);
  EXPECT_THAT(ErrorOf([&] { SaveThroughWriter(folder, "new"); }),
              AllOf(HasSubstr("'" + folder + "'"), HasSubstr("it is a folder, not a regular file")));
  EXPECT_EQ(SortedFilesIn(dir), std::vector<std::string>{"c.bin"});
}

// A failed system call names the file the caller asked for first (the
// path, then the file its link leads to), its reason, and only then the
// temporary file it was about. It used to lead with the temporary's name,
// which the caller never gave.
TEST(AtomicFileWriter, AFailedCallNamesThePathAskedForFirstAndThenTheTemporary) {
  const std::string dir = FreshDir();
  const std::string missing = dir + "/missing/f.bin";
  {
    const std::string msg = ErrorOf([&] { AtomicFileWriter out(missing); });
    EXPECT_EQ(msg.rfind(missing + ": cannot create temporary file: " + std::strerror(ENOENT) + " (temporary file " +
                            missing + ".tmp.",
                        0),
              0u)
        << msg;
  }
  // A write past the file size limit (EFBIG), through a symbolic link.
  const std::string target = dir + "/target.bin";
  const std::string link = dir + "/link.bin";
  ASSERT_EQ(::symlink(target.c_str(), link.c_str()), 0) << std::strerror(errno);
  // The 1 KiB limit and the ignored SIGXFSZ (whose default ends the
  // process) last for this block only, whatever leaves it: later tests in
  // this binary write more than 1 KiB.
  struct SmallFileLimit {
    rlimit old_limit{};
    void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);
    bool set = false;
    SmallFileLimit() {
      if (::getrlimit(RLIMIT_FSIZE, &old_limit) != 0) return;
      rlimit limit = old_limit;
      limit.rlim_cur = 1024;
      set = ::setrlimit(RLIMIT_FSIZE, &limit) == 0;
    }
    ~SmallFileLimit() {
      if (set) ::setrlimit(RLIMIT_FSIZE, &old_limit);
      std::signal(SIGXFSZ, old_handler);
    }
  };
  std::string msg, commit_msg, temp;
  {
    SmallFileLimit small;
    ASSERT_TRUE(small.set) << "setrlimit(RLIMIT_FSIZE): " << std::strerror(errno);
    AtomicFileWriter out(link);
    temp = out.temp_path();
    const std::string bytes(4096, 'x');
    msg = ErrorOf([&] { out.Write(bytes.data(), bytes.size()); });
    commit_msg = ErrorOf([&] { out.Commit(); });
  }
  EXPECT_EQ(msg, link + " (a symbolic link to " + target + "): write failed: " + std::strerror(EFBIG) +
                     " (temporary file " + temp + ")");
  // The commit that follows refuses the short file, naming the link too.
  EXPECT_EQ(commit_msg.rfind(link + " (a symbolic link to " + target + "): an earlier write", 0), 0u) << commit_msg;
  EXPECT_EQ(SortedFilesIn(dir), (std::vector<std::string>{"link.bin"})) << "the temporary was left";
}

// Before, only temporaries carrying this host's name were ever removed: a
// container restarted under a new host name (a new pod's name) never got
// back the space its killed writers' temporaries took in a persistent
// folder. Now another host's temporary goes once nobody holds it locked
// and it has not changed for an hour; one written to lately (a live writer
// on another host whose lock this host may not see, as on NFS with
// local_lock) or a locked one stays.
TEST(AtomicFileWriter, AnotherHostsTemporaryGoesWhenUnlockedAndAnHourIdle) {
  const std::string dir = FreshDir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/c.bin";
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  // The name a writer here gives its temporary, less its host.
  std::string stem;
  {
    AtomicFileWriter probe(path);
    stem = probe.temp_path().substr(dir.size() + 1);
  }
  const std::string suffix = std::string(".") + host;
  ASSERT_GT(stem.size(), suffix.size());
  ASSERT_EQ(stem.substr(stem.size() - suffix.size()), suffix) << stem;
  stem.resize(stem.size() - suffix.size());

  const std::string idle = stem + ".old-pod-7f9c.cluster.local";  // killed two hours ago
  const std::string recent = stem + ".pod-on-another-node";     // written ten minutes ago
  const std::string locked = stem + ".pod-holding-its-lock";     // idle, but its writer lives
  for (const std::string& name : {idle, recent, locked}) MakeFile(dir + "/" + name, "partial");
  MakeOld(dir + "/" + idle, 2 * 3600);
  MakeOld(dir + "/" + recent, 10 * 60);
  MakeOld(dir + "/" + locked, 2 * 3600);
  const int lock_fd = ::open((dir + "/" + locked).c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(lock_fd, 0);
  ASSERT_EQ(::flock(lock_fd, LOCK_EX | LOCK_NB), 0);

  SaveThroughWriter(path, "new");
  std::vector<std::string> expected = {"c.bin", recent, locked};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(SortedFilesIn(dir), expected);

  // Once its writer's lock is gone, the idle one goes too.
  ::close(lock_fd);
  SaveThroughWriter(path, "newer");
  expected = {"c.bin", recent};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(SortedFilesIn(dir), expected);
}

// `<first 100 bytes>.<crc>.tmp.`: how a writer starts its temporaries'
// names for a file name too long to keep whole, computed here from its
// definition (a 149-byte ASCII name: no UTF-8 sequence to back up over).
std::string ShortenedPrefixOf(const std::string& base) {
  const uLong crc = crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(base.data()),
                          static_cast<uInt>(base.size()));
  char hex[9];
  std::snprintf(hex, sizeof(hex), "%08lx", static_cast<unsigned long>(crc & 0xffffffffu));
  return base.substr(0, 100) + "." + hex + ".tmp.";
}

// Before, whether a long file name was cut in its temporaries' names
// depended on the length of the writing host's name: a 149-byte name was
// kept whole on a host with a short name and cut on one whose name has 64
// bytes (Linux's longest), and each host's cleanup looked only for its own
// form, so the other host's dead writers' temporaries were never removed.
// Now the cut is made for every name longer than 148 bytes, whatever the
// host, and the cleanup looks for both forms (writers built before left
// the other).
TEST(AtomicFileWriter, ALongNamesTemporariesAreFoundWhateverTheHostNamesLength) {
  const std::string dir = FreshDir();
  ASSERT_FALSE(dir.empty());
  const std::string longest = std::string(145, 'n') + ".bin";  // 149 bytes: cut
  const std::string kept = std::string(144, 'k') + ".bin";     // 148 bytes: kept whole
  const std::string cut_prefix = ShortenedPrefixOf(longest);
  {
    AtomicFileWriter probe(dir + "/" + longest);
    EXPECT_EQ(probe.temp_path().rfind(dir + "/" + cut_prefix, 0), 0u) << probe.temp_path();
    AtomicFileWriter whole(dir + "/" + kept);
    EXPECT_EQ(whole.temp_path().rfind(dir + "/" + kept + ".tmp.", 0), 0u) << whole.temp_path();
  }
  ASSERT_EQ(SortedFilesIn(dir), std::vector<std::string>{});

  const std::string long_host = "node-" + std::string(59, 'h');  // 64 bytes
  // Dead writers' temporaries of `longest`, unlocked and idle for two
  // hours: one from a host with a 64-byte name (cut), one from a host with
  // a short name by a writer built before (kept whole).
  const std::string cut = cut_prefix + "4242.3-0123abcd." + long_host;
  const std::string whole = longest + ".tmp.4243.0-89abcdef.short-host";
  ASSERT_LE(cut.size(), 255u);
  ASSERT_LE(whole.size(), 255u);
  for (const std::string& name : {cut, whole}) {
    MakeFile(dir + "/" + name, "partial");
    MakeOld(dir + "/" + name, 2 * 3600);
  }
  SaveThroughWriter(dir + "/" + longest, "new");
  EXPECT_EQ(SortedFilesIn(dir), std::vector<std::string>{longest});
}

}  // namespace
}  // namespace ddp::nn::io
