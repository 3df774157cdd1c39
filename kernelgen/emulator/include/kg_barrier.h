// kg_barrier.h -- the CTA's named barriers of the CPU emulator (PTX ISA "Parallel Synchronization
// and Communication Instructions: bar, barrier"): bar{.cta}.sync / barrier{.cta}.sync{.aligned}
// a{, b} and bar{.cta}.arrive / barrier{.cta}.arrive{.aligned} a, b. Included by kg_ptx.h.
//
// A CTA has 16 barriers, ids 0..15. Operand b is the number of threads taking part, a multiple
// of the warp size; without it every thread of the CTA takes part. The barrier completes when b
// threads have arrived; .sync threads wait for that, .arrive threads do not. Then it can be used
// again. Every thread of one use gives the same b.
//
// bar.sync 0 without a count (or with the block's thread count) is __syncthreads (what nvcc
// compiles it to), as is a .sync without a count of any id: the block barrier, which threads that
// left the kernel no longer hold up, and a barrier epoch of the race check. Any other barrier is
// its own object: threads meet there, and the mbarrier phases the arriving threads had seen
// complete become known to its .sync threads (kg_mbarrier.h: check_tma_read), the way a
// __syncthreads passes them on; a use where every thread of the block syncs is a barrier epoch. Misuse traps: an id
// outside 0..15, a count that is not a positive multiple of 32 or exceeds the block, a .arrive
// without a count, threads of one use giving different counts, and a use completed by
// .arrive alone (no thread waits for it: it orders nothing, so a .sync is missing); a count
// that is never filled is a deadlock, which the watchdog reports naming the barrier and its
// arrivals.
#ifndef KG_BARRIER_H
#define KG_BARRIER_H

namespace kg_emu {

struct BarrierLock {
  BarrierLock() { pthread_mutex_lock(&tctx().launch->bar_lock); }
  ~BarrierLock() { pthread_mutex_unlock(&tctx().launch->bar_lock); }
  BarrierLock(const BarrierLock&) = delete;
  BarrierLock& operator=(const BarrierLock&) = delete;
};

// The checked thread count of `what` a, b (b < 0: none given, the whole block).
inline uint32_t named_barrier_count(const char* what, long long id, long long count) {
  const uint32_t n = tctx().launch->nthreads;
  if (id < 0 || id >= static_cast<long long>(kNamedBarriers)) {
    trap_with("%s %lld: the barrier id must be in 0..15", what, id);
  }
  if (count < 0) return n;
  if (count == 0 || count % 32 != 0 || count > static_cast<long long>(n)) {
    trap_with("%s %lld, %lld: the thread count must be a multiple of 32 in [32, %u] (the block's "
              "threads)", what, id, count, n);
  }
  return static_cast<uint32_t>(count);
}

// Arrival at named barrier `id` (lock held); returns the generation it counts towards, or
// completes it.
inline uint32_t named_barrier_arrive(NamedBarrierState& b, const char* what, uint32_t id,
                                     uint32_t count, bool syncing) {
  if (b.expected == 0) {
    b.expected = count;
    b.first_thread = tctx().linear;
  } else if (b.expected != count) {
    report_error("%s %u, %u by thread %u: barrier %u is under way with a thread count of %u "
                 "(since thread %u arrived): every thread of one barrier gives the same count",
                 what, id, count, tctx().linear, id, b.expected, b.first_thread);
    throw Trap{};
  }
  const uint32_t gen = b.generation.load();
  if (b.knowledge.size() <= gen) b.knowledge.resize(gen + 1);
  for (const SeenPhase& s : mbarrier_seen()) b.knowledge[gen].seen.push_back(s);
  hb_release(b.knowledge[gen].known);
  b.arrived += 1;
  b.syncing += syncing ? 1u : 0u;
  if (b.arrived == b.expected && b.syncing == 0) {
    // Legal PTX, but a phase that nobody waits for orders nothing: some thread that should
    // have waited in bar.sync did not (e.g. a warpgroup taking its turn without waiting for
    // it, whose partner's bar.arrive calls then fill the barrier on their own).
    report_error("%s %u, %u by thread %u completed barrier %u with no thread waiting in "
                 "bar.sync: %u arrivals and no wait (a bar.sync missing?)",
                 what, id, count, tctx().linear, id, b.arrived);
    throw Trap{};
  }
  if (b.arrived == b.expected) {
    b.knowledge[gen].whole_block = b.syncing == tctx().launch->nthreads;
    b.expected = b.arrived = b.syncing = 0;
    b.generation.fetch_add(1);
  }
  return gen;
}

}  // namespace kg_emu

namespace kg_emu::ptx {

// bar.sync / barrier.sync a{, b} (count < 0: no b).
inline void bar_sync(long long id, long long count = -1) {
  constexpr const char* what = "bar.sync";
  const uint32_t n = named_barrier_count(what, id, count);
  if (count < 0 || (id == 0 && n == tctx().launch->nthreads)) {
    __syncthreads();
    return;
  }
  NamedBarrierState& b = tctx().cta->named[id];
  uint32_t gen;
  {
    BarrierLock lock;
    gen = named_barrier_arrive(b, what, static_cast<uint32_t>(id), n, true);
  }
  wait_while(b.generation, gen);
  BarrierLock lock;
  for (const SeenPhase& s : b.knowledge[gen].seen) mbarrier_know(s.slot, s.completed);
  hb_acquire(b.knowledge[gen].known);
  if (b.knowledge[gen].whole_block) ++tctx().epoch;
}

// bar.arrive / barrier.arrive a, b: counts towards the barrier without waiting.
inline void bar_arrive(long long id, long long count) {
  constexpr const char* what = "bar.arrive";
  if (count < 0) trap_with("%s %lld: a thread count is required", what, id);
  const uint32_t n = named_barrier_count(what, id, count);
  BarrierLock lock;
  named_barrier_arrive(tctx().cta->named[id], what, static_cast<uint32_t>(id), n, false);
}

}  // namespace kg_emu::ptx

#endif  // KG_BARRIER_H
