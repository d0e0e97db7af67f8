/* A strict stand-in for libcuda.so.1: the CUDA driver calls vmalloc's cuda backend makes
 * (csrc/driver/cuda_driver.cpp), emulated with real page mappings on the host, so that every line
 * of that backend runs in CI on machines without a GPU (tests/test_fake_cuda.py).
 *
 * Emulation: cuMemAddressReserve reserves PROT_NONE address space aligned to the granularity;
 * cuMemCreate takes granularity-sized slots of one sparse memfd per device ("device memory", its
 * size is the device's total memory: cuMemCreate beyond it is CUDA_ERROR_OUT_OF_MEMORY);
 * cuMemMap maps a handle's slots there with MAP_FIXED (still inaccessible), cuMemSetAccess makes
 * it readable and writable, cuMemUnmap puts PROT_NONE address space back. Events complete at once
 * unless their stream is held (fakecuda_stream_hold): then cuEventQuery says CUDA_ERROR_NOT_READY
 * until the stream is let go, the way a kernel still running keeps it.
 *
 * Strictness: every misuse the driver documents as an error (unaligned sizes, mapping over a
 * mapping, unmapping part of a mapping, freeing a reservation that still has mappings, a double
 * release, an event recorded on another context's stream, a destroyed event or context used, a
 * call in a forked child, no current context) returns that error AND is recorded as a violation:
 * printed on stderr, appended to $FAKECUDA_REPORT when set, counted by fakecuda_get("violations").
 * Where the real driver is laxer (it needs no current context for the VMM calls), the fake is
 * stricter on purpose: vmalloc's rule is to make its device's primary context current first (for
 * cuMemCreate and cuMemMap: the context of the memory's own device).
 *
 * Test controls (ctypes): fakecuda_inject (the nth next call of a function fails with a CUresult),
 * fakecuda_stream_hold, fakecuda_get (live objects and counters), fakecuda_violation (messages),
 * fakecuda_deinit / fakecuda_revive (the driver shutting down at process exit: every call returns
 * CUDA_ERROR_DEINITIALIZED), fakecuda_reclaim (what a shut-down driver takes with it).
 * Knobs (environment, read at cuInit): FAKECUDA_DEVICES (3), FAKECUDA_TOTAL_MEM (bytes per device,
 * 4 GiB), FAKECUDA_GRANULARITY (2 MiB); FAKECUDA_NO_VMM (1: the devices lack the VMM API), read
 * at each cuDeviceGetAttribute.
 *
 * Declarations are written here, not taken from cuda.h, so the fake builds anywhere; they follow
 * the C ABI of the CUDA 12/13 headers (enums are ints, handles are pointers or 64-bit integers).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct Ctx* CUcontext;
typedef struct Stream* CUstream;
typedef struct Event* CUevent;

typedef struct {
  int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
  int id;
} CUmemLocation;
typedef struct {
  int type;                 /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
  int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_NONE = 0 */
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
} CUmemAllocationProp;
typedef struct {
  CUmemLocation location;
  int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

enum {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_DEINITIALIZED = 4,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_INVALID_HANDLE = 400,
  CUDA_ERROR_NOT_READY = 600,
  CUDA_ERROR_ILLEGAL_ADDRESS = 700,
  CUDA_ERROR_NOT_SUPPORTED = 801,
  CUDA_ERROR_UNKNOWN = 999,
};

#define STREAM_LEGACY ((CUstream)0x1)
#define STREAM_PER_THREAD ((CUstream)0x2)

/* ------------------------------------------------------------------------------------ state */

struct Stream {
  unsigned long long born; /* creation serial (fakecuda_reclaim) */
  CUcontext ctx;
  int held;                                  /* its work does not complete until let go */
  unsigned long long submitted, completed;   /* work queued on it / done, in order */
};
struct Ctx {
  int device;
  int refs;              /* primary context retains; 0 = not alive */
  struct Stream legacy;  /* what the NULL, legacy and per-thread handles name in this context */
};
struct Event {
  unsigned long long born;
  CUcontext ctx;
  CUstream stream;        /* where it was last recorded; NULL: never recorded */
  unsigned long long seq; /* the stream's work up to here */
};
typedef struct { /* device work queued on a stream that reads or writes [va, va + size) */
  CUstream stream;
  unsigned long long seq;
  CUdeviceptr va;
  size_t size;
} Use;
typedef struct {
  unsigned long long born;
  int device;
  size_t size, slot; /* first slot in the device's memfd */
  int mappings, released;
} Handle;
typedef struct {
  unsigned long long born;
  CUdeviceptr va;
  size_t size;
} Reservation;
typedef struct {
  unsigned long long born;
  CUdeviceptr va;
  size_t size, offset;
  Handle* h;
  unsigned access; /* the devices granted read-write access (a bit each) */
} Mapping;

#define MAX_DEVICES 8
typedef struct {
  struct Ctx ctx;
  int fd;              /* the device's memory: a sparse memfd of total_mem bytes */
  unsigned char* used; /* one byte per granularity slot */
  size_t slots, committed;
} Device;

/* a vector of pointers, for the live objects (few: linear search is fine) */
typedef struct {
  void** p;
  size_t n, cap;
} Vec;
static void vec_push(Vec* v, void* x) {
  if (v->n == v->cap) {
    v->cap = v->cap ? 2 * v->cap : 16;
    v->p = realloc(v->p, v->cap * sizeof *v->p);
    if (!v->p) abort();
  }
  v->p[v->n++] = x;
}
static long vec_find(const Vec* v, const void* x) {
  for (size_t i = 0; i < v->n; ++i)
    if (v->p[i] == x) return (long)i;
  return -1;
}
static void vec_remove_at(Vec* v, size_t i) { v->p[i] = v->p[--v->n]; }

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread CUcontext current;
static int initialized, ndevices;
static pid_t owner_pid;
static size_t total_mem, gran;
static Device devices[MAX_DEVICES];
static Vec reservations, handles, mappings, events, streams, uses;
static Vec cover; /* scratch of covering(), under mu */
static long long n_violations, n_event_syncs, n_ctx_syncs, n_calls;
static unsigned long long n_born; /* serial of the last object created */
static int deinitialized;         /* fakecuda_deinit: the driver is shutting down */

/* injected failures */
static char inject_name[64];
static unsigned long long inject_nth, inject_left;
static int inject_result;
static long long n_injected;

#define MAX_KEPT 64
static char* kept[MAX_KEPT]; /* the first violation messages, for fakecuda_violation */

/* ------------------------------------------------------------------------------- violations */

static void violation(const char* fn, const char* fmt, ...) {
  char msg[512];
  int k = snprintf(msg, sizeof msg, "fake libcuda: %s: ", fn);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg + k, sizeof msg - (size_t)k, fmt, ap);
  va_end(ap);
  if (n_violations < MAX_KEPT) kept[n_violations] = strdup(msg);
  ++n_violations;
  fprintf(stderr, "%s\n", msg);
  const char* path = getenv("FAKECUDA_REPORT");
  if (path && *path) {
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
      char line[600];
      int n = snprintf(line, sizeof line, "pid %d: %s\n", (int)getpid(), msg);
      if (write(fd, line, (size_t)n) < 0) { /* nothing more to do */ }
      close(fd);
    }
  }
}

/* Every entry point: count, apply an injected failure, refuse forked children and calls before
 * cuInit. Returns CUDA_SUCCESS to go on. Called with mu held. */
#define MAX_FNS 64
static const char* fn_names[MAX_FNS]; /* the entry points' names (string literals) */
static long long fn_calls[MAX_FNS];

static CUresult enter(const char* fn, int needs_init) {
  ++n_calls;
  for (int i = 0; i < MAX_FNS; ++i) {
    if (!fn_names[i]) fn_names[i] = fn;
    if (fn_names[i] == fn || !strcmp(fn_names[i], fn)) {
      ++fn_calls[i];
      break;
    }
  }
  if (initialized && getpid() != owner_pid) {
    violation(fn, "called in a forked child (pid %d; the driver was initialized in pid %d): CUDA "
              "is not fork-safe, a child must not touch its parent's driver state",
              (int)getpid(), (int)owner_pid);
    return CUDA_ERROR_NOT_INITIALIZED;
  }
  /* the driver's state at process exit, not a misuse: every call says so, nothing is recorded */
  if (deinitialized) return CUDA_ERROR_DEINITIALIZED;
  if (inject_nth && (!strcmp(inject_name, fn) || !strcmp(inject_name, "any"))) {
    if (--inject_nth == 0) {
      ++n_injected;
      if (inject_left == 1) {
        inject_nth = 0; /* disarmed */
      } else {
        inject_nth = 1; /* the next call fails too */
        if (inject_left) --inject_left;
      }
      return inject_result;
    }
  }
  if (needs_init && !initialized) {
    violation(fn, "called before cuInit");
    return CUDA_ERROR_NOT_INITIALIZED;
  }
  return CUDA_SUCCESS;
}

static CUresult need_context(const char* fn) {
  if (!current) {
    violation(fn, "no current context (vmalloc makes its device's primary context current first)");
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  if (current->refs <= 0) {
    violation(fn, "the current context (device %d's primary context) was released", current->device);
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  return CUDA_SUCCESS;
}

#define LOCKED(fn, needs_init, body)        \
  do {                                      \
    pthread_mutex_lock(&mu);                \
    CUresult r_ = enter(fn, needs_init);    \
    if (r_ == CUDA_SUCCESS) r_ = (body);    \
    pthread_mutex_unlock(&mu);              \
    return r_;                              \
  } while (0)

#define NEED(x)                           \
  do {                                    \
    CUresult r2_ = (x);                   \
    if (r2_ != CUDA_SUCCESS) return r2_;  \
  } while (0)

/* -------------------------------------------------------------------------- init, devices */

static size_t env_size(const char* name, size_t fallback) {
  const char* s = getenv(name);
  if (!s || !*s) return fallback;
  char* end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  if (*end || v == 0) {
    fprintf(stderr, "fake libcuda: %s=%s is not a positive byte count\n", name, s);
    abort();
  }
  return (size_t)v;
}

static CUresult do_init(unsigned int flags) {
  if (flags != 0) {
    violation("cuInit", "flags must be 0, got %u", flags);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (initialized) return CUDA_SUCCESS;
  ndevices = (int)env_size("FAKECUDA_DEVICES", 3);
  if (ndevices > MAX_DEVICES) ndevices = MAX_DEVICES;
  total_mem = env_size("FAKECUDA_TOTAL_MEM", (size_t)4 << 30);
  gran = env_size("FAKECUDA_GRANULARITY", (size_t)2 << 20);
  total_mem -= total_mem % gran;
  for (int d = 0; d < ndevices; ++d) {
    Device* dev = &devices[d];
    dev->ctx.device = d;
    dev->ctx.legacy.ctx = &dev->ctx;
    dev->fd = memfd_create("fakecuda-device", MFD_CLOEXEC);
    if (dev->fd < 0 || ftruncate(dev->fd, (off_t)total_mem) != 0) return CUDA_ERROR_UNKNOWN;
    dev->slots = total_mem / gran;
    dev->used = calloc(dev->slots, 1);
    if (!dev->used) return CUDA_ERROR_UNKNOWN;
  }
  owner_pid = getpid();
  initialized = 1;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuInit(unsigned int flags) { LOCKED("cuInit", 0, do_init(flags)); }

static CUresult do_device_get(CUdevice* out, int ordinal) {
  if (!out || ordinal < 0 || ordinal >= ndevices) {
    violation("cuDeviceGet", "no device %d (the fake has %d)", ordinal, ndevices);
    return CUDA_ERROR_INVALID_DEVICE;
  }
  *out = ordinal;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice* out, int ordinal) { LOCKED("cuDeviceGet", 1, do_device_get(out, ordinal)); }

static CUresult do_device_count(int* n) {
  if (!n) return CUDA_ERROR_INVALID_VALUE;
  *n = ndevices;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int* n) { LOCKED("cuDeviceGetCount", 1, do_device_count(n)); }

static CUresult valid_device(const char* fn, CUdevice d) {
  if (d < 0 || d >= ndevices) {
    violation(fn, "no device %d", d);
    return CUDA_ERROR_INVALID_DEVICE;
  }
  return CUDA_SUCCESS;
}

/* Only the attribute vmalloc asks for: CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
static CUresult do_get_attribute(int* value, int attribute, CUdevice d) {
  NEED(valid_device("cuDeviceGetAttribute", d));
  if (!value) return CUDA_ERROR_INVALID_VALUE;
  if (attribute != 102) {
    violation("cuDeviceGetAttribute", "attribute %d: the fake answers 102 (VMM supported) only", attribute);
    return CUDA_ERROR_INVALID_VALUE;
  }
  const char* no = getenv("FAKECUDA_NO_VMM");
  *value = !(no && strcmp(no, "1") == 0);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice d) {
  LOCKED("cuDeviceGetAttribute", 1, do_get_attribute(value, attribute, d));
}

static CUresult do_total_mem(size_t* bytes, CUdevice d) {
  NEED(valid_device("cuDeviceTotalMem", d));
  if (!bytes) return CUDA_ERROR_INVALID_VALUE;
  *bytes = total_mem;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) { LOCKED("cuDeviceTotalMem", 1, do_total_mem(bytes, d)); }

/* free/total memory of the current context's device (its uncommitted slots) */
static CUresult do_mem_get_info(size_t* free_bytes, size_t* total_bytes) {
  NEED(need_context("cuMemGetInfo"));
  if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
  *free_bytes = total_mem - devices[current->device].committed;
  *total_bytes = total_mem;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  LOCKED("cuMemGetInfo", 1, do_mem_get_info(free_bytes, total_bytes));
}

/* ------------------------------------------------------------------------------- contexts */

static CUresult do_retain(CUcontext* out, CUdevice d) {
  NEED(valid_device("cuDevicePrimaryCtxRetain", d));
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  devices[d].ctx.refs++;
  *out = &devices[d].ctx;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* out, CUdevice d) {
  LOCKED("cuDevicePrimaryCtxRetain", 1, do_retain(out, d));
}

static void drop_context_objects(CUcontext c);

static CUresult do_release(CUdevice d) {
  NEED(valid_device("cuDevicePrimaryCtxRelease", d));
  if (devices[d].ctx.refs <= 0) {
    violation("cuDevicePrimaryCtxRelease", "device %d's primary context released more often than retained", d);
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  if (--devices[d].ctx.refs == 0) drop_context_objects(&devices[d].ctx);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) { LOCKED("cuDevicePrimaryCtxRelease", 1, do_release(d)); }

static CUresult do_get_current(CUcontext* out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = current;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext* out) { LOCKED("cuCtxGetCurrent", 1, do_get_current(out)); }

static CUresult valid_context(const char* fn, CUcontext c) {
  for (int d = 0; d < ndevices; ++d)
    if (c == &devices[d].ctx) {
      if (c->refs > 0) return CUDA_SUCCESS;
      violation(fn, "device %d's primary context is not retained (released, or never retained)", d);
      return CUDA_ERROR_INVALID_CONTEXT;
    }
  violation(fn, "%p is not a context", (void*)c);
  return CUDA_ERROR_INVALID_CONTEXT;
}

static CUresult do_set_current(CUcontext c) {
  if (c) NEED(valid_context("cuCtxSetCurrent", c));
  current = c;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext c) { LOCKED("cuCtxSetCurrent", 1, do_set_current(c)); }

/* The host waits until every stream of the current context got through its work (a held stream
 * too: the kernel that held it ends, as a real synchronize would wait for it). */
static CUresult do_ctx_sync(void) {
  NEED(need_context("cuCtxSynchronize"));
  for (size_t i = 0; i < streams.n; ++i) {
    CUstream s = streams.p[i];
    if (s->ctx == current) s->completed = s->submitted;
  }
  current->legacy.completed = current->legacy.submitted;
  ++n_ctx_syncs;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSynchronize(void) { LOCKED("cuCtxSynchronize", 1, do_ctx_sync()); }

/* ------------------------------------------------------------------------------ addresses */

static int aligned(unsigned long long x) { return x % gran == 0; }

static CUresult do_reserve(CUdeviceptr* out, size_t size, size_t alignment, CUdeviceptr addr,
                           unsigned long long flags) {
  const char* fn = "cuMemAddressReserve";
  NEED(need_context(fn));
  if (!out || size == 0 || !aligned(size) || flags != 0 || (alignment & (alignment - 1))) {
    violation(fn, "size %zu (granularity %zu), alignment %zu, flags %llu", size, gran, alignment, flags);
    return CUDA_ERROR_INVALID_VALUE;
  }
  (void)addr; /* a hint the driver may ignore */
  size_t align = alignment > gran ? alignment : gran;
  void* p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t lo = (uintptr_t)p, start = (lo + align - 1) / align * align;
  if (start > lo) munmap(p, start - lo);
  if (lo + size + align > start + size) munmap((void*)(start + size), lo + size + align - start - size);
  Reservation* r = malloc(sizeof *r);
  r->born = ++n_born;
  r->va = start;
  r->size = size;
  vec_push(&reservations, r);
  *out = start;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAddressReserve(CUdeviceptr* out, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
  LOCKED("cuMemAddressReserve", 1, do_reserve(out, size, alignment, addr, flags));
}

static Reservation* reservation_of(CUdeviceptr va, size_t size) {
  for (size_t i = 0; i < reservations.n; ++i) {
    Reservation* r = reservations.p[i];
    if (va >= r->va && va + size <= r->va + r->size) return r;
  }
  return NULL;
}

static CUresult do_address_free(CUdeviceptr va, size_t size) {
  const char* fn = "cuMemAddressFree";
  NEED(need_context(fn));
  for (size_t i = 0; i < reservations.n; ++i) {
    Reservation* r = reservations.p[i];
    if (r->va != va) continue;
    if (r->size != size) {
      violation(fn, "size %zu differs from the reservation's %zu at 0x%llx", size, r->size, va);
      return CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t j = 0; j < mappings.n; ++j) {
      Mapping* m = mappings.p[j];
      if (m->va >= va && m->va < va + size) {
        violation(fn, "the reservation at 0x%llx still has a mapping at 0x%llx (unmap first)", va, m->va);
        return CUDA_ERROR_INVALID_VALUE;
      }
    }
    munmap((void*)(uintptr_t)va, size);
    free(r);
    vec_remove_at(&reservations, i);
    return CUDA_SUCCESS;
  }
  violation(fn, "0x%llx is not the start of a reservation", va);
  return CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuMemAddressFree(CUdeviceptr va, size_t size) { LOCKED("cuMemAddressFree", 1, do_address_free(va, size)); }

/* ------------------------------------------------------------------------ physical memory */

static CUresult check_prop(const char* fn, const CUmemAllocationProp* prop) {
  if (!prop || prop->type != 1 || prop->requestedHandleTypes != 0 || prop->location.type != 1) {
    violation(fn, "allocation properties are not pinned device memory without shareable handles");
    return CUDA_ERROR_INVALID_VALUE;
  }
  return valid_device(fn, prop->location.id);
}

static CUresult do_granularity(size_t* out, const CUmemAllocationProp* prop, int option) {
  const char* fn = "cuMemGetAllocationGranularity";
  NEED(check_prop(fn, prop));
  if (!out || (option != 0 && option != 1)) return CUDA_ERROR_INVALID_VALUE;
  *out = gran;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemGetAllocationGranularity(size_t* out, const CUmemAllocationProp* prop, int option) {
  LOCKED("cuMemGetAllocationGranularity", 1, do_granularity(out, prop, option));
}

static CUresult do_create(CUmemGenericAllocationHandle* out, size_t size, const CUmemAllocationProp* prop,
                          unsigned long long flags) {
  const char* fn = "cuMemCreate";
  NEED(need_context(fn));
  NEED(check_prop(fn, prop));
  if (!out || size == 0 || !aligned(size) || flags != 0) {
    violation(fn, "size %zu is not a positive multiple of the granularity %zu (flags %llu)", size, gran, flags);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (current->device != prop->location.id) {
    /* the driver allows it; vmalloc's rule is that its own device's context is current */
    violation(fn, "memory of device %d created with device %d's context current", prop->location.id,
              current->device);
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  Device* dev = &devices[prop->location.id];
  size_t need = size / gran, run = 0;
  for (size_t s = 0; s < dev->slots; ++s) {
    run = dev->used[s] ? 0 : run + 1;
    if (run == need) {
      size_t first = s + 1 - need;
      memset(dev->used + first, 1, need);
      Handle* h = calloc(1, sizeof *h);
      h->born = ++n_born;
      h->device = prop->location.id;
      h->size = size;
      h->slot = first;
      vec_push(&handles, h);
      dev->committed += size;
      *out = (CUmemGenericAllocationHandle)(uintptr_t)h;
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_OUT_OF_MEMORY; /* the device is full: not a misuse */
}
EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle* out, size_t size, const CUmemAllocationProp* prop,
                            unsigned long long flags) {
  LOCKED("cuMemCreate", 1, do_create(out, size, prop, flags));
}

static Handle* handle_of(const char* fn, CUmemGenericAllocationHandle hv) {
  Handle* h = (Handle*)(uintptr_t)hv;
  if (vec_find(&handles, h) < 0) {
    violation(fn, "0x%llx is not a live allocation handle (released, or never created)", hv);
    return NULL;
  }
  return h;
}

static void free_handle(Handle* h) {
  Device* dev = &devices[h->device];
  fallocate(dev->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)(h->slot * gran), (off_t)h->size);
  memset(dev->used + h->slot, 0, h->size / gran);
  dev->committed -= h->size;
  vec_remove_at(&handles, (size_t)vec_find(&handles, h));
  free(h);
}

static CUresult do_release_handle(CUmemGenericAllocationHandle hv) {
  const char* fn = "cuMemRelease";
  NEED(need_context(fn));
  Handle* h = handle_of(fn, hv);
  if (!h) return CUDA_ERROR_INVALID_VALUE;
  if (h->released) {
    violation(fn, "handle 0x%llx released twice", hv);
    return CUDA_ERROR_INVALID_VALUE;
  }
  h->released = 1;
  if (h->mappings == 0) free_handle(h); /* else freed at its last unmap, as the driver does */
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle h) { LOCKED("cuMemRelease", 1, do_release_handle(h)); }

/* ------------------------------------------------------------------------------- mappings */

static CUresult do_map(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle hv,
                       unsigned long long flags) {
  const char* fn = "cuMemMap";
  NEED(need_context(fn));
  Handle* h = handle_of(fn, hv);
  if (!h) return CUDA_ERROR_INVALID_HANDLE;
  if (h->released) {
    violation(fn, "handle 0x%llx was released", hv);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (current->device != h->device) {
    violation(fn, "memory of device %d mapped with device %d's context current", h->device, current->device);
    return CUDA_ERROR_INVALID_CONTEXT;
  }
  if (!aligned(va) || size == 0 || !aligned(size) || !aligned(offset) || offset + size > h->size || flags) {
    violation(fn, "va 0x%llx, size %zu, offset %zu of a %zu-byte handle (granularity %zu)", va, size, offset,
              h->size, gran);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!reservation_of(va, size)) {
    violation(fn, "[0x%llx, +%zu) is not inside one reservation", va, size);
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (size_t i = 0; i < mappings.n; ++i) {
    Mapping* m = mappings.p[i];
    if (va < m->va + m->size && m->va < va + size) {
      violation(fn, "[0x%llx, +%zu) overlaps the mapping at 0x%llx", va, size, m->va);
      return CUDA_ERROR_INVALID_VALUE;
    }
  }
  void* p = mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, devices[h->device].fd,
                 (off_t)(h->slot * gran + offset));
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  Mapping* m = calloc(1, sizeof *m);
  m->born = ++n_born;
  m->va = va;
  m->size = size;
  m->offset = offset;
  m->h = h;
  vec_push(&mappings, m);
  h->mappings++;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h,
                         unsigned long long flags) {
  LOCKED("cuMemMap", 1, do_map(va, size, offset, h, flags));
}

/* The mappings covering [va, va + size) exactly, in address order, into `cover`; 0 when some
 * byte is unmapped or a mapping sticks out of the range. */
static size_t covering(CUdeviceptr va, size_t size) {
  cover.n = 0;
  for (CUdeviceptr at = va; at < va + size;) {
    Mapping* hit = NULL;
    for (size_t i = 0; i < mappings.n; ++i) {
      Mapping* m = mappings.p[i];
      if (m->va == at) hit = m;
    }
    if (!hit || hit->va + hit->size > va + size) return 0;
    vec_push(&cover, hit);
    at += hit->size;
  }
  return cover.n;
}

/* Work queued on a stream is done once the stream's `completed` reaches its sequence number. */
static unsigned long long submit(CUstream s) {
  ++s->submitted;
  if (!s->held) s->completed = s->submitted;
  return s->submitted;
}
static int event_pending(CUevent e) { return e->stream && e->seq > e->stream->completed; }

/* Unmapping memory that queued device work still uses: the driver does it (cuMemUnmap does not
 * wait for the device), the work then faults or reads another tensor's bytes. */
static void check_no_pending_use(const char* fn, CUdeviceptr va, size_t size) {
  for (size_t i = uses.n; i-- > 0;) {
    Use* u = uses.p[i];
    if (u->seq <= u->stream->completed) { /* done: forget it */
      vec_remove_at(&uses, i);
      free(u);
    } else if (u->va < va + size && va < u->va + u->size) {
      violation(fn, "[0x%llx, +%zu) unmapped while work queued on stream %p still uses [0x%llx, "
                "+%zu): wait for the stream's event first (PyTorch's ExpandableSegment "
                "synchronizes before unmapping for this reason)", va, size, (void*)u->stream, u->va,
                u->size);
    }
  }
}

static CUresult do_set_access(CUdeviceptr va, size_t size, const CUmemAccessDesc* desc, size_t count) {
  const char* fn = "cuMemSetAccess";
  NEED(need_context(fn));
  unsigned grant = 0;
  for (size_t i = 0; desc && i < count; ++i) {
    if (desc[i].location.type != 1 || desc[i].flags != 3 || desc[i].location.id < 0 ||
        desc[i].location.id >= ndevices) {
      violation(fn, "descriptor %zu is not read-write access for a device of this machine", i);
      return CUDA_ERROR_INVALID_VALUE;
    }
    grant |= 1u << desc[i].location.id;
  }
  if (!grant) {
    violation(fn, "no access descriptor");
    return CUDA_ERROR_INVALID_VALUE;
  }
  size_t n = size ? covering(va, size) : 0;
  if (n == 0) {
    violation(fn, "[0x%llx, +%zu) is not exactly covered by mappings", va, size);
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (mprotect((void*)(uintptr_t)va, size, PROT_READ | PROT_WRITE) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  for (size_t i = 0; i < n; ++i) ((Mapping*)cover.p[i])->access = grant;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc* desc, size_t count) {
  LOCKED("cuMemSetAccess", 1, do_set_access(va, size, desc, count));
}

static CUresult do_unmap(CUdeviceptr va, size_t size) {
  const char* fn = "cuMemUnmap";
  NEED(need_context(fn));
  size_t n = size ? covering(va, size) : 0;
  if (n == 0) {
    violation(fn, "[0x%llx, +%zu) is not exactly a run of whole mappings (no partial unmaps)", va, size);
    return CUDA_ERROR_INVALID_VALUE;
  }
  check_no_pending_use(fn, va, size);
  void* p = mmap((void*)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                 -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_UNKNOWN;
  for (size_t i = 0; i < n; ++i) {
    Mapping* m = cover.p[i];
    Handle* h = m->h;
    vec_remove_at(&mappings, (size_t)vec_find(&mappings, m));
    free(m);
    if (--h->mappings == 0 && h->released) free_handle(h);
  }
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemUnmap(CUdeviceptr va, size_t size) { LOCKED("cuMemUnmap", 1, do_unmap(va, size)); }

/* Device memory the current context's device reads or writes (tests/test_alloc_memory.py's
 * CudaMemory, fakecuda_stream_use): only bytes mapped with access for that device, as a kernel
 * needs (another device's memory needs cuMemSetAccess for this one: peer access). */
static CUresult accessible(const char* fn, CUdeviceptr p, size_t n) {
  int dev = current->device;
  for (CUdeviceptr at = p; at < p + n;) {
    Mapping* hit = NULL;
    for (size_t i = 0; i < mappings.n; ++i) {
      Mapping* m = mappings.p[i];
      if (at >= m->va && at < m->va + m->size) hit = m;
    }
    if (!hit || !(hit->access & (1u << dev))) {
      violation(fn, "illegal address 0x%llx (in [0x%llx, +%zu)) for device %d: %s", at, p, n, dev,
                !hit ? "not mapped" : !hit->access ? "mapped without access"
                                                   : "another device's memory without peer access");
      return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    at = hit->va + hit->size;
  }
  return CUDA_SUCCESS;
}

static CUresult do_memset(CUdeviceptr p, unsigned char v, size_t n) {
  NEED(need_context("cuMemsetD8"));
  NEED(accessible("cuMemsetD8", p, n));
  memset((void*)(uintptr_t)p, v, n);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) { LOCKED("cuMemsetD8", 1, do_memset(p, v, n)); }

static CUresult do_dtoh(void* dst, CUdeviceptr src, size_t n) {
  NEED(need_context("cuMemcpyDtoH"));
  NEED(accessible("cuMemcpyDtoH", src, n));
  memcpy(dst, (void*)(uintptr_t)src, n);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) { LOCKED("cuMemcpyDtoH", 1, do_dtoh(dst, src, n)); }

/* -------------------------------------------------------------------------- streams, events */

/* The stream a handle names: the NULL, legacy and per-thread handles are the current context's
 * default stream (the fake does not tell threads apart), others must be live streams. */
static CUresult resolve_stream(const char* fn, CUstream s, CUstream* out) {
  if (s == NULL || s == STREAM_LEGACY || s == STREAM_PER_THREAD) {
    if (!current) {
      violation(fn, "the default stream handle %p needs a current context", (void*)s);
      return CUDA_ERROR_INVALID_CONTEXT;
    }
    *out = &current->legacy;
    return CUDA_SUCCESS;
  }
  if (vec_find(&streams, s) < 0) {
    violation(fn, "%p is not a live stream", (void*)s);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  *out = s;
  return CUDA_SUCCESS;
}

static CUresult do_stream_create(CUstream* out, unsigned int flags) {
  NEED(need_context("cuStreamCreate"));
  (void)flags;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  CUstream s = calloc(1, sizeof *s);
  s->born = ++n_born;
  s->ctx = current;
  vec_push(&streams, s);
  *out = s;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamCreate(CUstream* out, unsigned int flags) { LOCKED("cuStreamCreate", 1, do_stream_create(out, flags)); }

/* A stream goes once its work is done (cuStreamDestroy returns at once, the driver finishes it):
 * its events complete and forget it. */
static void retire_stream(CUstream s) {
  s->completed = s->submitted;
  for (size_t j = 0; j < events.n; ++j) {
    CUevent e = events.p[j];
    if (e->stream == s) e->stream = NULL;
  }
  for (size_t j = uses.n; j-- > 0;) {
    Use* u = uses.p[j];
    if (u->stream == s) {
      vec_remove_at(&uses, j);
      free(u);
    }
  }
}

static CUresult do_stream_destroy(CUstream s) {
  long i = vec_find(&streams, s);
  if (i < 0) {
    violation("cuStreamDestroy", "%p is not a live stream", (void*)s);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  retire_stream(s);
  vec_remove_at(&streams, (size_t)i);
  free(s);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamDestroy_v2(CUstream s) { LOCKED("cuStreamDestroy", 1, do_stream_destroy(s)); }

static CUresult do_stream_get_ctx(CUstream s, CUcontext* out) {
  if (!out) return CUDA_ERROR_INVALID_VALUE; /* needs no current context for a created stream */
  CUstream r = NULL;
  NEED(resolve_stream("cuStreamGetCtx", s, &r));
  *out = r->ctx;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamGetCtx(CUstream s, CUcontext* out) { LOCKED("cuStreamGetCtx", 1, do_stream_get_ctx(s, out)); }

static CUresult do_event_create(CUevent* out, unsigned int flags) {
  NEED(need_context("cuEventCreate"));
  if (!out || (flags & ~0xfu)) return CUDA_ERROR_INVALID_VALUE;
  CUevent e = calloc(1, sizeof *e);
  e->born = ++n_born;
  e->ctx = current;
  vec_push(&events, e);
  *out = e;
  return CUDA_SUCCESS;
}
EXPORT CUresult cuEventCreate(CUevent* out, unsigned int flags) { LOCKED("cuEventCreate", 1, do_event_create(out, flags)); }

static CUresult live_event(const char* fn, CUevent e) {
  if (vec_find(&events, e) < 0) {
    violation(fn, "%p is not a live event (destroyed, or its context was released)", (void*)e);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  return CUDA_SUCCESS;
}

static CUresult do_event_record(CUevent e, CUstream s) {
  const char* fn = "cuEventRecord";
  NEED(need_context(fn));
  NEED(live_event(fn, e));
  CUstream r = NULL;
  NEED(resolve_stream(fn, s, &r));
  if (r->ctx != e->ctx) {
    violation(fn, "event of device %d's context recorded on a stream of device %d's context",
              e->ctx->device, r->ctx->device);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  e->stream = r;
  e->seq = submit(r);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuEventRecord(CUevent e, CUstream s) { LOCKED("cuEventRecord", 1, do_event_record(e, s)); }

static CUresult do_event_query(CUevent e) {
  NEED(need_context("cuEventQuery"));
  NEED(live_event("cuEventQuery", e));
  return event_pending(e) ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}
EXPORT CUresult cuEventQuery(CUevent e) { LOCKED("cuEventQuery", 1, do_event_query(e)); }

static CUresult do_event_sync(CUevent e) {
  NEED(need_context("cuEventSynchronize"));
  NEED(live_event("cuEventSynchronize", e));
  if (event_pending(e)) {
    e->stream->completed = e->seq; /* the host waited until the stream got there */
    ++n_event_syncs;
  }
  return CUDA_SUCCESS;
}
EXPORT CUresult cuEventSynchronize(CUevent e) { LOCKED("cuEventSynchronize", 1, do_event_sync(e)); }

static CUresult do_event_destroy(CUevent e) {
  NEED(need_context("cuEventDestroy"));
  NEED(live_event("cuEventDestroy", e));
  if (e->ctx != current) {
    /* the driver accepts it; vmalloc's rule is to destroy an event in its own context */
    violation("cuEventDestroy", "event of device %d's context destroyed with device %d's current",
              e->ctx->device, current->device);
  }
  vec_remove_at(&events, (size_t)vec_find(&events, e));
  free(e);
  return CUDA_SUCCESS;
}
EXPORT CUresult cuEventDestroy_v2(CUevent e) { LOCKED("cuEventDestroy", 1, do_event_destroy(e)); }

/* The last release of a primary context waits for its work and destroys what was made in it. */
static void drop_context_objects(CUcontext c) {
  retire_stream(&c->legacy);
  for (size_t i = streams.n; i-- > 0;) {
    CUstream s = streams.p[i];
    if (s->ctx == c) {
      retire_stream(s);
      vec_remove_at(&streams, i);
      free(s);
    }
  }
  for (size_t i = events.n; i-- > 0;) {
    CUevent e = events.p[i];
    if (e->ctx == c) {
      vec_remove_at(&events, i);
      free(e);
    }
  }
}

static CUresult do_can_access_peer(int* can, CUdevice dev, CUdevice peer) {
  NEED(valid_device("cuDeviceCanAccessPeer", dev));
  NEED(valid_device("cuDeviceCanAccessPeer", peer));
  if (!can) return CUDA_ERROR_INVALID_VALUE;
  *can = dev != peer; /* every pair of the fake's devices is peer-capable */
  return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceCanAccessPeer(int* can, CUdevice dev, CUdevice peer) {
  LOCKED("cuDeviceCanAccessPeer", 1, do_can_access_peer(can, dev, peer));
}

/* The names cuda.h maps to a _v2 entry point exist in the driver with their old ABI
 * (cuDeviceTotalMem's old one writes an unsigned int): calling them is a build mistake. */
#define OLD_NAME(ret_args, name, v2)                                                         \
  EXPORT CUresult name ret_args {                                                            \
    pthread_mutex_lock(&mu);                                                                 \
    violation(#name, "called by its old name: cuda.h maps it to " #v2 " (another ABI)");     \
    pthread_mutex_unlock(&mu);                                                               \
    return CUDA_ERROR_NOT_SUPPORTED;                                                         \
  }
OLD_NAME((unsigned int* bytes __attribute__((unused)), CUdevice d __attribute__((unused))),
         cuDeviceTotalMem, cuDeviceTotalMem_v2)
OLD_NAME((CUdevice d __attribute__((unused))), cuDevicePrimaryCtxRelease, cuDevicePrimaryCtxRelease_v2)
OLD_NAME((unsigned int* f __attribute__((unused)), unsigned int* t __attribute__((unused))), cuMemGetInfo,
         cuMemGetInfo_v2)
OLD_NAME((CUevent e __attribute__((unused))), cuEventDestroy, cuEventDestroy_v2)
OLD_NAME((CUstream s __attribute__((unused))), cuStreamDestroy, cuStreamDestroy_v2)

/* ----------------------------------------------------------------------------- error names */

static const char* err_name(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return "CUDA_SUCCESS";
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_DEINITIALIZED: return "CUDA_ERROR_DEINITIALIZED";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_READY: return "CUDA_ERROR_NOT_READY";
    case CUDA_ERROR_ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    case CUDA_ERROR_UNKNOWN: return "CUDA_ERROR_UNKNOWN";
    default: return NULL;
  }
}
static int is_deinitialized(void) {
  pthread_mutex_lock(&mu);
  int d = deinitialized;
  pthread_mutex_unlock(&mu);
  return d;
}
/* Not counted in `calls`. While the driver is shut down they fail too: vmalloc's messages must
 * not need them then. */
EXPORT CUresult cuGetErrorName(CUresult r, const char** out) {
  if (is_deinitialized()) return CUDA_ERROR_DEINITIALIZED;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  *out = err_name(r);
  return *out ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGetErrorString(CUresult r, const char** out) {
  if (is_deinitialized()) return CUDA_ERROR_DEINITIALIZED;
  if (!out) return CUDA_ERROR_INVALID_VALUE;
  switch (r) {
    case CUDA_ERROR_DEINITIALIZED: *out = "driver shutting down"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "out of memory"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "invalid argument"; break;
    case CUDA_ERROR_NOT_READY: *out = "device not ready"; break;
    case CUDA_ERROR_UNKNOWN: *out = "unknown error"; break;
    default: *out = err_name(r); if (!*out) return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

/* --------------------------------------------------------------------------- test controls */

/* The `nth` next call of `fn` (a driver function's name without its _v2 suffix, or "any") fails
 * with `result`, and so do the `count` - 1 calls after it (count 0: every call from then on).
 * nth 0 disarms. Returns 0. */
EXPORT int fakecuda_inject(const char* fn, unsigned long long nth, int result, unsigned long long count) {
  pthread_mutex_lock(&mu);
  snprintf(inject_name, sizeof inject_name, "%s", fn ? fn : "");
  inject_nth = nth;
  inject_result = result;
  inject_left = count;
  pthread_mutex_unlock(&mu);
  return 0;
}

/* A held stream's work does not complete (a kernel still running): the events recorded on it
 * stay pending, the memory used on it stays in use; letting it go completes its work. Returns 0,
 * or -1 when `s` is not a live stream. */
EXPORT int fakecuda_stream_hold(CUstream s, int held) {
  pthread_mutex_lock(&mu);
  int ok = vec_find(&streams, s) >= 0;
  if (ok) {
    s->held = held;
    if (!held) s->completed = s->submitted;
  }
  pthread_mutex_unlock(&mu);
  return ok ? 0 : -1;
}

/* Queue device work on `s` (0: the current context's default stream) that reads and writes
 * [p, p + n), as a kernel would: the memory must be accessible to the current context's device,
 * and unmapping it before the work completes is a violation. Returns 0, or -1 on a bad stream
 * or an illegal address (recorded as a violation). */
EXPORT int fakecuda_stream_use(CUstream s, CUdeviceptr p, size_t n) {
  pthread_mutex_lock(&mu);
  CUstream r = NULL;
  int ok = need_context("fakecuda_stream_use") == CUDA_SUCCESS &&
           resolve_stream("fakecuda_stream_use", s, &r) == CUDA_SUCCESS &&
           accessible("fakecuda_stream_use", p, n) == CUDA_SUCCESS;
  if (ok) {
    Use* u = calloc(1, sizeof *u);
    u->stream = r;
    u->va = p;
    u->size = n;
    u->seq = submit(r);
    if (u->seq <= r->completed) free(u); /* done at once */
    else vec_push(&uses, u);
  }
  pthread_mutex_unlock(&mu);
  return ok ? 0 : -1;
}

/* The driver shuts down, as the CUDA runtime's teardown does at process exit while the program
 * still frees memory: from now on every entry point returns CUDA_ERROR_DEINITIALIZED, records no
 * violation and changes nothing (the objects stay as they were). fakecuda_revive undoes it (the
 * real driver never comes back; a test does, and tests/conftest.py revives after each). */
EXPORT void fakecuda_deinit(void) {
  pthread_mutex_lock(&mu);
  deinitialized = 1;
  pthread_mutex_unlock(&mu);
}
EXPORT void fakecuda_revive(void) {
  pthread_mutex_lock(&mu);
  deinitialized = 0;
  pthread_mutex_unlock(&mu);
}

/* What the real driver does at exit for a test that shut it down: destroy every mapping, handle,
 * reservation, event and stream created after serial `since` (fakecuda_get("serial") taken
 * before), whoever still refers to them. Context references are not touched. Returns how many
 * objects went. */
EXPORT long long fakecuda_reclaim(unsigned long long since) {
  pthread_mutex_lock(&mu);
  long long n = 0;
  for (size_t i = mappings.n; i-- > 0;) {
    Mapping* m = mappings.p[i];
    if (m->born <= since) continue;
    mmap((void*)(uintptr_t)m->va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
         -1, 0);
    Handle* h = m->h;
    vec_remove_at(&mappings, i);
    free(m);
    if (--h->mappings == 0 && h->released) free_handle(h);
    ++n;
  }
  for (size_t i = handles.n; i-- > 0;) {
    Handle* h = handles.p[i];
    if (h->born <= since || h->mappings) continue; /* still mapped by an older mapping: kept */
    free_handle(h);
    ++n;
  }
  for (size_t i = reservations.n; i-- > 0;) {
    Reservation* r = reservations.p[i];
    if (r->born <= since) continue;
    munmap((void*)(uintptr_t)r->va, r->size);
    vec_remove_at(&reservations, i);
    free(r);
    ++n;
  }
  for (size_t i = events.n; i-- > 0;) {
    CUevent e = events.p[i];
    if (e->born <= since) continue;
    vec_remove_at(&events, i);
    free(e);
    ++n;
  }
  for (size_t i = streams.n; i-- > 0;) {
    CUstream s = streams.p[i];
    if (s->born <= since) continue;
    retire_stream(s);
    vec_remove_at(&streams, i);
    free(s);
    ++n;
  }
  pthread_mutex_unlock(&mu);
  return n;
}

/* A counter or a count of live objects, by name; -1 for an unknown name. */
EXPORT long long fakecuda_get(const char* what) {
  pthread_mutex_lock(&mu);
  long long v = -1, sum = 0;
  if (!strcmp(what, "reservations")) v = (long long)reservations.n;
  else if (!strcmp(what, "reserved_bytes")) {
    for (size_t i = 0; i < reservations.n; ++i) sum += (long long)((Reservation*)reservations.p[i])->size;
    v = sum;
  } else if (!strcmp(what, "handles")) v = (long long)handles.n;
  else if (!strcmp(what, "committed_bytes")) {
    for (int d = 0; d < ndevices; ++d) sum += (long long)devices[d].committed;
    v = sum;
  } else if (!strcmp(what, "mappings")) v = (long long)mappings.n;
  else if (!strcmp(what, "mapped_bytes") || !strcmp(what, "accessible_bytes")) {
    int only_access = what[0] == 'a';
    for (size_t i = 0; i < mappings.n; ++i) {
      Mapping* m = mappings.p[i];
      if (!only_access || m->access) sum += (long long)m->size;
    }
    v = sum;
  } else if (!strcmp(what, "events")) v = (long long)events.n;
  else if (!strcmp(what, "pending_events")) {
    for (size_t i = 0; i < events.n; ++i) sum += event_pending(events.p[i]);
    v = sum;
  } else if (!strcmp(what, "streams")) v = (long long)streams.n;
  else if (!strcmp(what, "pending_uses")) {
    for (size_t i = 0; i < uses.n; ++i) {
      Use* u = uses.p[i];
      sum += u->seq > u->stream->completed;
    }
    v = sum;
  }
  else if (!strcmp(what, "context_refs")) {
    for (int d = 0; d < ndevices; ++d) sum += devices[d].ctx.refs;
    v = sum;
  } else if (!strcmp(what, "violations")) v = n_violations;
  else if (!strcmp(what, "event_syncs")) v = n_event_syncs;
  else if (!strcmp(what, "ctx_syncs")) v = n_ctx_syncs;
  else if (!strcmp(what, "injected")) v = n_injected;
  else if (!strcmp(what, "calls")) v = n_calls;
  else if (!strncmp(what, "calls:", 6)) { /* calls of one entry point ("calls:cuMemMap") */
    v = 0;
    for (int i = 0; i < MAX_FNS && fn_names[i]; ++i)
      if (!strcmp(fn_names[i], what + 6)) v = fn_calls[i];
  }
  else if (!strcmp(what, "granularity")) v = (long long)gran;
  else if (!strcmp(what, "serial")) v = (long long)n_born;
  else if (!strcmp(what, "deinitialized")) v = deinitialized;
  else if (!strcmp(what, "total_mem")) v = (long long)total_mem;
  pthread_mutex_unlock(&mu);
  return v;
}

/* The i-th violation's message (the first 64 are kept), or NULL. */
EXPORT const char* fakecuda_violation(long long i) {
  pthread_mutex_lock(&mu);
  const char* m = i >= 0 && i < n_violations && i < MAX_KEPT ? kept[i] : NULL;
  pthread_mutex_unlock(&mu);
  return m;
}
