// kg_mbarrier.h -- mbarrier objects of the CPU emulator (PTX ISA "Parallel Synchronization and
// Communication Instructions: mbarrier"), and the check that a read of bytes a TMA wrote comes
// after the reader saw the mbarrier phase of that write complete. Included by kg_ptx.h.
//
// State (kg_emulator.h's MbarrierState, one per 8 bytes of dynamic shared memory): expected
// arrivals per phase, pending arrivals, transaction count, completed phases. A phase completes
// when pending arrivals and the transaction count are both 0; the pending count then resets to
// the expected count. Misuse traps. The 8 bytes hold kMbarrierObjectBytes while the object lives
// (mbarrier.init to mbarrier.inval): any other access to them is a hazard (PTX ISA: only
// mbarrier instructions may touch an initialized object), caught at the access for the
// instructions the emulator models and, for plain C++ stores, by the changed pattern at the
// barrier's next mbarrier instruction, its mbarrier.inval or the block's end.
#ifndef KG_MBARRIER_H
#define KG_MBARRIER_H

#include <utility>
#include <vector>

namespace kg_emu {

constexpr int32_t kMbarrierMaxCount = (1 << 20) - 1;  // arrivals and |transaction count|

struct MbarrierLock {
  MbarrierLock() { pthread_mutex_lock(&tctx().launch->mbar_lock); }
  ~MbarrierLock() { pthread_mutex_unlock(&tctx().launch->mbar_lock); }
  MbarrierLock(const MbarrierLock&) = delete;
  MbarrierLock& operator=(const MbarrierLock&) = delete;
};

// The slot of the mbarrier at .shared::cta address `addr` of block C.
inline uint32_t mbarrier_slot_in(const Cta& C, uint32_t addr, const char* what) {
  const unsigned char* p = cta_shared_span(C, addr, 8, 8, what);
  return static_cast<uint32_t>((p - C.smem) / 8);
}
inline uint32_t mbarrier_slot(uint32_t addr, const char* what) {
  return mbarrier_slot_in(*tctx().cta, addr, what);
}
inline uint32_t mbarrier_address(uint32_t slot) { return kSharedBase + 8 * slot; }

// The barrier.cluster phases this thread has passed (its last barrier.cluster.wait returned
// after that many completed; kg_cluster.h sets it).
struct ClusterPassed {
  uint32_t value = 0;
};
inline uint32_t& cluster_passed() { return fiber_local<ClusterPassed, kLocalClusterPassed>().value; }

// The barrier at `addr` of block C, which must have been initialized in this block (lock held).
// A thread of another block of the cluster (a remote arrival, a multicast or remote TMA
// completing bytes) may reach it only after a barrier.cluster that completed after the
// initialisation (PTX ISA: the initialisation is made visible to the cluster by
// fence.mbarrier_init.release.cluster and a cluster barrier): otherwise a hazard, whatever the
// order in which the emulator happened to run the two.
inline MbarrierState& mbarrier_initialized_in(Cta& C, uint32_t addr, const char* what) {
  const uint32_t slot = mbarrier_slot_in(C, addr, what);
  MbarrierState& b = C.mbarriers[slot];
  if (!b.initialized) {
    trap_with("%s: the mbarrier at shared 0x%x was not initialized (mbarrier.init) in this block",
              what, addr);
  }
  if (std::memcmp(C.smem + 8 * slot, &kMbarrierObjectBytes, 8) != 0) {
    report_hazard("%s: the bytes of the live mbarrier at shared 0x%x were changed since its "
                  "mbarrier.init by a write that was not an mbarrier instruction (a plain C++ "
                  "store?): only mbarrier instructions may access an mbarrier object until "
                  "mbarrier.inval", what, addr);
  }
  if (&C != tctx().cta && cluster_passed() <= b.init_cluster_phase) {
    report_hazard("%s reaches the mbarrier at shared 0x%x of block rank %u with no "
                  "barrier.cluster between that block's mbarrier.init and this thread "
                  "(fence.mbarrier_init.release.cluster, then barrier.cluster arrive and wait "
                  "in every thread)", what, addr, C.rank);
  }
  return b;
}
inline MbarrierState& mbarrier_initialized(uint32_t addr, const char* what) {
  return mbarrier_initialized_in(*tctx().cta, addr, what);
}

// Completes the current phase when nothing is pending (lock held); what its arrivals released
// becomes what a thread that sees the phase complete acquires.
inline void mbarrier_maybe_complete(MbarrierState& b) {
  if (b.pending != 0 || b.tx != 0) return;
  b.pending = static_cast<int32_t>(b.expected);
  b.known_at[b.phase.load() % 4] = b.known;
  b.seen_at[b.phase.load() % 4] = b.seen;
  b.phase.fetch_add(1);
}

inline void mbarrier_add_tx(MbarrierState& b, int64_t delta, uint32_t addr, const char* what) {
  const int64_t tx = static_cast<int64_t>(b.tx) + delta;
  if (tx > kMbarrierMaxCount || tx < -kMbarrierMaxCount) {
    trap_with("%s: the transaction count of the mbarrier at shared 0x%x would be %lld, outside "
              "[-(2^20-1), 2^20-1] (more bytes completed than expected, or expected twice?)",
              what, addr, static_cast<long long>(tx));
  }
  b.tx = static_cast<int32_t>(tx);
}

// Phases of barrier `slot` this thread saw complete (try_wait / test_wait returned true), or
// learnt of through a named barrier (kg_barrier.h).
struct MbarrierSeen {
  std::vector<SeenPhase> value;
};
inline std::vector<SeenPhase>& mbarrier_seen() {
  return fiber_local<MbarrierSeen, kLocalMbarrierSeen>().value;
}

// `completed` phases of barrier `slot` are done, in `seen` (the phases a thread knows of).
inline void merge_seen(std::vector<SeenPhase>& seen, uint32_t slot, uint32_t completed) {
  for (SeenPhase& s : seen) {
    if (s.slot == slot) {
      s.completed = completed > s.completed ? completed : s.completed;
      return;
    }
  }
  seen.push_back(SeenPhase{slot, completed});
}

// This thread saw `completed` phases of `b` done: remember it, for itself and (with its epoch)
// for the threads that pass a later __syncthreads.
inline void mbarrier_know(uint32_t slot, uint32_t completed) {
  merge_seen(mbarrier_seen(), slot, completed);
}

inline void mbarrier_observe(MbarrierState& b, uint32_t slot, uint32_t completed) {
  mbarrier_know(slot, completed);
  MbarrierLock lock;
  if (completed > 0) {
    hb_acquire(b.known_at[(completed - 1) % 4]);
    // the phases the arriving threads had seen (one thread may wait for a TMA copy and pass it
    // on by its arrival here, as by a named barrier)
    for (const SeenPhase& s : b.seen_at[(completed - 1) % 4]) mbarrier_know(s.slot, s.completed);
  }
  const uint32_t i = completed % 4;
  if (b.seen_phase[i] != completed || b.seen_epoch[i] > tctx().epoch) {
    b.seen_phase[i] = completed;
    b.seen_epoch[i] = tctx().epoch;
  }
}

inline void mbarrier_init(uint32_t addr, long long count) {
  const uint32_t slot = mbarrier_slot(addr, "mbarrier.init");
  if (count < 1 || count > kMbarrierMaxCount) {
    trap_with("mbarrier.init: count %lld outside [1, 2^20-1]", count);
  }
  MbarrierLock lock;
  Cta& C = *tctx().cta;
  MbarrierState& b = C.mbarriers[slot];
  if (b.initialized) {
    report_hazard("mbarrier.init on the live mbarrier at shared 0x%x (initialized, not "
                  "invalidated): mbarrier.inval it before initializing it again", addr);
  }
  b.reset();
  b.initialized = 1;
  C.mbarrier_live[slot] = 1;
  std::memcpy(C.smem + 8 * slot, &kMbarrierObjectBytes, 8);
  b.init_cluster_phase = tctx().launch->cluster_bar.generation.load();
  b.expected = static_cast<uint32_t>(count);
  b.pending = static_cast<int32_t>(count);
}

// mbarrier.inval (PTX ISA: "An mbarrier object must be invalidated before using its memory
// location for any other purpose"): the bytes are ordinary shared memory again, and may hold a
// new mbarrier after another mbarrier.init. The TMA and cp.async chunks stamped with its phases
// forget them (a new barrier at the address counts its phases from 0 again).
inline void mbarrier_inval(uint32_t addr) {
  MbarrierLock lock;
  Cta& C = *tctx().cta;
  MbarrierState& b = mbarrier_initialized(addr, "mbarrier.inval");
  const uint32_t slot = mbarrier_slot(addr, "mbarrier.inval");
  b.initialized = 0;
  C.mbarrier_live[slot] = 0;
  for (size_t c = 0; c < C.chunks; ++c) {
    const uint64_t stamp = C.shadow[c].tma.load();
    if (stamp != 0 && static_cast<uint32_t>(stamp >> 32) - 1u == slot) C.shadow[c].tma.store(0);
  }
}

// The returned state is the number of the phase the arrival counted towards. `addr` is a
// .shared::cluster address when `cluster` (a remote arrival: the barrier of another block).
inline uint64_t mbarrier_arrive_tx(uint32_t addr, long long count, long long tx,
                                   const char* what, bool cluster = false) {
  uint32_t cta_addr = addr;
  Cta& C = cluster ? cluster_target(addr, cta_addr, what) : *tctx().cta;
  MbarrierLock lock;
  MbarrierState& b = mbarrier_initialized_in(C, cta_addr, what);
  if (tx < 0 || tx > kMbarrierMaxCount) trap_with("%s: tx-count %lld outside [0, 2^20-1]", what, tx);
  if (count < 1 || count > b.pending) {
    trap_with("%s: %lld arrival(s) on the mbarrier at shared 0x%x, whose current phase expects "
              "%d more (of %u): more arrivals than its init count",
              what, count, addr, b.pending, b.expected);
  }
  mbarrier_add_tx(b, tx, addr, what);
  const uint64_t state = b.phase.load();
  if (&C == tctx().cta) {
    hb_release(b.known);
    for (const SeenPhase& s : mbarrier_seen()) merge_seen(b.seen, s.slot, s.completed);
  }
  b.pending -= static_cast<int32_t>(count);
  mbarrier_maybe_complete(b);
  return state;
}

inline uint64_t mbarrier_arrive(uint32_t addr, long long count = 1, bool cluster = false) {
  return mbarrier_arrive_tx(addr, count, 0, "mbarrier.arrive", cluster);
}
inline uint64_t mbarrier_arrive_expect_tx(uint32_t addr, long long tx, bool cluster = false) {
  return mbarrier_arrive_tx(addr, 1, tx, "mbarrier.arrive.expect_tx", cluster);
}

inline void mbarrier_expect_tx(uint32_t addr, long long tx) {
  MbarrierLock lock;
  MbarrierState& b = mbarrier_initialized(addr, "mbarrier.expect_tx");
  if (tx < 0 || tx > kMbarrierMaxCount) {
    trap_with("mbarrier.expect_tx: tx-count %lld outside [0, 2^20-1]", tx);
  }
  mbarrier_add_tx(b, tx, addr, "mbarrier.expect_tx");
}

// A TMA or bulk copy of `bytes` bytes completed on the barrier (lock held by the caller).
inline void mbarrier_complete_tx(MbarrierState& b, uint32_t addr, uint32_t bytes) {
  mbarrier_add_tx(b, -static_cast<int64_t>(bytes), addr, "complete_tx");
  mbarrier_maybe_complete(b);
}

// Whether the phase a wait names has completed: by parity (the phase whose parity is `parity`
// is the current one or the one before it) or by the state an arrive returned.
inline bool mbarrier_done(uint32_t completed, bool by_parity, uint64_t operand) {
  return by_parity ? (completed & 1u) != (operand & 1u) : completed > operand;
}

// try_wait suspends the thread until the phase completes (on the GPU it may also give up after a
// time limit; here it always returns true); test_wait does not wait.
inline bool mbarrier_wait(uint32_t addr, bool by_parity, uint64_t operand, bool blocking,
                          const char* what) {
  uint32_t slot;
  MbarrierState* b;
  {
    MbarrierLock lock;
    b = &mbarrier_initialized(addr, what);
    slot = mbarrier_slot(addr, what);
  }
  for (;;) {
    const uint32_t completed = b->phase.load();
    if (mbarrier_done(completed, by_parity, operand)) {
      mbarrier_observe(*b, slot, completed);
      return true;
    }
    if (!blocking) {
      fiber_poll();  // a spinning test_wait loop lets the other threads run
      return false;
    }
    wait_while(b->phase, completed);
  }
}

// ---- reads of TMA and cp.async destinations ---------------------------------------------------
// Each 16-byte chunk a TMA or bulk copy writes records (mbarrier slot + 1) << 32 | the number of
// the phase its bytes complete on; cp.async copies an mbarrier tracks (cp.async.mbarrier.arrive,
// kg_ptx.h) record the same with kCpAsyncStamp set. A read of the chunk (ldmatrix, wgmma) is
// ordered after the write when the reader saw that phase complete, or learnt of it from a thread
// that did: through a named barrier, an mbarrier phase that thread arrived on, or a
// __syncthreads since. The copy itself happens at issue (TMA) or at the arrive (cp.async), so
// without this check a kernel that forgets its wait would read the right bytes by luck.
constexpr uint32_t kCpAsyncStamp = 1u << 31;

inline void check_tma_read(size_t chunk) {
  const Cta& C = *tctx().cta;
  const uint64_t stamp = C.shadow[chunk].tma.load();
  if (stamp == 0) return;
  const uint32_t slot = static_cast<uint32_t>(stamp >> 32) - 1u;
  const uint32_t phase = static_cast<uint32_t>(stamp) & ~kCpAsyncStamp;
  for (const SeenPhase& s : mbarrier_seen()) {
    if (s.slot == slot && s.completed > phase) return;
  }
  MbarrierState& b = C.mbarriers[slot];
  {
    MbarrierLock lock;
    for (int i = 0; i < 4; ++i) {
      if (b.seen_phase[i] > phase && b.seen_epoch[i] < tctx().epoch) return;
    }
  }
  const uint32_t addr = kSharedBase + static_cast<uint32_t>(chunk * 16);
  report_hazard("shared 0x%x is read before its %s write completed for this thread: wait on the "
                "mbarrier at shared 0x%x for phase %u (parity %u) first",
                addr, (static_cast<uint32_t>(stamp) & kCpAsyncStamp) ? "cp.async" : "TMA",
                mbarrier_address(slot), phase, phase & 1u);
}

// ---- cp.async bytes read by the async proxy ---------------------------------------------------
// cp.async (not .bulk) writes shared memory in the generic proxy (PTX ISA, "Proxies": only the
// .async.bulk operations use the async proxy), and wgmma and TMA stores read it in the async
// proxy, so a fence.proxy.async must come between: executed by a thread that saw the copies'
// phase complete (it then holds their bytes) and ordered before the read (the reader itself, or
// a thread whose later arrival on a barrier the reader acquired).

// fence.proxy.async{.shared::cta} by this thread: the cp.async bytes of the phases it saw
// complete reach the async proxy.
inline void mbarrier_note_proxy_fence() {
  const std::vector<SeenPhase>& seen = mbarrier_seen();
  if (seen.empty()) return;
  const uint64_t point = my_point();
  const uint32_t me = tctx().linear;
  MbarrierLock lock;
  for (const SeenPhase& s : seen) {
    std::vector<std::pair<uint32_t, uint64_t>>& f = tctx().cta->mbarriers[s.slot].fences;
    bool known = false;  // this thread's fence of that phase is recorded already
    for (const auto& e : f) known = known || (e.first == s.completed && PointStamp::of(e.second).thread == me);
    if (!known) f.emplace_back(s.completed, point);
  }
}

// An async-proxy read (wgmma, TMA store) of chunk `chunk`: cp.async bytes need a fence first.
inline void check_cp_async_fenced(size_t chunk, const char* what) {
  const uint64_t stamp = tctx().cta->shadow[chunk].tma.load();
  if ((static_cast<uint32_t>(stamp) & kCpAsyncStamp) == 0) return;
  const uint32_t slot = static_cast<uint32_t>(stamp >> 32) - 1u;
  const uint32_t phase = static_cast<uint32_t>(stamp) & ~kCpAsyncStamp;
  {
    MbarrierLock lock;
    for (const auto& [completed, point] : tctx().cta->mbarriers[slot].fences) {
      if (completed > phase && PointStamp::of(point).before_me()) return;
    }
  }
  report_hazard("%s reads shared 0x%x, which cp.async wrote (mbarrier at shared 0x%x, phase %u): "
                "cp.async writes in the generic proxy, so a thread that saw that phase complete "
                "must execute fence.proxy.async, ordered before the read",
                what, chunk_address(chunk), mbarrier_address(slot), phase);
}

}  // namespace kg_emu

namespace kg_emu::ptx {

inline void mbarrier_init(uint32_t addr, long long count) { ::kg_emu::mbarrier_init(addr, count); }
inline void mbarrier_inval(uint32_t addr) { ::kg_emu::mbarrier_inval(addr); }
// `cluster`: the .shared::cluster form (the address may name another block's barrier).
inline uint64_t mbarrier_arrive(uint32_t addr, long long count = 1, bool cluster = false) {
  return ::kg_emu::mbarrier_arrive(addr, count, cluster);
}
inline uint64_t mbarrier_arrive_expect_tx(uint32_t addr, long long tx, bool cluster = false) {
  return ::kg_emu::mbarrier_arrive_expect_tx(addr, tx, cluster);
}
inline void mbarrier_expect_tx(uint32_t addr, long long tx) {
  ::kg_emu::mbarrier_expect_tx(addr, tx);
}
// Parity: the operand is the phase parity; otherwise the state an arrive returned.
inline bool mbarrier_try_wait(uint32_t addr, bool by_parity, uint64_t operand) {
  return mbarrier_wait(addr, by_parity, operand, true, "mbarrier.try_wait");
}
inline bool mbarrier_test_wait(uint32_t addr, bool by_parity, uint64_t operand) {
  return mbarrier_wait(addr, by_parity, operand, false, "mbarrier.test_wait");
}

}  // namespace kg_emu::ptx

#endif  // KG_MBARRIER_H
