// Host backend: physical chunks are slots of one memfd (one file, so thousands of chunks do not
// exhaust file descriptors); a chunk is committed with fallocate (real RAM, like cuMemCreate) and
// returned with a punched hole. Mapping = mmap(MAP_FIXED|MAP_SHARED) of the slot over a PROT_NONE
// reservation; unmapping = mmap(MAP_FIXED) of PROT_NONE anonymous memory back over it, so the
// address stays reserved. Streams do not exist here: events are trivially complete (handle 0),
// while the allocator keeps exactly the bookkeeping it keeps on cuda.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "driver/driver.hpp"

namespace vmalloc {
namespace driver {
namespace {

std::string sys_error(const char* what) {
  return std::string("vmalloc host backend: ") + what + " failed: " + std::strerror(errno);
}

class HostDriver final : public Driver {
 public:
  HostDriver() {
    fd_ = static_cast<int>(::syscall(SYS_memfd_create, "vmalloc-chunks", 1u /*MFD_CLOEXEC*/));
    if (fd_ < 0) throw std::runtime_error(sys_error("memfd_create"));
  }
  ~HostDriver() override {
    if (fd_ >= 0) ::close(fd_);
  }

  const char* name() const override { return "host"; }
  size_t granularity() const override { return host_granularity(); }
  size_t total_memory() const override {
    long pages = ::sysconf(_SC_PHYS_PAGES);
    return pages > 0 ? static_cast<size_t>(pages) * host_granularity() : 0;
  }

  uintptr_t reserve(size_t size) override {
    void* p = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error(sys_error("mmap(PROT_NONE) reserve"));
    return reinterpret_cast<uintptr_t>(p);
  }
  void unreserve(uintptr_t va, size_t size) override {
    if (::munmap(reinterpret_cast<void*>(va), size) != 0) throw std::runtime_error(sys_error("munmap"));
  }

  ChunkHandle create(size_t size) override {
    if (chunk_bytes_ == 0) chunk_bytes_ = size;
    if (size != chunk_bytes_) throw std::logic_error("vmalloc host backend: chunks must share one size");
    size_t slot;
    if (!free_slots_.empty()) {
      slot = free_slots_.back();
      free_slots_.pop_back();
    } else {
      slot = next_slot_++;
    }
    // Commit the pages now: a chunk is real memory from creation on, as with cuMemCreate.
    if (::fallocate(fd_, 0, static_cast<off_t>(slot * size), static_cast<off_t>(size)) != 0) {
      int err = errno;
      free_slots_.push_back(slot);
      errno = err;
      if (err == ENOSPC || err == ENOMEM) throw DriverOutOfMemory(sys_error("fallocate"));
      throw std::runtime_error(sys_error("fallocate"));
    }
    return slot + 1;
  }
  void release(ChunkHandle h) override {
    size_t slot = h - 1;
    if (::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(slot * chunk_bytes_),
                    static_cast<off_t>(chunk_bytes_)) != 0)
      throw std::runtime_error(sys_error("fallocate(PUNCH_HOLE)"));
    free_slots_.push_back(slot);
  }

  void map(uintptr_t va, size_t size, ChunkHandle h) override {
    void* want = reinterpret_cast<void*>(va);
    void* p = ::mmap(want, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
                     static_cast<off_t>((h - 1) * chunk_bytes_));
    if (p == MAP_FAILED) throw std::runtime_error(sys_error("mmap(MAP_FIXED|MAP_SHARED)"));
  }
  void set_access(uintptr_t, size_t) override {}  // mapped read-write already
  void unmap(uintptr_t va, size_t size) override {
    void* p = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error(sys_error("mmap(PROT_NONE) over a chunk"));
  }

  EventHandle record_event(uintptr_t) override { return 0; }
  bool event_done(EventHandle) override { return true; }
  void event_wait(EventHandle) override {}
  void event_destroy(EventHandle) override {}

 private:
  int fd_ = -1;
  size_t chunk_bytes_ = 0;
  size_t next_slot_ = 0;
  std::vector<size_t> free_slots_;
};

}  // namespace

size_t host_granularity() {
  static const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

std::unique_ptr<Driver> make_host_driver() { return std::make_unique<HostDriver>(); }

}  // namespace driver
}  // namespace vmalloc
