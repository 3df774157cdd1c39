// kg_emulator.h -- host (CPU) emulation of the CUDA C++ subset used by kernelgen kernels.
//
// Force-included (g++ -include) in front of a kernel's CUDA source, which is then compiled as
// ordinary C++20 for the host. Each CUDA thread of a block is a fiber, and one OS thread per
// launch runs them, switching where a thread waits for others; the blocks of a grid run one
// after another (the blocks of a thread-block cluster all at once). See docs/emulator.md for
// the model and its limits. Linux only (a futex between the caller and the runner).
#ifndef KG_EMULATOR_H
#define KG_EMULATOR_H

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <array>
#include <atomic>
#include <cstdarg>
#include <deque>
#include <type_traits>
#include <utility>
#include <vector>

#include <linux/futex.h>
#include <sys/mman.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

// Fibers switch by a few instructions of assembly on x86-64, elsewhere (or with
// -DKG_EMU_UCONTEXT) by ucontext.
#if defined(__x86_64__) && !defined(KG_EMU_UCONTEXT)
#define KG_FIBER_ASM 1
#else
#define KG_FIBER_ASM 0
#include <ucontext.h>
#endif



// ---------------------------------------------------------------------------------------------
// Qualifiers and attributes
// ---------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__
#define __noinline__
#define __constant__
#define __managed__
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
// `__shared__` declarations are rewritten by the Python side (transform.py) before compiling:
// `extern __shared__` into a pointer to the block's dynamic shared memory, the static ones in
// functions into references into the block's static arena (kg_emu::static_smem_site); the
// preprocessing pass defines KG_EMULATOR_PREPROCESS so that they reach it marked. Others (at
// namespace scope) are ordinary static storage, one per process.
#ifdef KG_EMULATOR_PREPROCESS
#define __shared__ __kg_shared__
#define __cluster_dims__(...) __kg_cluster_dims__(__VA_ARGS__)
#else
#define __shared__ static
#define __cluster_dims__(...)
#endif
// __restrict__ is a GNU C++ keyword already.

// Lets a kernel source tell it is being emulated (__CUDACC__ / __CUDA_ARCH__ stay undefined).
#define KG_EMULATOR 1

// ---------------------------------------------------------------------------------------------
// Built-in vector types and thread coordinates
// ---------------------------------------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

struct alignas(8) float2 {
  float x, y;
};
struct float3 {
  float x, y, z;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) int2 {
  int x, y;
};
struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned int x, y;
};
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};

inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float3 make_float3(float x, float y, float z) { return float3{x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}

// The driver's opaque tensor map type (128 bytes, 64-byte aligned); the emulator's TMA reads
// the maps kernelgen.emulator.encode_tensor_map_tiled encodes (kg_tma.h).
typedef struct alignas(64) CUtensorMap_st {
  unsigned long long opaque[16];
} CUtensorMap;
static_assert(sizeof(CUtensorMap) == 128 && alignof(CUtensorMap) == 64);

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Runtime: barriers, per-thread context, launch
// ---------------------------------------------------------------------------------------------
namespace kg_emu {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word layout");

inline void futex_wait(std::atomic<uint32_t>& word, uint32_t expected,
                       const struct timespec* rel_timeout = nullptr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected,
          rel_timeout, nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

// The emulated threads are fibers (kg_fiber below): one OS thread per launch runs them,
// switching at the points where a CUDA thread waits for others. These are those waits: the
// calling thread runs on once `word` no longer holds `value` (and throws Trap when the launch
// failed elsewhere meanwhile); fiber_poll lets the others run once (a spinning test_wait or
// nanosleep loop).
struct Fiber;
inline void wait_while(const std::atomic<uint32_t>& word, uint32_t value);
inline void fiber_poll();
// Per-thread state of the emulated thread running now (one object per slot and thread, made on
// first use): the emulator's replacement for thread_local. The slots are fixed, so that a
// kernel's library and the prebuilt runtime library (KG_EMU_EXTERN_RUNTIME) agree on them.
enum FiberLocalSlot : int {
  kLocalAsyncCopies,     // AsyncCopies (cp.async)
  kLocalHb,              // HbClock (happens-before knowledge)
  kLocalMbarrierSeen,    // kg_mbarrier.h
  kLocalLastOutsideCvta, kLocalUnfencedChunks,  // kg_ptx.h
  kLocalBulkGroups,      // kg_tma.h
  kLocalWgmma,           // kg_wgmma.h
  kLocalClusterArrival,  // kg_cluster.h
  kLocalClusterPassed,   // kg_mbarrier.h (set by kg_cluster.h)
  kMaxFiberLocals
};
template <class T, int Slot>
inline T& fiber_local();

// Central counting barrier with "drop" support (a thread that leaves the kernel stops being
// expected), in the spirit of std::barrier::arrive_and_drop. The emulated threads are fibers
// of one OS thread, so a waiter just lets the others run until the generation moves on.
class Barrier {
 public:
  void reset(uint32_t n) {
    participants_.store(n);
    count_.store(n);
    gen_.store(0);
  }
  void arrive_and_wait() {
    const uint32_t g = gen_.load();
    if (count_.fetch_sub(1) == 1) {
      complete();
      return;
    }
    wait_while(gen_, g);
  }
  void arrive_and_drop() {
    participants_.fetch_sub(1);
    if (count_.fetch_sub(1) == 1) complete();
  }

 private:
  void complete() {
    count_.store(participants_.load());
    gen_.fetch_add(1);
  }
  std::atomic<uint32_t> count_{0};
  std::atomic<uint32_t> participants_{0};
  std::atomic<uint32_t> gen_{0};
};

struct Warp {
  Barrier bar;
  alignas(64) uint64_t slots[2][32];  // double buffered: one warp barrier per exchange
  // Wider per-lane slots for mma.sync (the A and B fragments, 6 registers), buffered and
  // indexed by the same parity as `slots`.
  alignas(64) uint32_t frags[2][32][6];
};

// Thrown by __trap() and by the emulated instructions that detect an error (bad shared-memory
// address, ...); `msg` (empty for __trap) ends up in the launch's RuntimeError.
struct Trap {
  char msg[512] = "";
};

[[noreturn]] __attribute__((format(printf, 1, 2))) inline void trap_with(const char* fmt, ...) {
  Trap t;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t.msg, sizeof t.msg, fmt, ap);
  va_end(ap);
  throw t;
}

// cp.async bookkeeping of one thread: copies are queued here and performed (and so become
// visible in shared memory) only by cp.async.wait_group / cp.async.wait_all.
struct PendingCopy {
  unsigned char* dst;
  const unsigned char* src;
  uint32_t cp_size, src_size;
};
struct AsyncCopies {
  std::vector<PendingCopy> current;               // issued since the last commit_group
  std::deque<std::vector<PendingCopy>> committed;  // committed groups, oldest first
  void clear() {
    current.clear();
    committed.clear();
  }
};
inline AsyncCopies& async_copies() { return fiber_local<AsyncCopies, kLocalAsyncCopies>(); }

// What a launch did, for tests of properties no output shows: shared-memory bank conflicts of
// ldmatrix and the global bytes the cp.async copies read. Order of the `stats` array the launch
// entry point fills.
enum LaunchStat : int {
  kLdmatrix = 0,           // ldmatrix instructions (warp-level, as the profiler counts them)
  kLdmatrixWavefronts,     // shared-memory wavefronts they took
  kLdmatrixIdeal,          // wavefronts without bank conflicts: one per 8x8 matrix
  kCpAsyncGlobalBytes,     // global bytes of the cp.async copies issued (src-size, not zero-fill)
  kWgmma,                  // wgmma.mma_async instructions (warpgroup-level)
  kTmaBytes,               // shared-memory bytes written by TMA / bulk copies (whole boxes)
  kNumStats
};
// cp.async copies and their global bytes (src-size) are also counted per pointer argument whose
// array holds the source address (the launch passes the arrays' byte ranges).
constexpr int kMaxArgRanges = 64;

struct SeenPhase {  // an mbarrier phase a thread saw complete (kg_mbarrier.h)
  uint32_t slot, completed;
};
// An mbarrier object (kg_mbarrier.h). `phase` (the phases completed) is read without the lock
// and is the word waiters wait on (wait_while); the rest is guarded by Launch::mbar_lock.
struct MbarrierState {
  std::atomic<uint32_t> phase{0};
  uint32_t initialized = 0, expected = 0;
  // barrier.cluster phases completed when it was initialised (kg_mbarrier.h: another block's
  // thread may reach it only after passing a later one).
  uint32_t init_cluster_phase = 0;
  int32_t pending = 0, tx = 0;
  // Observations of completed phases: (phases completed, earliest epoch a thread saw it).
  uint32_t seen_phase[4] = {}, seen_epoch[4] = {};
  // Happens-before knowledge (hb_* below) the arrivals released: all of them so far, and as it
  // stood when each of the last four phases completed (what a thread that saw it acquires).
  std::vector<uint32_t> known, known_at[4];
  // Likewise the mbarrier phases the arriving threads had seen complete (kg_mbarrier.h:
  // check_tma_read), which a thread that sees the phase complete then knows too.
  std::vector<SeenPhase> seen, seen_at[4];
  // fence.proxy.async of threads that had seen phases complete: (phases completed, the fencing
  // thread's point, kg_ptx.h: my_point); cp.async bytes this barrier tracked reach the async
  // proxy through them (kg_mbarrier.h: check_cp_async_fenced).
  std::vector<std::pair<uint32_t, uint64_t>> fences;
  void reset() {
    phase.store(0, std::memory_order_relaxed);
    initialized = expected = init_cluster_phase = 0;
    pending = tx = 0;
    for (int i = 0; i < 4; ++i) {
      seen_phase[i] = seen_epoch[i] = 0;
      known_at[i].clear();
      seen_at[i].clear();
    }
    known.clear();
    seen.clear();
    fences.clear();
  }
};

// The 8 bytes of a live mbarrier object (between mbarrier.init and mbarrier.inval): written by
// mbarrier.init, compared by every mbarrier instruction on it, by mbarrier.inval and at the
// block's end. Only mbarrier instructions may access the object (PTX ISA, "Parallel
// Synchronization and Communication Instructions: mbarrier"); the emulator keeps the state in
// MbarrierState, so a plain C++ store into these bytes shows only as a changed pattern. The
// instructions it models (st/ld.shared, cp.async, TMA, ldmatrix, ...) are caught at the access
// (kg_ptx.h: check_no_live_mbarrier).
constexpr uint64_t kMbarrierObjectBytes = 0x4D4241522D6B6721ull;  // "!gk-RABM"

// One wgmma of a warpgroup as its first thread issued it (kg_wgmma.h): the other 127 threads'
// wgmma with the same issue number must have the same shape and descriptors.
struct WarpgroupIssue {
  uint64_t number_plus_1 = 0;  // 0: none yet
  uint64_t desc_a = 0, desc_b = 0, shape = 0;
  uint32_t thread = 0;
};
constexpr uint32_t kWarpgroupIssueRing = 64;

// The warpgroup-collective wgmma instructions (commit_group, wait_group) meet here: every thread
// of the warpgroup publishes where it is (kg_wgmma.h: warpgroup_rendezvous), double buffered by
// the rendezvous parity like the warp slots.
struct WarpgroupSlot {
  std::atomic<uint32_t> kind;  // 0 the thread left the kernel, 1 commit_group, 2 wait_group
  uint32_t wait_n;        // wait_group's N
  uint64_t issued;        // wgmmas the thread issued in this block
  uint64_t commits;       // commit_groups it executed
};
struct Warpgroup {
  Barrier bar;
  WarpgroupSlot slots[2][128];
};

// A named barrier of a subset of the block's threads (kg_barrier.h: bar.sync / bar.arrive with a
// thread count below the block's); `generation` (completed generations) is the word
// waiters sleep on, the rest is guarded by Launch::bar_lock.
constexpr uint32_t kNamedBarriers = 16;
struct NamedBarrierState {
  std::atomic<uint32_t> generation{0};
  uint32_t expected = 0;  // the thread count of the generation under way (0: none under way)
  uint32_t arrived = 0, syncing = 0, first_thread = 0;
  // Per generation: the mbarrier phases its arriving threads had seen complete, which its
  // bar.sync threads then know too; the happens-before knowledge its arrivals released (hb_*);
  // whether every thread of the block synced there.
  struct Generation {
    std::vector<SeenPhase> seen;
    std::vector<uint32_t> known;
    bool whole_block = false;
  };
  std::vector<Generation> knowledge;
  void reset() {
    generation.store(0, std::memory_order_relaxed);
    expected = arrived = syncing = first_thread = 0;
    knowledge.clear();
  }
};

// The race checks' shadow of one 16-byte chunk of a block's shared memory (kg_ptx.h, kg_tma.h,
// kg_bulk.h): the last ldmatrix read and cp.async write, the mbarrier phase of the last TMA
// write, the last stmatrix write and its writer's fence.proxy.async, the last ldmatrix reader
// (for stmatrix), the TMA store reading it.
struct ChunkShadow {
  std::atomic<uint64_t> reads, writes, tma, gen, fence, reader, bulk, bulk_release;
  void reset() {
    reader.store(0, std::memory_order_relaxed);
    reads.store(0, std::memory_order_relaxed);
    writes.store(0, std::memory_order_relaxed);
    tma.store(0, std::memory_order_relaxed);
    gen.store(0, std::memory_order_relaxed);
    fence.store(0, std::memory_order_relaxed);
    bulk.store(0, std::memory_order_relaxed);
    bulk_release.store(0, std::memory_order_relaxed);
  }
};

// barrier.cluster (kg_cluster.h): every thread of the cluster arrives, waits for the others.
struct ClusterBarrierState {
  std::atomic<uint32_t> generation{0};
  uint32_t participants = 0, arrived = 0;
  void reset(uint32_t n) {
    generation.store(0, std::memory_order_relaxed);
    participants = n;
    arrived = 0;
  }
};

constexpr size_t kGuard = 128;  // guard bytes around each region of shared memory
constexpr unsigned char kGuardByte = 0xA5;
// The static __shared__ variables declared in functions (transform.py rewrites them into this
// arena): one arena per block, after the dynamic shared memory in the shared window, at a
// 1024-byte aligned offset; CUDA's 48 KB of static shared memory.
constexpr size_t kStaticSmemBytes = 48 * 1024;
constexpr uint32_t kMaxClusterSize = 8;       // the portable cluster size
constexpr uint32_t kMaxClusterThreads = 4096;  // threads of all the blocks of one cluster
constexpr uint32_t kMaxStaticSites = 256;      // static __shared__ declarations of a kernel

struct Launch;

// One thread block (CTA). The blocks of a cluster run at once, each with its own Cta; clusters
// (a block is a cluster of one) run one after another, reusing the Ctas and their threads.
struct Cta {
  Launch* launch = nullptr;
  uint32_t rank = 0;       // %cluster_ctarank
  uint3 block{0, 0, 0};    // its blockIdx
  unsigned char* buf = nullptr;  // guard, dynamic shared memory, guard gap, static arena, guard
  size_t buf_bytes = 0;
  unsigned char* smem = nullptr;  // dynamic shared memory (128-byte aligned): kSharedBase
  size_t smem_bytes = 0;
  size_t static_offset = 0;  // of the static arena from smem (shared kSharedBase + it)
  size_t window = 0;         // static_offset + kStaticSmemBytes: what the shadows cover
  Barrier block_bar;
  Warp* warps = nullptr;
  std::atomic<uint32_t> running{0};  // threads of the block still in the kernel
  ChunkShadow* shadow = nullptr;     // one per 16-byte chunk of the window
  size_t chunks = 0;
  MbarrierState* mbarriers = nullptr;  // one per 8 bytes of the window (guarded by mbar_lock)
  size_t n_mbarriers = 0;
  // One byte per 8 bytes of the window: 1 while an mbarrier object lives there (init to inval),
  // what every instruction's access checks (kg_ptx.h: check_no_live_mbarrier).
  unsigned char* mbarrier_live = nullptr;
  WarpgroupIssue* warpgroup_issues = nullptr;  // kWarpgroupIssueRing per warpgroup (mbar_lock)
  Warpgroup* warpgroups = nullptr;  // one per complete warpgroup of the block
  NamedBarrierState named[kNamedBarriers];
  unsigned char* static_smem() const { return smem + static_offset; }
};

struct Launch {
  void (*thunk)(void**) = nullptr;
  void** args = nullptr;
  dim3 grid, block, cluster;
  uint32_t nthreads = 0, nwarps = 0;  // per block
  uint32_t ncta = 1;                  // blocks per cluster
  uint32_t nwarpgroups = 0;           // complete warpgroups per block
  Cta* ctas = nullptr;                // ncta
  bool stop = false;
  alignas(64) std::atomic<uint32_t> start_seq{0};  // bumped once per cluster (and to stop)
  alignas(64) std::atomic<uint32_t> remaining{0};  // threads still running the current cluster
  std::atomic<int> trapped{0};
  uint3 trap_thread{0, 0, 0}, trap_block{0, 0, 0};
  char trap_msg[512] = "";
  // Counters over the whole launch (LaunchStat), summed from the threads' own at the end
  // of every block; the first ldmatrix that needed extra wavefronts, described.
  std::atomic<uint64_t> stats[kNumStats] = {};
  std::atomic<int> conflict_noted{0};
  char first_conflict[256] = "";
  int hazard = 0;  // the reported error is a race-check hazard (report_hazard)
  // Byte ranges [lo, hi) of the pointer arguments' arrays, and per range: cp.async copies issued
  // with a source inside it and their src-size bytes.
  const uint64_t* ranges = nullptr;
  int nranges = 0;
  std::atomic<uint64_t> arg_copies[kMaxArgRanges] = {};
  std::atomic<uint64_t> arg_bytes[kMaxArgRanges] = {};
  // Hopper's asynchronous state lives in the Ctas; one lock for all mbarriers of the cluster
  // (a multicast or remote arrival touches several blocks), one for the named and cluster
  // barriers, one for the global writes of TMA reductions.
  pthread_mutex_t mbar_lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_t bar_lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_t reduce_lock = PTHREAD_MUTEX_INITIALIZER;
  ClusterBarrierState cluster_bar;
  // The static __shared__ declarations met in this launch (static_smem_site), under bar_lock.
  std::atomic<uint32_t> static_sites{0};
  const void* static_site_key[kMaxStaticSites] = {};
  size_t static_site_offset[kMaxStaticSites] = {};
  std::atomic<size_t> static_used{0};  // bytes of the arena reserved: the valid part
  // The emulated threads of one cluster (the runner thread's fibers, reused by every cluster),
  // whether one got past a wait in the current round, and a deadlock the runner found.
  Fiber* fibers = nullptr;
  void* runner_sp = nullptr;  // the runner's saved context while a fiber runs (fiber_switch)
#if !KG_FIBER_ASM
  ucontext_t runner_uc;
#endif
  // Makes a fiber the running thread for the kernel library's code (enter_fiber: its own
  // thread_local variables, which the prebuilt runtime library cannot see).
  void (*enter)(Fiber*) = nullptr;
  uint64_t schedule_state = 0;  // splitmix64 state of the resumption orders
  bool progress = false;
  bool deadlocked = false;
  char deadlock_msg[1024] = "";
};


struct ThreadCtx {
  Launch* launch;
  Cta* cta;  // the thread's block
  Warp* warp;
  uint32_t lane;
  uint32_t parity;  // which slot buffer the warp's next exchange uses (lanes stay in step)
  uint32_t wg_parity;  // the same for the warpgroup's rendezvous (kg_wgmma.h)
  uint32_t linear;  // thread index in the block
  // Whole-block barriers passed in this block (__syncthreads, bar.sync of every thread,
  // barrier.cluster): two accesses of different threads with the same epoch are in the same
  // barrier interval, i.e. unordered.
  uint32_t epoch;
  uint64_t stats[kNumStats];  // this thread's share of Launch::stats in the current block
  uint64_t arg_copies[kMaxArgRanges], arg_bytes[kMaxArgRanges];  // and of Launch::arg_*
};

// ---- the emulated threads: fibers ------------------------------------------------------------
// Every CUDA thread of the running cluster is a fiber with a stack of its own. One OS thread,
// the launch's runner, resumes them in turn (run_fibers); a fiber runs until it must wait for
// others (wait_while, fiber_poll) or leaves the kernel. A switch saves and restores the
// callee-saved registers only, some tens of nanoseconds, where handing over between OS threads
// took a futex call and a trip through the kernel's scheduler for every thread at every
// barrier, shuffle and mma.sync. The interleaving is deterministic: threads run in index order
// between their waits.
constexpr size_t kFiberStackBytes = size_t{8} << 20;  // a pthread's default stack

struct Fiber {
  void* sp = nullptr;  // the saved stack pointer while switched out (fiber_switch)
#if !KG_FIBER_ASM
  ucontext_t uc;
#endif
  unsigned char* stack = nullptr;  // kFiberStackBytes, above a guard page
  Launch* launch = nullptr;
  uint32_t index = 0;  // block rank in the cluster * nthreads + thread
  uint3 thread_idx{0, 0, 0};
  bool done = true;
  // Blocked while *wait_word == wait_value (the runner need not resume it to find out).
  const std::atomic<uint32_t>* wait_word = nullptr;
  uint32_t wait_value = 0;
  ThreadCtx ctx{};
  void* locals[kMaxFiberLocals] = {};
  void (*drop_local[kMaxFiberLocals])(void*) = {};
  Fiber() = default;
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  ~Fiber() {
    for (int i = 0; i < kMaxFiberLocals; ++i) {
      if (locals[i] != nullptr) drop_local[i](locals[i]);
    }
    if (stack != nullptr) munmap(stack - kGuardPage, kFiberStackBytes + kGuardPage);
  }
  static constexpr size_t kGuardPage = 4096;
};

// (In an unnamed namespace, like the other registries: each library has its own.)
namespace {
thread_local Fiber* current_fiber = nullptr;
}  // namespace

inline ThreadCtx& tctx() { return current_fiber->ctx; }

template <class T, int Slot>
inline T& fiber_local() {
  static_assert(Slot >= 0 && Slot < kMaxFiberLocals);
  Fiber& f = *current_fiber;
  if (f.locals[Slot] == nullptr) {
    f.locals[Slot] = new T();
    f.drop_local[Slot] = [](void* q) { delete static_cast<T*>(q); };
  }
  return *static_cast<T*>(f.locals[Slot]);
}

#if KG_FIBER_ASM
namespace {
// Saves the callee-saved registers and the SSE and x87 control words on the running stack,
// stores the stack pointer in *save (rdi) and resumes the context saved at `next` (rsi).
__attribute__((naked, noinline)) void fiber_switch(void** /*save*/, void* /*next*/) {
  asm volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}
}  // namespace
inline void fiber_suspend() { fiber_switch(&current_fiber->sp, current_fiber->launch->runner_sp); }
#else
inline void fiber_suspend() { swapcontext(&current_fiber->uc, &current_fiber->launch->runner_uc); }
#endif

// ---- happens-before knowledge beyond whole-block barriers --------------------------------------
// The race checks of stmatrix writes and TMA stores (kg_ptx.h, kg_bulk.h) must accept accesses
// ordered by barriers of part of the block (named barriers, mbarriers), as FlashAttention 3's
// epilogue orders its stmatrix writes before the TMA store with a barrier of the consumer
// warpgroups. Each thread counts its arrivals (bar.sync / bar.arrive of a named barrier,
// mbarrier.arrive) and knows, per thread of its block, the arrivals it is ordered after:
// an arrival releases what the thread knows into the barrier, a thread leaving a bar.sync or
// seeing an mbarrier phase complete acquires what that generation or phase released (a vector
// clock of barrier arrivals). Thread w's access at its (epoch, arrivals) is ordered before this
// thread's now when they are the same thread, a whole-block barrier came between (epochs), or
// this thread knows an arrival of w after the access.
struct HbClock {
  std::vector<uint32_t> known;  // per thread of the block (valid when `live`)
  uint32_t arrivals = 0;
  bool live = false;
};
inline HbClock& hb() { return fiber_local<HbClock, kLocalHb>(); }

inline std::vector<uint32_t>& hb_known() {
  if (!hb().live) {
    hb().known.assign(tctx().launch->nthreads, 0);
    hb().live = true;
  }
  return hb().known;
}
// An arrival of this thread: what it knows (and the arrival) joins `into`.
inline void hb_release(std::vector<uint32_t>& into) {
  std::vector<uint32_t>& k = hb_known();
  k[tctx().linear] = ++hb().arrivals;
  if (into.size() < k.size()) into.resize(k.size(), 0);
  for (size_t i = 0; i < k.size(); ++i) into[i] = into[i] > k[i] ? into[i] : k[i];
}
inline void hb_acquire(const std::vector<uint32_t>& from) {
  if (from.empty()) return;
  std::vector<uint32_t>& k = hb_known();
  for (size_t i = 0; i < k.size() && i < from.size(); ++i) k[i] = k[i] > from[i] ? k[i] : from[i];
}
inline bool hb_after(uint32_t thread, uint32_t epoch, uint32_t arrivals) {
  return thread == tctx().linear || tctx().epoch > epoch ||
         (hb().live && thread < hb().known.size() && hb().known[thread] > arrivals);
}

// Records an error found while the kernel runs on (the first one wins; the launch raises it
// after the block) without unwinding the thread, so warp-collective partners do not lose it.
inline void report_error_v(int hazard, const char* fmt, va_list ap) {
  Launch& L = *tctx().launch;
  if (L.trapped.exchange(1) != 0) return;
  L.trap_thread = current_fiber->thread_idx;
  L.trap_block = tctx().cta->block;
  L.hazard = hazard;
  vsnprintf(L.trap_msg, sizeof L.trap_msg, fmt, ap);
}
__attribute__((format(printf, 1, 2))) inline void report_error(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report_error_v(0, fmt, ap);
  va_end(ap);
}
// The same for a hazard of the race check (the launch raises HazardError).
__attribute__((format(printf, 1, 2))) inline void report_hazard(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  report_error_v(1, fmt, ap);
  va_end(ap);
}

// Dynamic shared memory declared at namespace scope: thread-local pointers registered at load
// time, pointed at its block's buffer by every thread when it starts a block. (In an unnamed
// namespace, like the other registries: an inline variable would be one object for all the
// kernels' libraries loaded in a process, g++ making it a unique symbol.)
using SmemHook = void (*)(unsigned char*);
namespace {
SmemHook smem_hooks[64];
int n_smem_hooks = 0;
inline bool register_dyn_smem_hook(SmemHook h) {
  if (n_smem_hooks >= 64) std::abort();
  smem_hooks[n_smem_hooks++] = h;
  return true;
}
}  // namespace
inline unsigned char* dynamic_smem() { return tctx().cta->smem; }

// Static __shared__ variables declared in functions (transform.py): each declaration site (the
// address of a static char beside it) gets its offset in the arena at its first execution in a
// launch, the same in every block of the launch. Lock-free lookups of the launch's table.
inline unsigned char* static_smem_site(const void* site, size_t bytes, size_t align) {
  Launch& L = *tctx().launch;
  const uint32_t n = L.static_sites.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < n; ++i) {
    if (L.static_site_key[i] == site) return tctx().cta->static_smem() + L.static_site_offset[i];
  }
  pthread_mutex_lock(&L.bar_lock);
  uint32_t i = 0;
  const uint32_t m = L.static_sites.load();
  while (i < m && L.static_site_key[i] != site) ++i;
  if (i == m) {
    const size_t at = (L.static_used.load() + align - 1) / align * align;
    if (m == kMaxStaticSites || at + bytes > kStaticSmemBytes) {
      pthread_mutex_unlock(&L.bar_lock);
      trap_with("static __shared__ variables: %zu bytes more at offset %zu exceed the %zu bytes "
                "of static shared memory (CUDA's limit), or more than %u declarations", bytes,
                at, kStaticSmemBytes, kMaxStaticSites);
    }
    L.static_site_key[i] = site;
    L.static_site_offset[i] = at;
    L.static_used.store(at + bytes);
    L.static_sites.store(m + 1, std::memory_order_release);
  }
  pthread_mutex_unlock(&L.bar_lock);
  return tctx().cta->static_smem() + L.static_site_offset[i];
}

// __cluster_dims__(x, y, z) of the kernels (transform.py registers them at load time).
struct ClusterDims {
  const char* kernel;
  long long x, y, z;
};
namespace {
ClusterDims cluster_dims_table[64];
int n_cluster_dims = 0;
inline bool register_cluster_dims(const char* kernel, long long x, long long y, long long z) {
  if (n_cluster_dims >= 64) std::abort();
  cluster_dims_table[n_cluster_dims++] = ClusterDims{kernel, x, y, z};
  return true;
}
// The kernel's __cluster_dims__ into out[0..2]: 1, or 0 when it has none.
inline int cluster_dims_of(const char* kernel, long long* out) {
  for (int i = 0; i < n_cluster_dims; ++i) {
    if (std::strcmp(cluster_dims_table[i].kernel, kernel) == 0) {
      out[0] = cluster_dims_table[i].x;
      out[1] = cluster_dims_table[i].y;
      out[2] = cluster_dims_table[i].z;
      return 1;
    }
  }
  return 0;
}
}  // namespace

template <class T>
inline T arg(void* p) {
  if constexpr (std::is_pointer_v<T>) {
    return static_cast<T>(*static_cast<void**>(p));
  } else {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return v;
  }
}

template <class T>
inline T warp_exchange(T v, uint32_t src_lane) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of this type");
  // Writing buffer p is safe: every lane finished reading it (two exchanges ago) before it
  // arrived at the barrier of the previous exchange, which this lane has passed.
  ThreadCtx& c = tctx();
  Warp& w = *c.warp;
  uint64_t* slots = w.slots[c.parity];
  c.parity ^= 1u;
  std::memcpy(&slots[c.lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r;
  std::memcpy(&r, &slots[src_lane & 31u], sizeof(T));
  return r;
}

// Per-thread state of the asynchronous Hopper instructions (kg_wgmma.h, kg_mbarrier.h,
// kg_bulk.h, kg_cluster.h): cleared when a thread starts a block, checked (and pending TMA
// stores written) when it leaves the kernel; `thread_exit` when it leaves, trap or not.
inline void async_thread_begin();
inline void async_thread_end();
inline void async_thread_exit();

inline void wait_while(const std::atomic<uint32_t>& word, uint32_t value) {
  if (word.load() != value) return;
  Fiber& f = *current_fiber;
  Launch& L = *f.ctx.launch;
  f.wait_word = &word;
  f.wait_value = value;
  do {
    if (L.trapped.load() != 0) {  // the launch failed elsewhere
      f.wait_word = nullptr;
      throw Trap{};
    }
    fiber_suspend();
  } while (word.load() == value);
  f.wait_word = nullptr;
  L.progress = true;
}

inline void fiber_poll() {
  if (current_fiber->ctx.launch->trapped.load() != 0) throw Trap{};
  fiber_suspend();
}

namespace {
// Makes `f` the running thread for this library's code: its thread_local variables
// (current_fiber, threadIdx, blockIdx, blockDim, gridDim) and the pointers of namespace-scope
// dynamic shared memory. The runtime calls it through Launch::enter before every resumption.
[[maybe_unused]] void enter_fiber(Fiber* f) {
  current_fiber = f;
  const Launch& L = *f->launch;
  const Cta& C = L.ctas[f->index / L.nthreads];
  threadIdx = f->thread_idx;
  blockIdx = C.block;
  blockDim = L.block;
  gridDim = L.grid;
  for (int h = 0; h < n_smem_hooks; ++h) smem_hooks[h](C.smem);
}
}  // namespace

// ---- the runtime: the runner, the fibers' lives, the launch -----------------------------------
// Compiled into every kernel's library, or (KG_EMU_EXTERN_RUNTIME) once into a runtime library
// the kernels' libraries link (kernelgen/emulator/kernel.py builds it with KG_EMU_RUNTIME_BUILD):
// a sixth of a kernel's g++ time.
#if defined(KG_EMU_EXTERN_RUNTIME)
int launch(void (*thunk)(void**), void (*enter)(Fiber*), void** args, const long long* cfg,
           long long* stats, const unsigned long long* ranges, int nranges, long long* arg_stats,
           char* note, int notelen, char* err, int errlen);
#else
#if defined(KG_EMU_RUNTIME_BUILD)
#define KG_EMU_RUNTIME_API __attribute__((visibility("default")))
#else
#define KG_EMU_RUNTIME_API inline
#endif

inline void fiber_entry(Fiber* f);

#if KG_FIBER_ASM
namespace {
// Where a fresh fiber starts (fiber_switch returns here): fiber_entry(r12), called through r13
// with the stack aligned as the ABI wants at a call.
__attribute__((naked, noinline)) void fiber_trampoline() {
  asm volatile(
      "movq %r12, %rdi\n\t"
      "callq *%r13\n\t"
      "ud2\n\t");
}
}  // namespace

// The fiber starts in fiber_entry at its next resumption: its stack holds the frame that
// fiber_switch pops (control words, r15..r12, rbx, rbp, return address).
inline void fiber_prepare(Fiber& f) {
  uint64_t* x = reinterpret_cast<uint64_t*>(f.stack + kFiberStackBytes) - 3;  // 8 mod 16
  uint32_t mxcsr = 0;
  uint16_t fcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fcw));
  x[0] = reinterpret_cast<uint64_t>(&fiber_trampoline);
  x[-1] = x[-2] = 0;                                           // rbp, rbx
  x[-3] = reinterpret_cast<uint64_t>(&f);                      // r12
  x[-4] = reinterpret_cast<uint64_t>(&fiber_entry);            // r13
  x[-5] = x[-6] = 0;                                           // r14, r15
  x[-7] = uint64_t{mxcsr} | uint64_t{fcw} << 32;
  f.sp = &x[-7];
}
inline void fiber_resume(Fiber& f) { fiber_switch(&f.launch->runner_sp, f.sp); }
#else
namespace {
void fiber_entry_uc(unsigned hi, unsigned lo) {
  fiber_entry(reinterpret_cast<Fiber*>(uintptr_t{hi} << 32 | uintptr_t{lo}));
}
}  // namespace
inline void fiber_prepare(Fiber& f) {
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack;
  f.uc.uc_stack.ss_size = kFiberStackBytes;
  f.uc.uc_link = nullptr;
  const uintptr_t p = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_entry_uc), 2,
              static_cast<unsigned>(p >> 32), static_cast<unsigned>(p & 0xffffffffu));
}
inline void fiber_resume(Fiber& f) { swapcontext(&f.launch->runner_uc, &f.uc); }
#endif

inline void fiber_stack_alloc(Fiber& f) {
  void* p = mmap(nullptr, kFiberStackBytes + Fiber::kGuardPage, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (p == MAP_FAILED) std::abort();
  mprotect(p, Fiber::kGuardPage, PROT_NONE);  // an overflow faults instead of corrupting
  f.stack = static_cast<unsigned char*>(p) + Fiber::kGuardPage;
}

// One emulated thread's run of its block: thread index % nthreads of block index / nthreads of
// the cluster. It ends switched out for good, `done`.
inline void fiber_entry(Fiber* fp) {
  Fiber& f = *fp;
  Launch& L = *f.launch;
  const uint32_t t = f.index % L.nthreads;
  Cta& C = L.ctas[f.index / L.nthreads];
  ThreadCtx& c = f.ctx;
  c.launch = &L;
  c.cta = &C;
  c.warp = &C.warps[t / 32];
  c.lane = t % 32;
  c.linear = t;
  c.parity = 0;
  c.wg_parity = 0;
  c.epoch = 0;
  hb().live = false;
  hb().arrivals = 0;
  for (uint64_t& v : c.stats) v = 0;
  for (int i = 0; i < L.nranges; ++i) c.arg_copies[i] = c.arg_bytes[i] = 0;
  L.progress = true;
  async_copies().clear();
  async_thread_begin();
  try {
    L.thunk(L.args);
    async_thread_end();
  } catch (const Trap& trap) {
    if (L.trapped.exchange(1) == 0) {
      L.trap_thread = f.thread_idx;
      L.trap_block = C.block;
      snprintf(L.trap_msg, sizeof L.trap_msg, "%s", trap.msg[0] ? trap.msg : "__trap()");
    }
  } catch (...) {  // nothing may unwind past a fiber's first frame
    if (L.trapped.exchange(1) == 0) {
      L.trap_thread = f.thread_idx;
      L.trap_block = C.block;
      snprintf(L.trap_msg, sizeof L.trap_msg, "a C++ exception left the kernel");
    }
  }
  async_thread_exit();
  for (int i = 0; i < kNumStats; ++i) {
    if (c.stats[i] != 0) L.stats[i].fetch_add(c.stats[i], std::memory_order_relaxed);
  }
  for (int i = 0; i < L.nranges; ++i) {
    if (c.arg_copies[i] != 0) {
      L.arg_copies[i].fetch_add(c.arg_copies[i], std::memory_order_relaxed);
      L.arg_bytes[i].fetch_add(c.arg_bytes[i], std::memory_order_relaxed);
    }
  }
  // cp.async copies never waited for are dropped (nothing can observe them legally).
  async_copies().clear();
  // Leaving the kernel: no longer expected at block or warp barriers.
  C.block_bar.arrive_and_drop();
  c.warp->bar.arrive_and_drop();
  if (t / 128 < L.nwarpgroups) {
    for (auto& slots : C.warpgroups[t / 128].slots) slots[t % 128].kind.store(0);
    C.warpgroups[t / 128].bar.arrive_and_drop();
  }
  C.running.fetch_sub(1, std::memory_order_acq_rel);
  f.done = true;
  fiber_suspend();
  __builtin_unreachable();
}

inline void describe_waits(const Launch& L, char* msg, size_t size, int used);
inline uint64_t splitmix64(uint64_t& state);
inline void shuffle(std::vector<uint32_t>& v, uint64_t& state);

// $KG_EMULATOR_SCHEDULE_SEED, else a fresh seed per launch.
inline uint64_t schedule_seed() {
  if (const char* s = std::getenv("KG_EMULATOR_SCHEDULE_SEED"); s != nullptr && *s != '\0') {
    return std::strtoull(s, nullptr, 0);
  }
  static std::atomic<uint64_t> launches{0};
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_nsec) ^ static_cast<uint64_t>(ts.tv_sec) << 30 ^
         launches.fetch_add(1) << 48 ^ static_cast<uint64_t>(getpid()) << 20;
}

// Rounds in a row in which only polling threads (test_wait, nanosleep) ran and none got past a
// wait, after which the cluster counts as deadlocked.
constexpr uint64_t kStallRounds = 1u << 16;

// Runs the current cluster's threads until every one has left the kernel. When every thread
// left waits for another (a deadlock: no resumption can change anything), the launch fails at
// once, naming what they wait for, and the threads are unwound.
inline void run_fibers(Launch& L) {
  const uint32_t total = L.nthreads * L.ncta;
  std::vector<uint32_t> order(total);
  for (uint32_t i = 0; i < total; ++i) order[i] = i;
  std::vector<uint8_t> held(total / 32);
  for (uint32_t i = 0; i < total; ++i) {
    Fiber& f = L.fibers[i];
    f.done = false;
    f.wait_word = nullptr;
    fiber_prepare(f);
  }
  uint32_t alive = total;
  uint64_t stalled = 0;
  // With clusters, one block at a time lags for stretches of rounds (held back in 3 rounds of
  // 4, the lagging block drawn anew about every 32 rounds; ncta: none), so the blocks of a
  // cluster drift apart by whole loop iterations, as they may on the GPU: a block that leaves
  // while another still reaches its shared memory, or a slot refilled before every block read
  // it, or a block reaching another's barriers before it initialised them, then shows in some
  // runs.
  uint32_t lagging =
      L.ncta > 1 ? static_cast<uint32_t>(splitmix64(L.schedule_state) % (L.ncta + 1)) : L.ncta;
  while (alive != 0) {
    L.progress = false;
    bool runnable = false;
    if (L.ncta > 1 && (splitmix64(L.schedule_state) & 31u) == 0)
      lagging = static_cast<uint32_t>(splitmix64(L.schedule_state) % (L.ncta + 1));
    const uint32_t held_block =
        lagging < L.ncta && (splitmix64(L.schedule_state) & 3u) != 0 ? lagging : L.ncta;
    // Each round resumes the threads in a fresh pseudo-random order (shuffle) and holds
    // back a random half of the warps, so that which thread runs ahead varies as it does on
    // the GPU and warps drift apart by whole steps: a missing wait or barrier shows as a hazard
    // or a wrong result in some runs, not never (KG_EMULATOR_SCHEDULE_SEED fixes the orders).
    shuffle(order, L.schedule_state);
    for (size_t w = 0; w < held.size(); w += 64) {
      const uint64_t bits = splitmix64(L.schedule_state);
      for (size_t b = 0; b < 64 && w + b < held.size(); ++b) held[w + b] = (bits >> b) & 1u;
    }
    for (const uint32_t i : order) {
      Fiber& f = L.fibers[i];
      if (f.done) continue;
      if (f.wait_word != nullptr && f.wait_word->load(std::memory_order_relaxed) == f.wait_value &&
          L.trapped.load(std::memory_order_relaxed) == 0) {
        continue;  // still blocked
      }
      runnable = true;
      if ((held[i / 32] != 0 || i / L.nthreads == held_block) &&
          L.trapped.load(std::memory_order_relaxed) == 0)
        continue;
      current_fiber = &f;  // this library's (fiber_entry's); L.enter sets the kernel's
      L.enter(&f);
      fiber_resume(f);
      current_fiber = nullptr;
      if (f.done) {
        --alive;
        L.progress = true;
        L.remaining.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
    stalled = L.progress ? 0 : stalled + 1;
    if (alive != 0 && (!runnable || stalled > kStallRounds) && L.trapped.load() == 0) {
      const uint3 b0 = L.ctas[0].block;
      int used = L.ncta == 1
                     ? snprintf(L.deadlock_msg, sizeof L.deadlock_msg,
                                "block (%u,%u,%u) deadlocked: %u of %u threads wait for each "
                                "other (at a barrier, shuffle or mbarrier wait)",
                                b0.x, b0.y, b0.z, alive, total)
                     : snprintf(L.deadlock_msg, sizeof L.deadlock_msg,
                                "the cluster of blocks (%u,%u,%u)..(%u,%u,%u) deadlocked: %u of "
                                "%u threads wait for each other (at a barrier, shuffle, mbarrier "
                                "wait or barrier.cluster)",
                                b0.x, b0.y, b0.z, L.ctas[L.ncta - 1].block.x,
                                L.ctas[L.ncta - 1].block.y, L.ctas[L.ncta - 1].block.z, alive,
                                total);
      describe_waits(L, L.deadlock_msg, sizeof L.deadlock_msg, used);
      L.deadlocked = true;
      L.trapped.store(1);  // every wait throws: the threads unwind and leave
    }
  }
}

// The launch's runner thread: runs each cluster the caller starts, then wakes it.
inline void* runner_main(void* p) {
  Launch& L = *static_cast<Launch*>(p);
  const uint32_t total = L.nthreads * L.ncta;
  L.fibers = new Fiber[total];
  L.schedule_state = schedule_seed();
  for (uint32_t i = 0; i < total; ++i) {
    Fiber& f = L.fibers[i];
    const uint32_t t = i % L.nthreads;
    f.launch = &L;
    f.index = i;
    f.thread_idx = uint3{t % L.block.x, (t / L.block.x) % L.block.y, t / (L.block.x * L.block.y)};
    fiber_stack_alloc(f);
  }
  uint32_t seen = 0;
  for (;;) {
    uint32_t s;
    while ((s = L.start_seq.load(std::memory_order_acquire)) == seen) futex_wait(L.start_seq, s);
    seen = s;
    if (L.stop) break;
    run_fibers(L);
    futex_wake_all(L.remaining);
  }
  delete[] L.fibers;
  L.fibers = nullptr;
  return nullptr;
}

inline double now_s() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

inline pthread_mutex_t launch_mutex = PTHREAD_MUTEX_INITIALIZER;

// Named barriers under way, and the first mbarrier with a phase under way, appended to `msg`
// (`used` bytes written) as hints of what a stuck cluster waits for.
inline void describe_waits(const Launch& L, char* msg, size_t size, int used) {
  bool mbar_named = false;
  for (uint32_t c = 0; c < L.ncta; ++c) {
    const Cta& C = L.ctas[c];
    for (uint32_t i = 0; i < kNamedBarriers && used > 0 && used < 700; ++i) {
      const NamedBarrierState& b = C.named[i];
      if (b.expected == 0) continue;
      used += snprintf(msg + used, size - static_cast<size_t>(used),
                       "; named barrier %u%s has %u of %u threads arrived (%u waiting in "
                       "bar.sync)", i, L.ncta == 1 ? "" : " of a block", b.arrived,
                       b.expected, b.syncing);
    }
    for (size_t i = 0; i < C.n_mbarriers && used > 0 && used < 850 && !mbar_named; ++i) {
      const MbarrierState& b = C.mbarriers[i];
      if (!b.initialized || (b.pending == static_cast<int32_t>(b.expected) && b.tx == 0)) {
        continue;
      }
      used += snprintf(msg + used, size - static_cast<size_t>(used),
                       "; the mbarrier at shared 0x%zx%s is in phase %u with %d of %u "
                       "arrivals and %d transaction bytes pending",
                       0x400 /* kSharedBase */ + 8 * i, L.ncta == 1 ? "" : " of a block",
                       b.phase.load(), b.pending, b.expected, b.tx);
      mbar_named = true;
    }
  }
}

inline int fail(char* err, int errlen, const char* msg) {
  if (err && errlen > 0) snprintf(err, static_cast<size_t>(errlen), "%s", msg);
  return 1;
}

// The order a launch runs its clusters in (cfg[9]; without clusters a block is a cluster of
// one): seed 0 in order (x fastest, then y, then z); a seed > 0 a pseudo-random permutation of
// the linear cluster indices, the same for the same seed and grid: a Fisher-Yates shuffle
// drawing from splitmix64 seeded with it (for i from the count down to 2, entry i - 1 swaps
// with entry j = the high 64 bits of draw * i). tests/test_emulator_block_order.py mirrors it.
constexpr uint64_t kMaxShuffledBlocks = uint64_t{1} << 24;

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Linear indices 0..n-1 in the order of `seed` (> 0).
// Fisher-Yates over `v` drawing from splitmix64 at `state` (for i from the size down to 2,
// entry i - 1 swaps with entry j = the high 64 bits of draw * i): the block order's shuffle and
// the runner's resumption orders.
inline void shuffle(std::vector<uint32_t>& v, uint64_t& state) {
  for (uint64_t i = v.size(); i > 1; --i) {
    const uint64_t j = static_cast<uint64_t>(
        (static_cast<unsigned __int128>(splitmix64(state)) * i) >> 64);  // in [0, i)
    std::swap(v[i - 1], v[j]);
  }
}

inline std::vector<uint32_t> shuffled_blocks(uint64_t nblocks, uint64_t seed) {
  std::vector<uint32_t> order(nblocks);
  for (uint64_t i = 0; i < nblocks; ++i) order[i] = static_cast<uint32_t>(i);
  uint64_t state = seed;
  shuffle(order, state);
  return order;
}

inline void cta_alloc(Cta& C, Launch& L, uint32_t rank, size_t smem_bytes, int fill) {
  C.launch = &L;
  C.rank = rank;
  C.smem_bytes = smem_bytes;
  C.static_offset = (smem_bytes + kGuard + 1023) / 1024 * 1024;
  C.window = C.static_offset + kStaticSmemBytes;
  C.buf_bytes = kGuard + C.window + kGuard;
  C.buf = static_cast<unsigned char*>(std::aligned_alloc(128, C.buf_bytes));
  C.smem = C.buf + kGuard;
  C.chunks = C.window / 16;
  C.shadow = new ChunkShadow[C.chunks + 1];
  C.n_mbarriers = C.window / 8;
  C.mbarriers = new MbarrierState[C.n_mbarriers + 1];
  C.mbarrier_live = new unsigned char[C.n_mbarriers + 1]();
  C.warps = new Warp[L.nwarps];
  C.warpgroup_issues = new WarpgroupIssue[(L.nthreads / 128 + 1) * kWarpgroupIssueRing];
  C.warpgroups = new Warpgroup[L.nwarpgroups + 1];
  // The guard zones stay intact between blocks (a block that writes them ends the launch); the
  // static arena is filled once here and, per block, as far as it is reserved (cta_reset).
  std::memset(C.buf, kGuardByte, C.buf_bytes);
  std::memset(C.static_smem(), fill, kStaticSmemBytes);
  for (size_t i = 0; i < C.chunks; ++i) C.shadow[i].reset();
}

inline void cta_free(Cta& C) {
  std::free(C.buf);
  delete[] C.shadow;
  delete[] C.mbarriers;
  delete[] C.mbarrier_live;
  delete[] C.warpgroup_issues;
  delete[] C.warpgroups;
  delete[] C.warps;
}

inline void cta_free_all(Launch& L) {
  for (uint32_t c = 0; c < L.ncta; ++c) cta_free(L.ctas[c]);
  delete[] L.ctas;
}

inline void cta_reset(Cta& C, int fill, uint3 block) {
  const Launch& L = *C.launch;
  C.block = block;
  // The dynamic shared memory and the reserved part of the static arena: filled with the
  // garbage byte, their shadows and mbarriers reset (nothing else can have been touched).
  const size_t used = L.static_used.load();
  std::memset(C.smem, fill, C.smem_bytes);
  std::memset(C.static_smem(), fill, used);
  C.block_bar.reset(L.nthreads);
  for (uint32_t w = 0; w < L.nwarps; ++w) C.warps[w].bar.reset(32);
  for (uint32_t g = 0; g < L.nwarpgroups; ++g) C.warpgroups[g].bar.reset(128);
  const size_t dyn_chunks = (C.smem_bytes + 15) / 16, first_static = C.static_offset / 16;
  for (size_t i = 0; i < dyn_chunks; ++i) C.shadow[i].reset();
  for (size_t i = first_static; i < first_static + (used + 15) / 16; ++i) C.shadow[i].reset();
  for (size_t i = 0; i < (C.smem_bytes + 7) / 8; ++i) C.mbarriers[i].reset();
  for (size_t i = C.static_offset / 8; i < (C.static_offset + used + 7) / 8; ++i) {
    C.mbarriers[i].reset();
  }
  std::memset(C.mbarrier_live, 0, C.n_mbarriers + 1);
  for (NamedBarrierState& b : C.named) b.reset();
  const size_t n_issues = (L.nthreads / 128 + 1) * kWarpgroupIssueRing;
  for (size_t i = 0; i < n_issues; ++i) C.warpgroup_issues[i] = WarpgroupIssue{};
  C.running.store(L.nthreads, std::memory_order_relaxed);
}

// The guard zones of a block after it ran: "" or what was overwritten.
inline const char* cta_guard_broken(const Cta& C) {
  const unsigned char* end_dyn = C.smem + C.smem_bytes;
  const unsigned char* end_static = C.static_smem() + kStaticSmemBytes;
  for (const unsigned char* p = C.buf; p < C.smem; ++p) {
    if (*p != kGuardByte) return "before the start of";
  }
  for (const unsigned char* p = end_dyn; p < C.static_smem(); ++p) {
    if (*p != kGuardByte) return "past the end of";
  }
  for (const unsigned char* p = end_static; p < C.buf + C.buf_bytes; ++p) {
    if (*p != kGuardByte) return "static";
  }
  return "";
}

// The first mbarrier of a block that is still live when the block ends and whose 8 bytes no
// longer hold kMbarrierObjectBytes (a write that was not an mbarrier instruction: a plain C++
// store, the accesses the emulator models being caught where they happen), or -1.
inline long long cta_clobbered_mbarrier(const Cta& C) {
  for (size_t i = 0; i < C.n_mbarriers; ++i) {
    if (C.mbarrier_live[i] && std::memcmp(C.smem + 8 * i, &kMbarrierObjectBytes, 8) != 0) {
      return static_cast<long long>(i);
    }
  }
  return -1;
}

// cfg: grid x,y,z, block x,y,z, dynamic smem bytes, fill byte, per-cluster timeout in ms (<=0:
// none), block order seed (0: in order; see shuffled_blocks), cluster x,y,z (1,1,1: none)
// stats: kNumStats counters, filled when the launch succeeds; note: the first bank conflict.
// ranges: nranges [lo, hi) byte ranges; arg_stats: per range, cp.async copies then bytes.
// Returns 0, or on error 1 (a trap or bad access), 2 (a race-check hazard), 3 (the watchdog).
KG_EMU_RUNTIME_API int launch(void (*thunk)(void**), void (*enter)(Fiber*), void** args,
                              const long long* cfg, long long* stats,
                              const unsigned long long* ranges, int nranges,
                              long long* arg_stats, char* note, int notelen, char* err,
                              int errlen) {
  char msg[1024];
  const dim3 grid(static_cast<unsigned>(cfg[0]), static_cast<unsigned>(cfg[1]),
                  static_cast<unsigned>(cfg[2]));
  const dim3 block(static_cast<unsigned>(cfg[3]), static_cast<unsigned>(cfg[4]),
                   static_cast<unsigned>(cfg[5]));
  const size_t smem_bytes = static_cast<size_t>(cfg[6]);
  const int fill = static_cast<int>(cfg[7]);
  const long long timeout_ms = cfg[8];
  const long long block_order = cfg[9];
  const dim3 cluster(static_cast<unsigned>(cfg[10]), static_cast<unsigned>(cfg[11]),
                     static_cast<unsigned>(cfg[12]));
  const uint32_t n = block.x * block.y * block.z;
  if (n == 0 || n % 32 != 0 || n > 1024) return fail(err, errlen, "bad block size");
  if (nranges < 0 || nranges > kMaxArgRanges) return fail(err, errlen, "too many arguments");
  const uint64_t ncta = uint64_t{cluster.x} * cluster.y * cluster.z;
  if (ncta == 0 || ncta > kMaxClusterSize || grid.x % cluster.x || grid.y % cluster.y ||
      grid.z % cluster.z || ncta * n > kMaxClusterThreads) {
    snprintf(msg, sizeof msg,
             "cluster (%u,%u,%u) of blocks of %u threads: the grid (%u,%u,%u) must be a "
             "multiple of it, with at most %u blocks and %u threads per cluster",
             cluster.x, cluster.y, cluster.z, n, grid.x, grid.y, grid.z, kMaxClusterSize,
             kMaxClusterThreads);
    return fail(err, errlen, msg);
  }
  const dim3 clusters(grid.x / cluster.x, grid.y / cluster.y, grid.z / cluster.z);
  const uint64_t nclusters = uint64_t{clusters.x} * clusters.y * clusters.z;
  if (block_order < 0) return fail(err, errlen, "negative block order seed");
  if (block_order > 0 && nclusters > kMaxShuffledBlocks) {
    snprintf(msg, sizeof msg,
             "a shuffled block order takes at most %llu blocks, the grid has %llu",
             static_cast<unsigned long long>(kMaxShuffledBlocks),
             static_cast<unsigned long long>(nclusters));
    return fail(err, errlen, msg);
  }
  // Empty: the clusters in order.
  const std::vector<uint32_t> order =
      block_order > 0 ? shuffled_blocks(nclusters, static_cast<uint64_t>(block_order))
                      : std::vector<uint32_t>();

  pthread_mutex_lock(&launch_mutex);
  // Heap allocated and deliberately leaked on timeout (stuck threads still reference it).
  Launch* Lp = new Launch();
  Launch& L = *Lp;
  L.thunk = thunk;
  L.enter = enter;
  L.args = args;
  L.ranges = reinterpret_cast<const uint64_t*>(ranges);
  L.nranges = nranges;
  L.grid = grid;
  L.block = block;
  L.cluster = cluster;
  L.nthreads = n;
  L.nwarps = n / 32;
  L.nwarpgroups = n / 128;
  L.ncta = static_cast<uint32_t>(ncta);
  L.ctas = new Cta[L.ncta];
  for (uint32_t r = 0; r < L.ncta; ++r) cta_alloc(L.ctas[r], L, r, smem_bytes, fill);

  const uint32_t total = n * L.ncta;
  pthread_t runner;
  int rc = 0;
  if (pthread_create(&runner, nullptr, runner_main, Lp) != 0) {
    rc = fail(err, errlen, "cannot start the emulator's runner thread");
    cta_free_all(L);
    delete Lp;
    pthread_mutex_unlock(&launch_mutex);
    return rc;
  }

  bool timed_out = false;
  for (uint64_t i_cluster = 0; rc == 0 && i_cluster < nclusters; ++i_cluster) {
    const uint64_t linear = order.empty() ? i_cluster : order[i_cluster];
    const unsigned cx = static_cast<unsigned>(linear % clusters.x);
    const unsigned cy = static_cast<unsigned>(linear / clusters.x % clusters.y);
    const unsigned cz = static_cast<unsigned>(linear / clusters.x / clusters.y);
    for (uint32_t r = 0; r < L.ncta; ++r) {
      const uint3 b{cx * cluster.x + r % cluster.x, cy * cluster.y + r / cluster.x % cluster.y,
                    cz * cluster.z + r / (cluster.x * cluster.y)};
      cta_reset(L.ctas[r], fill, b);
    }
    L.cluster_bar.reset(total);
    L.remaining.store(total, std::memory_order_relaxed);
    L.start_seq.fetch_add(1, std::memory_order_acq_rel);
    futex_wake_all(L.start_seq);
    const double deadline = now_s() + static_cast<double>(timeout_ms) / 1000.0;
    uint32_t r;
    while ((r = L.remaining.load(std::memory_order_acquire)) != 0) {
      if (timeout_ms > 0) {
        const double left = deadline - now_s();
        if (left <= 0) {
          timed_out = true;
          break;
        }
        struct timespec ts;
        ts.tv_sec = static_cast<time_t>(left);
        ts.tv_nsec = static_cast<long>((left - static_cast<double>(ts.tv_sec)) * 1e9);
        futex_wait(L.remaining, r, &ts);
      } else {
        futex_wait(L.remaining, r);
      }
    }
    const uint3 b0 = L.ctas[0].block;
    if (timed_out) {
      int used = L.ncta == 1
                     ? snprintf(msg, sizeof msg,
                                "block (%u,%u,%u) did not finish within %lld ms: %u of %u "
                                "threads still running (deadlock at a barrier, shuffle or "
                                "mbarrier wait, or an endless loop)",
                                b0.x, b0.y, b0.z, timeout_ms, r, total)
                     : snprintf(msg, sizeof msg,
                                "the cluster of blocks (%u,%u,%u)..(%u,%u,%u) did not finish "
                                "within %lld ms: %u of %u threads still running (deadlock at a "
                                "barrier, shuffle, mbarrier wait or barrier.cluster, or an "
                                "endless loop)",
                                b0.x, b0.y, b0.z, L.ctas[L.ncta - 1].block.x,
                                L.ctas[L.ncta - 1].block.y, L.ctas[L.ncta - 1].block.z,
                                timeout_ms, r, total);
      describe_waits(L, msg, sizeof msg, used);
      rc = 3;
      fail(err, errlen, msg);
      break;
    }
    if (L.deadlocked) {
      rc = 3;
      fail(err, errlen, L.deadlock_msg);
      break;
    }
    if (L.trapped.load()) {
      snprintf(msg, sizeof msg, "%s in block (%u,%u,%u) thread (%u,%u,%u)", L.trap_msg,
               L.trap_block.x, L.trap_block.y, L.trap_block.z, L.trap_thread.x,
               L.trap_thread.y, L.trap_thread.z);
      rc = fail(err, errlen, msg) + L.hazard;
      break;
    }
    for (uint32_t c = 0; c < L.ncta && rc == 0; ++c) {
      const Cta& C = L.ctas[c];
      const char* broken = cta_guard_broken(C);
      if (std::strcmp(broken, "static") == 0) {
        snprintf(msg, sizeof msg,
                 "block (%u,%u,%u) wrote past the end of its %zu bytes of static __shared__ "
                 "memory", C.block.x, C.block.y, C.block.z, kStaticSmemBytes);
        rc = fail(err, errlen, msg);
      } else if (broken[0] != '\0') {
        snprintf(msg, sizeof msg,
                 "block (%u,%u,%u) wrote %s its %zu bytes of dynamic shared memory", C.block.x,
                 C.block.y, C.block.z, broken, smem_bytes);
        rc = fail(err, errlen, msg);
      }
      const long long clobbered = rc == 0 ? cta_clobbered_mbarrier(C) : -1;
      if (clobbered >= 0) {
        snprintf(msg, sizeof msg,
                 "block (%u,%u,%u) ends with the bytes of its live mbarrier at shared 0x%llx "
                 "changed by a write that was not an mbarrier instruction (a plain C++ store?): "
                 "only mbarrier instructions may access an mbarrier object between its "
                 "mbarrier.init and mbarrier.inval", C.block.x, C.block.y, C.block.z,
                 0x400ull /* kSharedBase */ + 8 * static_cast<unsigned long long>(clobbered));
        rc = fail(err, errlen, msg) + 1;  // a hazard
      }
    }
  }

  if (timed_out) {
    // Threads are stuck: leave them (and everything they can touch) alive, detached. Those in
    // an mbarrier wait see the flag and leave the kernel (no thread keeps polling).
    L.trapped.store(1);
    L.stop = true;
    L.start_seq.fetch_add(1, std::memory_order_acq_rel);
    futex_wake_all(L.start_seq);
    pthread_detach(runner);
    pthread_mutex_unlock(&launch_mutex);
    return rc;
  }
  for (int i = 0; i < kNumStats; ++i) stats[i] = static_cast<long long>(L.stats[i].load());
  for (int i = 0; i < nranges; ++i) {
    arg_stats[i] = static_cast<long long>(L.arg_copies[i].load());
    arg_stats[nranges + i] = static_cast<long long>(L.arg_bytes[i].load());
  }
  if (note && notelen > 0) snprintf(note, static_cast<size_t>(notelen), "%s", L.first_conflict);
  L.stop = true;
  L.start_seq.fetch_add(1, std::memory_order_acq_rel);
  futex_wake_all(L.start_seq);
  pthread_join(runner, nullptr);
  cta_free_all(L);
  delete Lp;
  pthread_mutex_unlock(&launch_mutex);
  return rc;
}

#endif  // KG_EMU_EXTERN_RUNTIME
}  // namespace kg_emu

// ---------------------------------------------------------------------------------------------
// Synchronization, warp primitives
// ---------------------------------------------------------------------------------------------
inline void __syncthreads() {
  kg_emu::tctx().cta->block_bar.arrive_and_wait();
  ++kg_emu::tctx().epoch;
}
inline void __syncwarp(unsigned int /*mask*/ = 0xffffffffu) {
  kg_emu::tctx().warp->bar.arrive_and_wait();
}
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int __activemask() { return 0xffffffffu; }
[[noreturn]] inline void __trap() { throw kg_emu::Trap{}; }

// Lane selection follows the PTX shfl.sync rules for a segment of `width` lanes.
template <class T>
inline T __shfl_sync(unsigned int /*mask*/, T var, int src_lane, int width = 32) {
  const uint32_t lane = kg_emu::tctx().lane;
  const uint32_t w = static_cast<uint32_t>(width);
  const uint32_t lo = lane & ~(w - 1);
  return kg_emu::warp_exchange(var, lo | (static_cast<uint32_t>(src_lane) & (w - 1)));
}
template <class T>
inline T __shfl_xor_sync(unsigned int /*mask*/, T var, int lane_mask, int width = 32) {
  const uint32_t lane = kg_emu::tctx().lane;
  const uint32_t w = static_cast<uint32_t>(width);
  const uint32_t hi = (lane & ~(w - 1)) + w - 1;
  const uint32_t j = lane ^ (static_cast<uint32_t>(lane_mask) & 31u);
  return kg_emu::warp_exchange(var, j <= hi ? j : lane);
}
template <class T>
inline T __shfl_down_sync(unsigned int /*mask*/, T var, unsigned int delta, int width = 32) {
  const uint32_t lane = kg_emu::tctx().lane;
  const uint32_t w = static_cast<uint32_t>(width);
  const uint32_t hi = (lane & ~(w - 1)) + w - 1;
  const uint32_t j = lane + delta;
  return kg_emu::warp_exchange(var, j <= hi ? j : lane);
}
template <class T>
inline T __shfl_up_sync(unsigned int /*mask*/, T var, unsigned int delta, int width = 32) {
  const int lane = static_cast<int>(kg_emu::tctx().lane);
  const int lo = lane & ~(width - 1);
  const int j = lane - static_cast<int>(delta);
  return kg_emu::warp_exchange(var, static_cast<uint32_t>(j >= lo ? j : lane));
}

inline unsigned int __ballot_sync(unsigned int /*mask*/, int pred) {
  kg_emu::ThreadCtx& c = kg_emu::tctx();
  kg_emu::Warp& w = *c.warp;
  uint64_t* slots = w.slots[c.parity];  // same double buffering as kg_emu::warp_exchange
  c.parity ^= 1u;
  slots[c.lane] = pred ? 1u : 0u;
  w.bar.arrive_and_wait();
  unsigned int bits = 0;
  for (uint32_t i = 0; i < 32; ++i) bits |= (slots[i] ? 1u : 0u) << i;
  return bits;
}
inline int __any_sync(unsigned int mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned int mask, int pred) { return __ballot_sync(mask, pred) == ~0u; }

// ---------------------------------------------------------------------------------------------
// Atomics (blocks are sequential; the threads of a block are fibers of one OS thread, and the
// atomics stay atomic for the rest of the process)
// ---------------------------------------------------------------------------------------------
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline T atomicAdd(T* p, T v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
inline T atomicAdd(T* p, T v) {
  T old;
  __atomic_load(p, &old, __ATOMIC_SEQ_CST);  // (__atomic_load_n takes no floating types)
  for (;;) {
    T next = old + v;
    if (__atomic_compare_exchange(p, &old, &next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
      return old;
    }
  }
}
template <class T>
inline T atomicSub(T* p, T v) {
  return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomicExch(T* p, T v) {
  T old;
  __atomic_exchange(p, &v, &old, __ATOMIC_SEQ_CST);
  return old;
}
template <class T>
inline T atomicCAS(T* p, T compare, T v) {
  __atomic_compare_exchange(p, &compare, &v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;
}
template <class T>
inline T atomicMax(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST,
                                                 __ATOMIC_SEQ_CST)) {
  }
  return old;
}
template <class T>
inline T atomicMin(T* p, T v) {
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST,
                                                 __ATOMIC_SEQ_CST)) {
  }
  return old;
}

// ---------------------------------------------------------------------------------------------
// Math
// ---------------------------------------------------------------------------------------------
using std::isfinite;
using std::isinf;
using std::isnan;

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __exp10f(float x) { return powf(10.0f, x); }
inline float __logf(float x) { return logf(x); }
inline float __log2f(float x) { return log2f(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __tanhf(float x) { return tanhf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }

inline int __float_as_int(float x) { return __builtin_bit_cast(int, x); }
inline unsigned int __float_as_uint(float x) { return __builtin_bit_cast(unsigned int, x); }
inline float __int_as_float(int x) { return __builtin_bit_cast(float, x); }
inline float __uint_as_float(unsigned int x) { return __builtin_bit_cast(float, x); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rn(float x) { return static_cast<int>(nearbyintf(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned int>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
// __byte_perm(x, y, s) (CUDA's integer intrinsic, libdevice __nv_byte_perm; PTX prmt.b32 in its
// default mode): byte n of the result is byte s<4n+2:4n> of the eight bytes {y, x}, x's bytes
// 0-3; the top bit of each selector nibble and the upper 16 bits of s are not used.
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const uint64_t bytes = static_cast<uint64_t>(y) << 32 | x;
  unsigned int r = 0;
  for (int n = 0; n < 4; ++n) r |= static_cast<unsigned int>(bytes >> (8 * ((s >> (4 * n)) & 7u)) & 0xFFu) << (8 * n);
  return r;
}

// CUDA's integer/float min and max overloads (usual arithmetic conversions; floats like fminf).
template <class A, class B,
          std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) {
    return std::fmin(static_cast<C>(a), static_cast<C>(b));
  } else {
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
  }
}
template <class A, class B,
          std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>, int> = 0>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) {
    return std::fmax(static_cast<C>(a), static_cast<C>(b));
  } else {
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
  }
}

// Cache-hinted loads and stores are plain memory accesses.
template <class T>
inline T __ldg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcg(const T* p) {
  return *p;
}
template <class T>
inline T __ldcs(const T* p) {
  return *p;
}
template <class T>
inline void __stcg(T* p, T v) {
  *p = v;
}
template <class T>
inline void __stcs(T* p, T v) {
  *p = v;
}

// ---------------------------------------------------------------------------------------------
// __half and __nv_bfloat16: 16-bit storage, bit-exact round-to-nearest-even conversions
// ---------------------------------------------------------------------------------------------
namespace kg_emu {

inline uint32_t f32_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
inline float f32_from_bits(uint32_t u) { return __builtin_bit_cast(float, u); }

inline uint16_t float_to_half_bits(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return 0x7fffu;              // NaN -> canonical NaN (as cvt.rn.f16.f32)
  if (ax >= 0x477ff000u) return sign | 0x7c00u;      // >= 65520 (and inf) -> inf
  if (ax < 0x38800000u) {                            // below 2^-14: half subnormal or zero
    if (ax <= 0x33000000u) return sign;              // <= 2^-25 (the tie) -> zero
    const uint32_t e = ax >> 23;                     // value = m * 2^(e - 150)
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;                 // result in units of 2^-24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  const uint32_t rebased = ax - 0x38000000u;  // exponent bias 127 -> 15
  uint32_t r = rebased >> 13;
  const uint32_t rem = rebased & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0x1fu) return f32_from_bits(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    const float mag = static_cast<float>(m) * 0x1p-24f;  // exact
    return f32_from_bits(sign | f32_bits(mag));
  }
  return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN -> canonical NaN
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float bf16_bits_to_float(uint16_t b) { return f32_from_bits(static_cast<uint32_t>(b) << 16); }

// A double rounded once to f16 (round to nearest even; NaN -> 0x7FFF, overflow -> inf).
inline uint16_t double_to_half_bits(double x) {
  if (std::isnan(x)) return 0x7FFFu;
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  const double a = std::fabs(x);
  if (a >= 65520.0) return sign | 0x7C00u;  // 65504 + half an ulp and above round to inf
  if (a == 0.0) return sign;
  int e;
  (void)std::frexp(a, &e);  // a in [2^(e-1), 2^e)
  const int q = e - 11 > -24 ? e - 11 : -24;  // the quantum's exponent: 10 mantissa bits
  const double v = std::ldexp(std::nearbyint(std::ldexp(a, -q)), q);  // exact in f16
  return static_cast<uint16_t>(sign | float_to_half_bits(static_cast<float>(v)));
}

// OCP FP8 (the PTX ISA's .e4m3 and .e5m2): e4m3 bias 7, 3 mantissa bits, no infinities, NaN
// S.1111.111, largest 448; e5m2 bias 15, 2 mantissa bits, IEEE-like infinities and NaNs,
// largest finite 57344.
inline double fp8_bits_to_double_exact(uint8_t b, bool e5m2) {
  const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const int e = (b & 0x7F) >> mbits, m = b & ((1 << mbits) - 1);
  double v;
  if (e5m2 && e == 31) {
    v = m != 0 ? std::nan("") : HUGE_VAL;
  } else if (!e5m2 && e == 15 && m == 7) {
    v = std::nan("");
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - bias - mbits);
  } else {
    v = std::ldexp(static_cast<double>((1 << mbits) + m), e - bias - mbits);
  }
  return (b & 0x80) ? -v : v;
}

// The same through a table of all 256 values per format, built once from the function above:
// wgmma's operand loads call it for every element of every product (32 times per B element per
// instruction, once per lane that reads it), where the ldexp path made the fp8 kernels' emulation
// several times slower than the 16-bit ones'.
inline double fp8_bits_to_double(uint8_t b, bool e5m2) {
  static const std::array<std::array<double, 256>, 2> values = [] {
    std::array<std::array<double, 256>, 2> t{};
    for (int format = 0; format < 2; ++format)
      for (int bits = 0; bits < 256; ++bits)
        t[format][bits] = fp8_bits_to_double_exact(static_cast<uint8_t>(bits), format == 1);
    return t;
  }();
  return values[e5m2 ? 1 : 0][b];
}

// cvt.rn.satfinite{.relu} to .e4m3 / .e5m2: round to nearest even; a NaN input gives NaN
// (0x7F); magnitudes (infinities too) beyond the largest finite value give it, sign kept;
// .relu turns negative results into +0.
inline uint8_t double_to_fp8_satfinite(double x, bool e5m2, bool relu) {
  if (std::isnan(x)) return 0x7F;
  if (relu && x < 0) x = 0.0;
  const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const double max_norm = e5m2 ? 57344.0 : 448.0;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  double v = max_norm;
  if (a < max_norm) {
    if (a == 0.0) return sign;
    int e;
    (void)std::frexp(a, &e);
    const int q = e - 1 - mbits > 1 - bias - mbits ? e - 1 - mbits : 1 - bias - mbits;
    v = std::ldexp(std::nearbyint(std::ldexp(a, -q)), q);
    if (v > max_norm) v = max_norm;
  }
  if (v == 0.0) return sign;
  int e;
  (void)std::frexp(v, &e);  // v in [2^(e-1), 2^e)
  const int biased = e - 1 + bias;
  if (biased <= 0) {  // subnormal: v = m 2^(1 - bias - mbits)
    return sign | static_cast<uint8_t>(std::ldexp(v, bias - 1 + mbits));
  }
  const int m = static_cast<int>(std::ldexp(v, mbits - (e - 1))) - (1 << mbits);
  return sign | static_cast<uint8_t>(biased << mbits | m);
}

}  // namespace kg_emu

struct __half {
  unsigned short __x;
  __half() = default;
  __half(float f) : __x(kg_emu::float_to_half_bits(f)) {}
  __half(double d) : __x(kg_emu::float_to_half_bits(static_cast<float>(d))) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  __half(I i) : __x(kg_emu::float_to_half_bits(static_cast<float>(i))) {}
  operator float() const { return kg_emu::half_bits_to_float(__x); }
};
struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(kg_emu::float_to_bf16_bits(f)) {}
  __nv_bfloat16(double d) : __x(kg_emu::float_to_bf16_bits(static_cast<float>(d))) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  __nv_bfloat16(I i) : __x(kg_emu::float_to_bf16_bits(static_cast<float>(i))) {}
  operator float() const { return kg_emu::bf16_bits_to_float(__x); }
};
static_assert(sizeof(__half) == 2 && alignof(__half) == 2);
static_assert(sizeof(__nv_bfloat16) == 2 && alignof(__nv_bfloat16) == 2);
static_assert(std::is_trivially_copyable_v<__half> && std::is_trivially_copyable_v<__nv_bfloat16>);
using half = __half;
using nv_bfloat16 = __nv_bfloat16;

inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.__x = u;
  return h;
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  __nv_bfloat16 b;
  b.__x = u;
  return b;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }

inline float __half2float(__half h) { return kg_emu::half_bits_to_float(h.__x); }
inline __half __float2half(float f) { return __ushort_as_half(kg_emu::float_to_half_bits(f)); }
inline __half __float2half_rn(float f) { return __ushort_as_half(kg_emu::float_to_half_bits(f)); }
inline float __bfloat162float(__nv_bfloat16 b) { return kg_emu::bf16_bits_to_float(b.__x); }
inline __nv_bfloat16 __float2bfloat16(float f) {
  return __ushort_as_bfloat16(kg_emu::float_to_bf16_bits(f));
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return __ushort_as_bfloat16(kg_emu::float_to_bf16_bits(f));
}

// ---------------------------------------------------------------------------------------------
// __half2 and __nv_bfloat162: two 16-bit values in one 32-bit word, .x in the low half
// ---------------------------------------------------------------------------------------------
struct alignas(4) __half2 {
  __half x, y;
  __half2() = default;
  __half2(__half lo, __half hi) : x(lo), y(hi) {}
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
  __nv_bfloat162() = default;
  __nv_bfloat162(__nv_bfloat16 lo, __nv_bfloat16 hi) : x(lo), y(hi) {}
};
static_assert(sizeof(__half2) == 4 && alignof(__half2) == 4);
static_assert(sizeof(__nv_bfloat162) == 4 && alignof(__nv_bfloat162) == 4);
static_assert(std::is_trivially_copyable_v<__half2> &&
              std::is_trivially_copyable_v<__nv_bfloat162>);
using half2 = __half2;
using nv_bfloat162 = __nv_bfloat162;

// Each element is rounded on its own (round-to-nearest-even), exactly like the scalar forms.
inline __half2 __floats2half2_rn(float lo, float hi) {
  return __half2(__float2half_rn(lo), __float2half_rn(hi));
}
inline __half2 __float22half2_rn(float2 v) { return __floats2half2_rn(v.x, v.y); }
inline __half2 __halves2half2(__half lo, __half hi) { return __half2(lo, hi); }
inline __half2 __half2half2(__half v) { return __half2(v, v); }
inline __half2 make_half2(__half x, __half y) { return __half2(x, y); }
inline float2 __half22float2(__half2 v) { return float2{__half2float(v.x), __half2float(v.y)}; }
inline float __low2float(__half2 v) { return __half2float(v.x); }
inline float __high2float(__half2 v) { return __half2float(v.y); }
inline __half __low2half(__half2 v) { return v.x; }
inline __half __high2half(__half2 v) { return v.y; }

inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162(__float2bfloat16_rn(lo), __float2bfloat16_rn(hi));
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) { return __floats2bfloat162_rn(v.x, v.y); }
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return __nv_bfloat162(lo, hi);
}
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 v) { return __nv_bfloat162(v, v); }
inline __nv_bfloat162 make_bfloat162(__nv_bfloat16 x, __nv_bfloat16 y) {
  return __nv_bfloat162(x, y);
}
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
  return float2{__bfloat162float(v.x), __bfloat162float(v.y)};
}
inline float __low2float(__nv_bfloat162 v) { return __bfloat162float(v.x); }
inline float __high2float(__nv_bfloat162 v) { return __bfloat162float(v.y); }
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v) { return v.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v) { return v.y; }

// Inline PTX (ldmatrix, mma.sync, cp.async) as C++ functions; the Python side rewrites `asm`.
#include "kg_ptx.h"

#endif  // KG_EMULATOR_H
