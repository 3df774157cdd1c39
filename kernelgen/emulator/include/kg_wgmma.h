// kg_wgmma.h -- warpgroup matrix multiply-accumulate of the CPU emulator (PTX ISA "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate Instructions"): wgmma.mma_async m64nNk16 with f32
// accumulators and f16/bf16 inputs, A from a shared-memory descriptor or from registers, B from a
// descriptor; wgmma.fence, wgmma.commit_group, wgmma.wait_group. Included by kg_ptx.h.
//
// A warpgroup is 4 consecutive warps (threads 128i..128i+127). Warp w of it owns rows 16w..16w+15
// of D (64xN); with g = lane / 4 and q = lane % 4, register d[4j + i] holds
//   D[16w + g + 8 (i / 2)][8j + 2q + i % 2]        (j = 0..N/8-1, i = 0..3)
// and the register-A fragment is mma.sync m16n8k16's A fragment of the warp's 16 rows.
//
// Asynchrony: the product is computed at issue (from the operands as they are then) and held
// back; the accumulator registers get a NaN poison until the wgmma.wait_group that retires the
// group writes the results. At retire the operands are read again and must be the same bits
// (else the operand shared memory changed while the wgmma was in flight), the accumulators must still
// hold the poison (else a thread wrote them) and register-A variables their values at issue.
#ifndef KG_WGMMA_H
#define KG_WGMMA_H

#include <deque>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kg_emu::ptx {

constexpr uint32_t kWgmmaPoison = 0x7FC0DEADu;     // a quiet NaN (f32 accumulators)
constexpr uint32_t kWgmmaPoisonF16 = 0x7E2D7E2Du;  // two quiet NaNs (f16x2 accumulators)

// Operand element types: 16-bit ones for k16, 8-bit ones (fp8) for k32.
enum class WElem : int { f16, bf16, e4m3, e5m2 };
constexpr uint32_t welem_bytes(WElem e) { return e == WElem::f16 || e == WElem::bf16 ? 2 : 1; }
inline double welem_value(WElem e, uint32_t bits) {
  switch (e) {
    case WElem::f16: return static_cast<double>(half_bits_to_float(static_cast<uint16_t>(bits)));
    case WElem::bf16: return static_cast<double>(bf16_bits_to_float(static_cast<uint16_t>(bits)));
    case WElem::e4m3: return fp8_bits_to_double(static_cast<uint8_t>(bits), false);
    default: return fp8_bits_to_double(static_cast<uint8_t>(bits), true);
  }
}

// The fields of a shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format").
struct MatrixDescriptor {
  uint32_t start, leading, stride, base_offset, span;  // bytes; span: swizzle bytes (0: none)
  static MatrixDescriptor of(uint64_t d) {
    static constexpr uint32_t kSpan[4] = {0, 128, 64, 32};  // bits 62-63: none, 128B, 64B, 32B
    return MatrixDescriptor{static_cast<uint32_t>(d & 0x3FFF) << 4,
                            static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
                            static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4,
                            static_cast<uint32_t>((d >> 49) & 0x7), kSpan[d >> 62]};
  }
};

// Shared address of 16-bit element (mn, k) of an operand (A: mn = row m; B: mn = column n) under
// the PTX ISA's canonical layouts, T = 8 elements (16 bytes), W = the swizzle span in bytes:
//   K-major  none: ((8,m),(T,2k)):((1T,SBO),(1,LBO))     swizzled: ((8,m),(T,2k)):((W/2,SBO),(1,T))
//   MN-major none: ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))  swizzled: ((T,W/16,m),(8,k)):((1,T,LBO),(W/2,SBO))
// (strides in elements, SBO/LBO in bytes), then the swizzle of the address (kg_tma.h). 8-bit
// elements (K-major only) have the same layouts in bytes: a core-matrix row of 16 bytes holds
// T = 16 elements, and a k32 step spans two of them.
inline uint32_t operand_address(const MatrixDescriptor& d, bool mn_major, uint32_t mn, uint32_t k,
                                uint32_t esz = 2) {
  uint32_t off;
  if (!mn_major) {
    const uint32_t kb = k * esz;  // the element's byte within its row
    off = d.span == 0 ? (mn % 8) * 16 + (mn / 8) * d.stride + kb % 16 + (kb / 16) * d.leading
                      : (mn % 8) * d.span + (mn / 8) * d.stride + kb;
  } else if (d.span == 0) {
    off = (mn % 8) * 2 + (mn / 8) * d.stride + (k % 8) * 16 + (k / 8) * d.leading;
  } else {
    const uint32_t per_row = d.span / 2;  // elements of a swizzle-atom row
    off = (mn % per_row) * 2 + (mn / per_row) * d.leading + (k % 8) * d.span + (k / 8) * d.stride;
  }
  return swizzle_address(d.start + off, d.span, d.base_offset);
}

struct WgmmaOp {
  uint64_t id;
  int n;                   // N
  WElem ta, tb;            // element types of A and B
  bool acc_f16, rs, scale_d;  // f16 accumulators (else f32), A from registers, accumulate
  int scale_a, scale_b, trans_a, trans_b;
  uint64_t desc_a, desc_b;
  double a[2][32];         // rows g and g + 8 of A (register A), scale applied at compute
  uint32_t c[128], result[128];  // accumulator register bits: input C, result D
  uint64_t read_hash;      // of the shared-memory bits the thread read at issue
  uint32_t* d[128];        // the accumulator variables
  std::vector<std::pair<const uint32_t*, uint32_t>> a_vars;  // register-A variables, values
  int k() const { return welem_bytes(ta) == 2 ? 16 : 32; }
  int nregs() const { return acc_f16 ? n / 4 : n / 2; }
  uint32_t poison() const { return acc_f16 ? kWgmmaPoisonF16 : kWgmmaPoison; }
};

struct WgmmaThreadState {
  std::vector<WgmmaOp> current;                 // issued since the last commit_group
  std::deque<std::vector<WgmmaOp>> committed;   // oldest first
  // Accumulator variables of wgmmas in flight: the latest wgmma writing each, and its result
  // bits (the C input of a wgmma chained on the same accumulator).
  std::unordered_map<uint32_t*, std::pair<uint64_t, uint32_t>> in_flight;
  bool fenced = false;
  uint64_t next_id = 0;
  uint64_t issued = 0;   // wgmmas this thread issued in this block
  uint64_t commits = 0;  // commit_groups it executed
  void clear() {
    current.clear();
    committed.clear();
    in_flight.clear();
    fenced = false;
    issued = commits = 0;
  }
};
inline WgmmaThreadState& wgmma_state() { return fiber_local<WgmmaThreadState, kLocalWgmma>(); }

// Element x (the f32 fragment's numbering, d[x]) of accumulator registers `regs`: a float, or
// with f16 accumulators half x % 2 of register x / 2 (the pair of adjacent columns).
inline double accumulator_element(const WgmmaOp& op, const uint32_t* regs, int x) {
  if (!op.acc_f16) return static_cast<double>(f32_from_bits(regs[x]));
  return static_cast<double>(half_bits_to_float(static_cast<uint16_t>(regs[x / 2] >> (16 * (x % 2)))));
}

// The thread's D registers of `op`; `check_reads`: the race checks of the shared reads (at
// issue). Returns a hash (FNV-1a) of the shared-memory bits it read, in order.
inline uint64_t wgmma_compute(const WgmmaOp& op, uint32_t* out, bool check_reads) {
  uint64_t hash = 0xcbf29ce484222325ull;
  const uint32_t lane = tctx().lane, w = (tctx().linear / 32) % 4;
  const uint32_t g = lane / 4, q = lane % 4;
  const MatrixDescriptor da = MatrixDescriptor::of(op.desc_a), db = MatrixDescriptor::of(op.desc_b);
  const int K = op.k();
  size_t last_chunk = SIZE_MAX;
  auto load = [&](uint32_t addr, WElem type, const char* what) {
    const uint32_t esz = welem_bytes(type);
    const unsigned char* p = shared_bytes(addr, esz, esz, what);
    if (check_reads && chunk_of(p) != last_chunk) {
      last_chunk = chunk_of(p);
      check_tma_read(last_chunk);
      check_cp_async_fenced(last_chunk, "wgmma");
      note_shared_read(p, false);
    }
    uint16_t bits = 0;
    std::memcpy(&bits, p, esz);
    hash = (hash ^ bits) * 0x100000001b3ull;
    return welem_value(type, bits);
  };
  const uint32_t ea = welem_bytes(op.ta), eb = welem_bytes(op.tb);
  double a[2][32];
  for (int r = 0; r < 2; ++r) {
    for (int k = 0; k < K; ++k) {
      a[r][k] = op.rs ? op.a[r][k]
                      : load(operand_address(da, op.trans_a, 16 * w + g + 8 * r, k, ea), op.ta,
                             "wgmma A");
      a[r][k] *= op.scale_a;
    }
  }
  double d[128];
  for (int j = 0; j < op.n / 8; ++j) {
    for (uint32_t i = 0; i < 2; ++i) {
      const uint32_t col = 8 * j + 2 * q + i;
      double b[32];
      for (int k = 0; k < K; ++k) {
        b[k] = op.scale_b * load(operand_address(db, op.trans_b, col, k, eb), op.tb, "wgmma B");
      }
      for (int r = 0; r < 2; ++r) {
        double s = 0.0;
        for (int k = 0; k < K; ++k) s += a[r][k] * b[k];
        const int reg = 4 * j + 2 * r + static_cast<int>(i);
        d[reg] = s + (op.scale_d ? accumulator_element(op, op.c, reg) : 0.0);
      }
    }
  }
  for (int x = 0; x < op.n / 2; ++x) {
    if (!op.acc_f16) {
      out[x] = ::kg_emu::f32_bits(static_cast<float>(d[x]));
    } else if (x % 2 == 0) {
      out[x / 2] = static_cast<uint32_t>(double_to_half_bits(d[x])) |
                   static_cast<uint32_t>(double_to_half_bits(d[x + 1])) << 16;
    }
  }
  return hash;
}

inline void wgmma_check_operands(int scale_a, int scale_b, int trans_a, int trans_b) {
  if ((scale_a != 1 && scale_a != -1) || (scale_b != 1 && scale_b != -1)) {
    trap_with("wgmma.mma_async: imm-scale-a/b are %d/%d; allowed 1 or -1", scale_a, scale_b);
  }
  if ((trans_a != 0 && trans_a != 1) || (trans_b != 0 && trans_b != 1)) {
    trap_with("wgmma.mma_async: imm-trans-a/b are %d/%d; allowed 0 or 1", trans_a, trans_b);
  }
}

// The PTX ISA: all threads of the warpgroup execute the same wgmma, with the same descriptors.
// The first thread to issue its warpgroup's wgmma number k records it; the others compare.
inline void check_warpgroup_issue(const WgmmaOp& op, uint64_t number) {
  const uint64_t shape = static_cast<uint64_t>(op.n) | static_cast<uint64_t>(op.rs) << 9 |
                         static_cast<uint64_t>(op.ta) << 10 |
                         static_cast<uint64_t>(op.trans_a) << 12 |
                         static_cast<uint64_t>(op.trans_b) << 13 |
                         static_cast<uint64_t>(op.scale_a + 1) << 14 |
                         static_cast<uint64_t>(op.scale_b + 1) << 16 |
                         static_cast<uint64_t>(op.scale_d) << 18 |
                         static_cast<uint64_t>(op.tb) << 19 |
                         static_cast<uint64_t>(op.acc_f16) << 21;
  const uint64_t desc_a = op.rs ? 0 : op.desc_a;
  const uint32_t wg = tctx().linear / 128;
  MbarrierLock lock;
  WarpgroupIssue& e = tctx().cta->warpgroup_issues[wg * kWarpgroupIssueRing +
                                                 number % kWarpgroupIssueRing];
  if (e.number_plus_1 < number + 1) {
    e = WarpgroupIssue{number + 1, desc_a, op.desc_b, shape, tctx().linear};
  } else if (e.number_plus_1 == number + 1 &&
             (e.desc_a != desc_a || e.desc_b != op.desc_b || e.shape != shape)) {
    report_error("wgmma.mma_async #%llu of warpgroup %u differs between threads %u and %u "
                 "(descriptors A 0x%llx / 0x%llx, B 0x%llx / 0x%llx, or shape, scale-d, "
                 "scales, transposes): all threads of a warpgroup must issue the same wgmma",
                 static_cast<unsigned long long>(number), wg, e.thread, tctx().linear,
                 static_cast<unsigned long long>(e.desc_a),
                 static_cast<unsigned long long>(desc_a),
                 static_cast<unsigned long long>(e.desc_b),
                 static_cast<unsigned long long>(op.desc_b));
  }  // else: this thread lags the ring's length behind, the record is gone
}

inline void wgmma_issue(WgmmaOp& op, uint32_t* const* regs) {
  WgmmaThreadState& s = wgmma_state();
  if (tctx().linear / 128 * 128 + 128 > tctx().launch->nthreads) {
    trap_with("wgmma.mma_async by thread %u: its warpgroup (threads %u..%u) is not complete in a "
              "block of %u threads", tctx().linear, tctx().linear / 128 * 128,
              tctx().linear / 128 * 128 + 127, tctx().launch->nthreads);
  }
  if (!s.fenced) {
    report_hazard("wgmma.mma_async without a wgmma.fence since the thread's last "
                  "wgmma.wait_group (or the kernel start): its register accesses are unordered");
  }
  check_warpgroup_issue(op, s.issued++);
  op.id = s.next_id++;
  const int nregs = op.nregs();
  for (int r = 0; r < nregs; ++r) {
    op.d[r] = regs[r];
    auto it = s.in_flight.find(regs[r]);
    if (it != s.in_flight.end()) {  // chained on an accumulator in flight
      if (*regs[r] != op.poison()) {
        report_hazard("accumulator d%d of a wgmma in flight was written before the "
                      "wgmma.wait_group that retires it", r);
      }
      op.c[r] = it->second.second;
    } else {
      op.c[r] = *regs[r];
    }
  }
  op.read_hash = wgmma_compute(op, op.result, true);
  for (int r = 0; r < nregs; ++r) {
    *regs[r] = op.poison();
    s.in_flight[regs[r]] = {op.id, op.result[r]};
  }
  if (tctx().linear % 128 == 0) tctx().stats[kWgmma] += 1;
  s.current.push_back(std::move(op));
}

inline void wgmma_retire(WgmmaOp& op) {
  WgmmaThreadState& s = wgmma_state();
  uint32_t again[128];
  const int nregs = op.nregs();
  if (wgmma_compute(op, again, false) != op.read_hash) {
    const MatrixDescriptor da = MatrixDescriptor::of(op.desc_a);
    const MatrixDescriptor db = MatrixDescriptor::of(op.desc_b);
    report_hazard("shared memory a wgmma reads (A at 0x%x%s, B at 0x%x) changed between its issue "
                  "and the wgmma.wait_group that retires it", da.start,
                  op.rs ? " unused: A in registers" : "", db.start);
  }
  for (const auto& [var, value] : op.a_vars) {
    if (*var != value) {
      report_hazard("a register-A operand of a wgmma in flight was overwritten before the "
                    "wgmma.wait_group that retires it");
    }
  }
  for (int r = 0; r < nregs; ++r) {
    if (*op.d[r] != op.poison()) {
      report_hazard("accumulator d%d of a wgmma in flight was written before the "
                    "wgmma.wait_group that retires it", r);
    }
    auto it = s.in_flight.find(op.d[r]);
    if (it != s.in_flight.end() && it->second.first == op.id) {
      *op.d[r] = op.result[r];
      s.in_flight.erase(it);
    }
  }
}

template <class D>
inline uint32_t* accumulator_ptr(D& d) {
  static_assert(sizeof(D) == 4 && std::is_trivially_copyable_v<D>,
                "wgmma accumulator type (a 32-bit register: f32, or f16x2)");
  return reinterpret_cast<uint32_t*>(&d);
}

inline void wgmma_init(WgmmaOp& op, WElem ta, WElem tb, bool acc_f16, int n, bool scale_d,
                       int scale_a, int scale_b, int trans_a, int trans_b, uint64_t desc_a,
                       uint64_t desc_b, bool rs) {
  wgmma_check_operands(scale_a, scale_b, trans_a, trans_b);
  op.n = n;
  op.ta = ta;
  op.tb = tb;
  op.acc_f16 = acc_f16;
  op.rs = rs;
  op.scale_d = scale_d;
  op.scale_a = scale_a;
  op.scale_b = scale_b;
  op.trans_a = trans_a;
  op.trans_b = trans_b;
  op.desc_a = desc_a;
  op.desc_b = desc_b;
}

template <WElem TA, WElem TB, int N, bool AccF16, class... D>
constexpr void wgmma_static_checks() {
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma m64nNkK: N a multiple of 8 up to 256");
  static_assert(sizeof...(D) == (AccF16 ? N / 4 : N / 2),
                "wgmma m64nNkK: N/2 f32 (N/4 f16x2) accumulator registers");
  static_assert(welem_bytes(TA) == welem_bytes(TB), "wgmma: A and B of the same width");
}

// wgmma.mma_async.sync.aligned.m64n<N>k<K>.<D>.<TA>.<TB> {d...}, a-desc, b-desc, scale-d,
//   imm-scale-a, imm-scale-b{, imm-trans-a, imm-trans-b} (K 16: 16-bit types, 32: fp8)
template <WElem TA, WElem TB, int N, bool AccF16, class... D>
inline void wgmma_ss(uint64_t desc_a, uint64_t desc_b, bool scale_d, int scale_a, int scale_b,
                     int trans_a, int trans_b, D&... d) {
  wgmma_static_checks<TA, TB, N, AccF16, D...>();
  WgmmaOp op;
  wgmma_init(op, TA, TB, AccF16, N, scale_d, scale_a, scale_b, trans_a, trans_b, desc_a, desc_b,
             false);
  uint32_t* regs[] = {accumulator_ptr(d)...};
  wgmma_issue(op, regs);
}
// The 16-bit forms with f32 accumulators, as before fp8.
template <Elem E, int N, class... D>
inline void wgmma_ss(uint64_t desc_a, uint64_t desc_b, bool scale_d, int scale_a, int scale_b,
                     int trans_a, int trans_b, D&... d) {
  constexpr WElem T = E == Elem::f16 ? WElem::f16 : WElem::bf16;
  wgmma_ss<T, T, N, false>(desc_a, desc_b, scale_d, scale_a, scale_b, trans_a, trans_b, d...);
}

template <class V>
inline uint32_t register_a(V&& v, WgmmaOp& op) {
  const uint32_t bits = b32(v);
  if constexpr (std::is_lvalue_reference_v<V> && sizeof(std::remove_reference_t<V>) == 4) {
    op.a_vars.emplace_back(reinterpret_cast<const uint32_t*>(&v), bits);
  }
  return bits;
}

// wgmma.mma_async.sync.aligned.m64n<N>k<K>.<D>.<TA>.<TB> {d...}, {a0, a1, a2, a3}, b-desc,
//   scale-d, imm-scale-a, imm-scale-b{, imm-trans-b}
template <WElem TA, WElem TB, int N, bool AccF16, class A0, class A1, class A2, class A3,
          class... D>
inline void wgmma_rs(A0&& a0, A1&& a1, A2&& a2, A3&& a3, uint64_t desc_b, bool scale_d,
                     int scale_a, int scale_b, int trans_b, D&... d) {
  wgmma_static_checks<TA, TB, N, AccF16, D...>();
  WgmmaOp op;
  wgmma_init(op, TA, TB, AccF16, N, scale_d, scale_a, scale_b, 0, trans_b, 0, desc_b, true);
  const uint32_t mine[4] = {register_a(static_cast<A0&&>(a0), op),
                            register_a(static_cast<A1&&>(a1), op),
                            register_a(static_cast<A2&&>(a2), op),
                            register_a(static_cast<A3&&>(a3), op)};
  // The warp's 16 rows of A come from its own lanes: exchange like mma.sync.
  ThreadCtx& c = tctx();
  Warp& w = *c.warp;
  uint32_t(*frags)[6] = w.frags[c.parity];
  c.parity ^= 1u;
  std::memcpy(frags[c.lane], mine, sizeof mine);
  w.bar.arrive_and_wait();
  const uint32_t g = c.lane / 4;
  for (uint32_t r = 0; r < 2; ++r) {
    const uint32_t row = g + 8 * r;
    if constexpr (welem_bytes(TA) == 2) {
      for (uint32_t k = 0; k < 16; ++k) {
        const uint32_t reg = frags[4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
        op.a[r][k] = welem_value(TA, k & 1 ? reg >> 16 : reg & 0xFFFFu);
      }
    } else {
      // 8-bit A: each register holds 4 consecutive k of a row, the lower k in the lower byte;
      // the same pattern in bytes (a0 rows 0-7 and bytes 0-15 of k, a1 rows 8-15, a2 bytes
      // 16-31, a3 both).
      for (uint32_t k = 0; k < 32; ++k) {
        const uint32_t reg = frags[4 * (row % 8) + (k % 16) / 4][(row >= 8) + 2 * (k >= 16)];
        op.a[r][k] = welem_value(TA, (reg >> (8 * (k % 4))) & 0xFFu);
      }
    }
  }
  uint32_t* regs[] = {accumulator_ptr(d)...};
  wgmma_issue(op, regs);
}
template <Elem E, int N, class A0, class A1, class A2, class A3, class... D>
inline void wgmma_rs(A0&& a0, A1&& a1, A2&& a2, A3&& a3, uint64_t desc_b, bool scale_d,
                     int scale_a, int scale_b, int trans_b, D&... d) {
  constexpr WElem T = E == Elem::f16 ? WElem::f16 : WElem::bf16;
  wgmma_rs<T, T, N, false>(static_cast<A0&&>(a0), static_cast<A1&&>(a1), static_cast<A2&&>(a2),
                           static_cast<A3&&>(a3), desc_b, scale_d, scale_a, scale_b, trans_b,
                           d...);
}

inline void wgmma_fence() {
  wgmma_state().fenced = true;
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

// ---- warpgroup-collective commit and wait ----------------------------------------------------
// wgmma.commit_group and wgmma.wait_group are .sync.aligned: the four warps of a warpgroup execute
// each one together, so a wgmma is a warpgroup-wide operation, issued and retired at once. The
// emulator's threads meet at every commit_group and wait_group of their warpgroup (a barrier of
// its 128 threads): after a commit_group every thread has issued (and read the operands of) the
// group's wgmmas; no thread leaves a wait_group before every thread retired its share. So one
// elected thread may free a pipeline stage right after the wait (CUTLASS's PipelineTmaAsync),
// while a stage freed before the wait is still caught (its operands change under the wgmma).
// At each meeting the threads compare where they are; a thread at another commit_group or
// wait_group (one that skipped a wait, say) is a hazard.
enum : uint32_t { kRendezvousCommit = 1, kRendezvousWait = 2 };

// The thread's warpgroup, or nullptr when the block does not hold it whole.
inline Warpgroup* my_warpgroup() {
  const uint32_t wg = tctx().linear / 128;
  return wg < tctx().launch->nwarpgroups ? &tctx().cta->warpgroups[wg] : nullptr;
}

inline void warpgroup_rendezvous(Warpgroup& g, uint32_t kind, uint32_t wait_n) {
  const WgmmaThreadState& s = wgmma_state();
  WarpgroupSlot* slots = g.slots[tctx().wg_parity];
  tctx().wg_parity ^= 1u;
  WarpgroupSlot& mine = slots[tctx().linear % 128];
  mine.wait_n = wait_n;
  mine.issued = s.issued;
  mine.commits = s.commits;
  mine.kind.store(kind);
  g.bar.arrive_and_wait();
  static constexpr const char* kName[3] = {"", "wgmma.commit_group", "wgmma.wait_group"};
  for (uint32_t i = 0; i < 128; ++i) {
    const WarpgroupSlot& other = slots[i];
    const uint32_t other_kind = other.kind.load();
    if (other_kind == 0 || i == tctx().linear % 128) continue;
    if (other_kind == kind && other.issued == mine.issued && other.commits == mine.commits &&
        (kind != kRendezvousWait || other.wait_n == wait_n)) {
      continue;
    }
    const uint32_t base = tctx().linear / 128 * 128;
    report_hazard("threads %u and %u of warpgroup %u are at different warpgroup-collective "
                  "instructions (%s %u after %llu wgmmas and %llu commit_groups; %s %u after "
                  "%llu and %llu): every thread of the warpgroup executes each wgmma, "
                  "commit_group and wait_group", tctx().linear, base + i, tctx().linear / 128,
                  kName[kind], wait_n, static_cast<unsigned long long>(mine.issued),
                  static_cast<unsigned long long>(mine.commits), kName[other_kind],
                  other.wait_n, static_cast<unsigned long long>(other.issued),
                  static_cast<unsigned long long>(other.commits));
    throw Trap{};  // the threads are out of step: any later meeting would pair them wrongly
  }
}

inline void wgmma_commit_group() {
  WgmmaThreadState& s = wgmma_state();
  s.committed.push_back(std::move(s.current));
  s.current.clear();
  ++s.commits;
  if (Warpgroup* g = my_warpgroup()) warpgroup_rendezvous(*g, kRendezvousCommit, 0);
}

inline void wgmma_wait_group(long long n) {
  if (n < 0) trap_with("wgmma.wait_group %lld: negative count", n);
  WgmmaThreadState& s = wgmma_state();
  Warpgroup* g = my_warpgroup();
  if (g != nullptr) warpgroup_rendezvous(*g, kRendezvousWait, static_cast<uint32_t>(n));
  while (static_cast<long long>(s.committed.size()) > n) {
    for (WgmmaOp& op : s.committed.front()) wgmma_retire(op);
    s.committed.pop_front();
  }
  if (g != nullptr) g->bar.arrive_and_wait();  // every share retired before anyone goes on
  s.fenced = false;
}

}  // namespace kg_emu::ptx

namespace kg_emu {

inline void async_thread_begin() {
  ptx::wgmma_state().clear();
  mbarrier_seen().clear();
  bulk_groups().clear();
  unfenced_chunks().clear();
  cluster_thread_begin();
}

inline void async_thread_end() {
  ptx::WgmmaThreadState& s = ptx::wgmma_state();
  size_t pending = s.current.size();
  for (const auto& group : s.committed) pending += group.size();
  if (pending != 0) {
    report_hazard("the thread leaves the kernel with %zu wgmma.mma_async not retired by a "
                  "wgmma.wait_group (their results never reach the accumulators)", pending);
  }
  bulk_thread_end();
}

// Leaving the kernel, also after a trap: no longer expected at barrier.cluster.
inline void async_thread_exit() {
  bulk_groups().clear();
  cluster_thread_exit();
}

}  // namespace kg_emu

#endif  // KG_WGMMA_H
