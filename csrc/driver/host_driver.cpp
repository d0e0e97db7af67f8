// Host backend: physical chunks are slots of one memfd (one file, so thousands of chunks do not
// exhaust file descriptors); a chunk is committed with fallocate (real RAM, like cuMemCreate) and
// returned with a punched hole. "host-lazy" commits nothing: the memfd only grows (sparse), so a
// page takes RAM when first touched. A trace replay never writes, so it makes the same
// decisions as on "host" without holding the trace's peak in RAM (a GPU's 80 GB trace replays on
// a laptop); the machine's RAM is then no limit (total_memory 0 = unknown).
// Mapping = mmap(MAP_FIXED|MAP_SHARED) of the slot over a PROT_NONE reservation; unmapping =
// mmap(MAP_FIXED) of PROT_NONE anonymous memory back over it, so the address stays reserved. Streams do not exist here: events are trivially complete (handle 0),
// while the allocator keeps exactly the bookkeeping it keeps on cuda.
//
// fork(): every reservation and mapping is MADV_DONTFORK, so a forked child inherits none of the
// allocator's memory (the memfd is MAP_SHARED: a child writing or punching it would change the
// parent's bytes). The allocator marks itself dead in the child (allocator.cpp).
//
// Failures: EINTR is retried; ENOMEM/ENOSPC/EFBIG (no memory, or the memfd cannot grow) are
// DriverOutOfMemory; anything else is std::runtime_error with the errno text. Every call either
// succeeds or leaves nothing behind (a failed fallocate is punched back, a failed map is unmapped).
//
// Test hook: inject_fault makes chosen calls fail with a chosen errno (see driver.hpp).
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <vector>

#include "driver/driver.hpp"

namespace vmalloc {
namespace driver {
namespace {

enum Call : int { kCreate, kRelease, kMap, kUnmap, kReserve, kUnreserve, kRecord, kAny, kNumCalls };
const char* const kCallNames[kNumCalls] = {"create", "release", "map", "unmap", "reserve", "unreserve", "record", "any"};

std::string sys_error(const char* what, int err) {
  return std::string("vmalloc host backend: ") + what + " failed: " + std::strerror(err);
}

[[noreturn]] void fail(const char* what, int err) {
  if (err == ENOMEM || err == ENOSPC || err == EFBIG) throw DriverOutOfMemory(sys_error(what, err));
  throw std::runtime_error(sys_error(what, err));
}

class HostDriver final : public Driver {
 public:
  explicit HostDriver(bool commit) : commit_(commit) {
    fd_ = static_cast<int>(::syscall(SYS_memfd_create, "vmalloc-chunks", 1u /*MFD_CLOEXEC*/));
    if (fd_ < 0) throw std::runtime_error(sys_error("memfd_create", errno));
  }
  ~HostDriver() override { shutdown(); }

  const char* name() const override { return commit_ ? "host" : "host-lazy"; }
  size_t granularity() const override { return host_granularity(); }
  size_t total_memory() const override {
    long pages = ::sysconf(_SC_PHYS_PAGES);
    return commit_ && pages > 0 ? static_cast<size_t>(pages) * host_granularity() : 0;
  }
  size_t free_memory() override {
    if (!commit_) return SIZE_MAX / 2;  // no limit but the budget (and no overflow in a sum)
    long pages = ::sysconf(_SC_AVPHYS_PAGES);
    return pages > 0 ? static_cast<size_t>(pages) * host_granularity() : 0;
  }

  uintptr_t reserve(size_t size) override {
    void* p = MAP_FAILED;
    int err = syscall_or_fault(kReserve, [&] {
      p = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      return p != MAP_FAILED;
    });
    if (err) fail("mmap(PROT_NONE) reserve", err);
    // Best effort: a reservation a child inherits holds nothing (PROT_NONE, private).
    ::madvise(p, size, MADV_DONTFORK);
    return reinterpret_cast<uintptr_t>(p);
  }
  void unreserve(uintptr_t va, size_t size) override {
    int err = syscall_or_fault(kUnreserve, [&] { return ::munmap(reinterpret_cast<void*>(va), size) == 0; });
    if (err) fail("munmap", err);
  }

  ChunkHandle create(size_t size) override {
    if (chunk_bytes_ == 0) chunk_bytes_ = size;
    if (size != chunk_bytes_) throw std::logic_error("vmalloc host backend: chunks must share one size");
    // Reserve the bookkeeping first: once the pages are committed nothing may fail.
    if (free_slots_.capacity() < next_slot_ + 1) free_slots_.reserve(2 * (next_slot_ + 1));
    size_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = next_slot_++;
    }
    // Commit the pages now: a chunk is real memory from creation on, as with cuMemCreate
    // (host-lazy: the file only grows to cover the slot, so mapping it is valid).
    int err = syscall_or_fault(kCreate, [&] {
      if (commit_) return ::fallocate(fd_, 0, offset(slot), off(size)) == 0;
      off_t end = offset(slot + 1);
      if (end <= file_bytes_) return true;
      if (::ftruncate(fd_, end) != 0) return false;
      file_bytes_ = end;
      return true;
    });
    if (err) {
      punch(slot);  // a failed fallocate may have committed part of the range
      free_slots_.push_back(slot);
      fail(commit_ ? "fallocate" : "ftruncate", err);
    }
    return slot + 1;
  }
  void release(ChunkHandle h) override {
    size_t slot = h - 1;
    int err = syscall_or_fault(kRelease, [&] { return punch(slot); });
    if (err) fail("fallocate(PUNCH_HOLE)", err);
    free_slots_.push_back(slot);  // capacity reserved by create
  }

  void map(uintptr_t va, size_t size, ChunkHandle h) override {
    void* want = reinterpret_cast<void*>(va);
    int err = syscall_or_fault(kMap, [&] {
      return ::mmap(want, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_, offset(h - 1)) != MAP_FAILED;
    });
    if (err) {
      // A failed MAP_FIXED may already have replaced the reservation there: put PROT_NONE back.
      ::mmap(want, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      ::madvise(want, size, MADV_DONTFORK);
      fail("mmap(MAP_FIXED|MAP_SHARED)", err);
    }
    // The new mapping does not inherit the reservation's flag: a child must never reach the memfd.
    if (::madvise(want, size, MADV_DONTFORK) != 0) {
      int e = errno;
      ::mmap(want, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      fail("madvise(MADV_DONTFORK)", e);
    }
    mapped_ += size;
  }
  void set_access(uintptr_t, size_t) override {}  // mapped read-write already
  void unmap(uintptr_t va, size_t size) override {
    void* want = reinterpret_cast<void*>(va);
    int err = syscall_or_fault(kUnmap, [&] {
      return ::mmap(want, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) !=
             MAP_FAILED;
    });
    if (err) fail("mmap(PROT_NONE) over a chunk", err);
    ::madvise(want, size, MADV_DONTFORK);  // best effort: what is left there is PROT_NONE anyway
    mapped_ -= size;
  }

  EventHandle record_event(uintptr_t) override {
    int err = syscall_or_fault(kRecord, [] { return true; });
    if (err) fail("event record", err);
    return 0;
  }
  bool event_done(EventHandle) override { return true; }
  void event_wait(EventHandle) override {}
  void event_destroy(EventHandle) override {}

  void shutdown() noexcept override {
    if (fd_ >= 0) ::close(fd_);  // frees every chunk still committed (nothing maps it any more)
    fd_ = -1;
  }

  void inject_fault(const std::string& call, uint64_t nth, int err, uint64_t count) override {
    int c = 0;
    while (c < kNumCalls && call != kCallNames[c]) ++c;
    if (c == kNumCalls)
      throw std::invalid_argument("call: unknown driver call '" + call +
                                  "' (expected create, release, map, unmap, reserve, unreserve, record or any)");
    if (nth != 0 && err <= 0) throw std::invalid_argument("errno: must be a positive errno value, got " + std::to_string(err));
    faults_[c] = Fault{nth, err, count};
  }
  Usage usage() const override {
    Usage u;
    struct stat sb;
    if (fd_ >= 0 && ::fstat(fd_, &sb) == 0) u.committed_bytes = static_cast<size_t>(sb.st_blocks) * 512;
    u.mapped_bytes = mapped_;
    u.faults_fired = faults_fired_;
    return u;
  }

 private:
  struct Fault {
    uint64_t countdown = 0;  // 0: disarmed; 1: the next call fails
    int err = 0;
    uint64_t count = 1;      // failures left once it fires (0: forever)
  };

  off_t offset(size_t slot) const { return static_cast<off_t>(slot * chunk_bytes_); }
  static off_t off(size_t n) { return static_cast<off_t>(n); }
  bool punch(size_t slot) {
    return ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset(slot), off(chunk_bytes_)) == 0;
  }

  // An injected errno for this call, or 0.
  int injected(Call c) {
    for (Call k : {c, kAny}) {
      Fault& f = faults_[k];
      if (f.countdown == 0) continue;
      if (f.countdown > 1) {
        --f.countdown;
        continue;
      }
      int err = f.err;
      if (f.count == 1) f = Fault{};
      else if (f.count > 1) --f.count;
      ++faults_fired_;
      return err;
    }
    return 0;
  }
  // Runs `ok()` (the system call; true on success) unless a fault is injected; retries EINTR.
  // Returns 0 or the errno of the failure.
  template <class F>
  int syscall_or_fault(Call c, F&& ok) {
    for (int tries = 0;; ++tries) {
      int err = injected(c);
      if (!err) err = ok() ? 0 : errno;
      if (err != EINTR || tries == 1000) return err;
    }
  }

  const bool commit_;       // false: host-lazy
  int fd_ = -1;
  off_t file_bytes_ = 0;    // host-lazy: the memfd's size
  size_t chunk_bytes_ = 0;
  size_t next_slot_ = 0;
  size_t mapped_ = 0;
  std::vector<size_t> free_slots_;
  Fault faults_[kNumCalls];
  uint64_t faults_fired_ = 0;
};

}  // namespace

size_t host_granularity() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

std::unique_ptr<Driver> make_host_driver(bool commit) { return std::make_unique<HostDriver>(commit); }

}  // namespace driver
}  // namespace vmalloc
