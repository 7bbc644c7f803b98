// The meaning of CUDA's built-ins on a CPU, for the GPU emulator (issue 21).
//
// A kernel compiled with this header runs one block at a time on the calling thread;
// each CUDA thread of the block is a fiber (ucontext) with a stack of its own, so
// `__syncthreads` is a real barrier and a warp of 32 lanes exchanges values through
// `__shfl_xor_sync` and `__ballot_sync` as written. `__shared__` variables are per
// OS thread statics: one block at a time, so one copy per block. Fibers never run
// in parallel: atomics are plain read-modify-writes.
#pragma once
#include <math.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static thread_local

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };

namespace distc_emu {

// Switching fibers: GCC's and Clang's __builtin_setjmp/__builtin_longjmp save and
// restore only the stack and frame pointers and the resume address (the compiler
// spills the rest), with no signal-mask system call, unlike swapcontext. A fiber is
// entered the first time by moving the stack pointer to its stack (x86-64, aarch64);
// elsewhere ucontext does every switch.
#if defined(__x86_64__) || defined(__aarch64__)
#define DISTC_EMU_FAST_SWITCH 1
#else
#define DISTC_EMU_FAST_SWITCH 0
#endif

struct Fiber {
  ucontext_t ctx;
  void* jb[5];
  bool started;
  uint3 tid;
  int state;  // 0 running, 1 at a barrier, 2 at a warp exchange, 3 done
};

struct Block {
  Fiber* fibers;
  unsigned n;
  Fiber* cur;
  ucontext_t sched;
  void* sched_jb[5];
  uint3 bid;
  dim3 bdim;
  dim3 gdim;
  // A warp's exchange slots: what each lane put in, and how many lanes are waiting.
  unsigned long long slots[1024];
  const char* error;
  // A kernel with no barrier, exchange or shared memory runs as a plain loop over its
  // threads (no fibers); reaching a barrier then is a mistake of that analysis.
  bool plain;
};

inline thread_local Block* block = nullptr;

inline Fiber* self() { return block->cur; }

// A separate function: __builtin_longjmp may not share one with __builtin_setjmp.
[[gnu::noinline]] inline void jump(void** to) { __builtin_longjmp(to, 1); }

// Back to the scheduler until it resumes this fiber.
inline void yield_with(int state) {
  if (block->plain) {
    block->error = "a barrier or warp exchange in a kernel run as a plain loop (the emulator judged it barrier-free)";
    return;
  }
  Fiber* f = self();
  f->state = state;
#if DISTC_EMU_FAST_SWITCH
  if (__builtin_setjmp(f->jb) == 0) jump(block->sched_jb);
#else
  swapcontext(&f->ctx, &block->sched);
#endif
}

}  // namespace distc_emu

#define threadIdx (distc_emu::self()->tid)
#define blockIdx (distc_emu::block->bid)
#define blockDim (distc_emu::block->bdim)
#define gridDim (distc_emu::block->gdim)

inline void __syncthreads() { distc_emu::yield_with(1); }

// Every lane of the warp deposits `v`, waits for the others, reads lane `src`'s, and
// waits again so the slots are free for the next exchange.
template <typename T>
inline T distc_emu_exchange(T v, unsigned src_lane) {
  using namespace distc_emu;
  unsigned t = self()->tid.x;
  unsigned base = t & ~31u;
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  block->slots[t] = bits;
  yield_with(2);
  unsigned long long got = block->slots[base + (src_lane & 31u)];
  yield_with(2);
  T out;
  std::memcpy(&out, &got, sizeof(T));
  return out;
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  return distc_emu_exchange(v, (threadIdx.x & 31u) ^ (unsigned)lane_mask);
}

inline unsigned __ballot_sync(unsigned, int pred) {
  using namespace distc_emu;
  unsigned t = self()->tid.x;
  unsigned base = t & ~31u;
  block->slots[t] = pred ? 1 : 0;
  yield_with(2);
  unsigned out = 0;
  for (unsigned l = 0; l < 32; ++l) {
    if (base + l < block->n && block->slots[base + l]) out |= 1u << l;
  }
  yield_with(2);
  return out;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }

// The generated prelude's 16-bit conversions (its `widen` and `narrow`), with the
// rounding the GPU's cvt.rn gives: bf16 by its bits, f16 through the compiler's own
// IEEE _Float16.
#define DISTC_EMULATED 1
namespace distc_emu {
inline float bf16_to_f32(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
inline unsigned short f32_to_bf16(float v) {
    unsigned x;
    std::memcpy(&x, &v, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float f16_to_f32(unsigned short b) {
    _Float16 h;
    std::memcpy(&h, &b, 2);
    return (float)h;
}
inline unsigned short f32_to_f16(float v) {
    _Float16 h = (_Float16)v;
    unsigned short b;
    std::memcpy(&b, &h, 2);
    return b;
}
}  // namespace distc_emu

template <typename T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <typename T> inline T atomicMin(T* p, T v) { T old = *p; if (v < old) *p = v; return old; }
template <typename T> inline T atomicMax(T* p, T v) { T old = *p; if (v > old) *p = v; return old; }
template <typename T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }

namespace distc_emu {

template <typename... A>
constexpr std::size_t arity(void (*)(A...)) { return sizeof...(A); }

template <typename... A, std::size_t... I>
inline void call_with(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(*static_cast<A*>(args[I])...);
}

// The fiber entry: makecontext passes ints, so the kernel call goes through globals.
inline thread_local void (*entry)(void*) = nullptr;
inline thread_local void* entry_arg = nullptr;
inline void fiber_main() {
  entry(entry_arg);
  block->cur->state = 3;
#if DISTC_EMU_FAST_SWITCH
  jump(block->sched_jb);
#endif
}

#if DISTC_EMU_FAST_SWITCH
// Runs fiber_main on the stack ending at `top` (16-byte aligned); it never returns
// here: the fiber ends by jumping back to the scheduler.
[[gnu::noinline]] inline void enter(char* top) {
#if defined(__x86_64__)
  asm volatile("mov %0, %%rsp\n\tcall *%1\n\t" ::"r"(top), "r"(&fiber_main) : "memory");
#else
  asm volatile("mov sp, %0\n\tblr %1\n\t" ::"r"(top), "r"(&fiber_main) : "memory", "x30");
#endif
  __builtin_unreachable();
}
#endif

constexpr std::size_t STACK = 64 * 1024;

// Runs one block of `n` threads to completion: every fiber runs until it reaches a
// barrier, an exchange or its end; when all are stopped, those waiting go on. A
// barrier some threads reach while others wait at an exchange (or have ended while
// others wait) is the divergence a GPU would hang or misbehave on: reported.
inline const char* run_block(Block& b, char* stacks, void (*fn)(void*), void* arg) {
  block = &b;
  entry = fn;
  entry_arg = arg;
  for (unsigned i = 0; i < b.n; ++i) {
    Fiber& f = b.fibers[i];
    f.state = 0;
    f.tid = uint3{i % b.bdim.x, (i / b.bdim.x) % b.bdim.y, i / (b.bdim.x * b.bdim.y)};
    f.started = false;
#if !DISTC_EMU_FAST_SWITCH
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = stacks + i * STACK;
    f.ctx.uc_stack.ss_size = STACK;
    f.ctx.uc_link = &b.sched;
    makecontext(&f.ctx, fiber_main, 0);
#endif
  }
  for (;;) {
    unsigned at_barrier = 0, at_exchange = 0, done = 0;
    for (unsigned i = 0; i < b.n; ++i) {
      Fiber& f = b.fibers[i];
      if (f.state == 0) {
        b.cur = &f;
#if DISTC_EMU_FAST_SWITCH
        if (__builtin_setjmp(b.sched_jb) == 0) {
          if (!f.started) {
            f.started = true;
            char* top = stacks + (i + 1) * STACK;
            enter(reinterpret_cast<char*>(reinterpret_cast<std::uintptr_t>(top) & ~std::uintptr_t(15)));
          }
          jump(f.jb);
        }
#else
        swapcontext(&b.sched, &f.ctx);
#endif
      }
      at_barrier += f.state == 1;
      at_exchange += f.state == 2;
      done += f.state == 3;
    }
    if (done == b.n) return nullptr;
    if (at_exchange > 0) {
      // A warp exchange goes on when every lane of the warp that has not ended is in
      // it; lanes of one warp never wait on a block barrier meanwhile.
      for (unsigned w = 0; w < b.n; w += 32) {
        unsigned in = 0, live = 0;
        for (unsigned l = w; l < w + 32 && l < b.n; ++l) {
          in += b.fibers[l].state == 2;
          live += b.fibers[l].state != 3;
        }
        if (in > 0 && in != live) return "a warp exchange (__shfl_xor_sync/__ballot_sync) that not every live lane of the warp reached";
        if (in > 0)
          for (unsigned l = w; l < w + 32 && l < b.n; ++l)
            if (b.fibers[l].state == 2) b.fibers[l].state = 0;
      }
      continue;
    }
    if (at_barrier + done == b.n) {
      for (unsigned i = 0; i < b.n; ++i)
        if (b.fibers[i].state == 1) b.fibers[i].state = 0;
      continue;
    }
    return "the block's threads stopped at different barriers";
  }
}

}  // namespace distc_emu

// One exported launcher per kernel: `distc_emu_launch_NAME(grid, block, args)` runs
// every block of the grid; returns null, or what went wrong.
// `RUN` is `launch` (fibers) or `launch_plain` (a loop over the threads).
#define DISTC_EMU_EXPORT_WITH(K, RUN)                                                    \
  static void distc_emu_thunk_##K(void* args) {                                         \
    distc_emu::call_with(K, static_cast<void**>(args),                                 \
                         std::make_index_sequence<distc_emu::arity(K)>{});              \
  }                                                                                      \
  extern "C" const char* distc_emu_launch_##K(const unsigned* grid, const unsigned* blk, \
                                               void** args) {                           \
    return distc_emu::RUN(grid, blk, args, distc_emu_thunk_##K);                        \
  }
#define DISTC_EMU_EXPORT(K) DISTC_EMU_EXPORT_WITH(K, launch)
#define DISTC_EMU_EXPORT_PLAIN(K) DISTC_EMU_EXPORT_WITH(K, launch_plain)

namespace distc_emu {
// Every block of the grid, one after another, on this thread.
inline const char* launch(const unsigned* grid, const unsigned* blk, void** args,
                          void (*thunk)(void*)) {
  thread_local std::vector<char> stacks;
  thread_local std::vector<Fiber> fibers;
  Block b{};
  b.bdim = dim3{blk[0], blk[1], blk[2]};
  b.gdim = dim3{grid[0], grid[1], grid[2]};
  b.n = blk[0] * blk[1] * blk[2];
  if (b.n == 0 || b.n > 1024) return "a block of 0 or more than 1024 threads";
  if (stacks.size() < b.n * STACK) stacks.resize(b.n * STACK);
  if (fibers.size() < b.n) fibers.resize(b.n);
  b.fibers = fibers.data();
  for (unsigned z = 0; z < grid[2]; ++z)
    for (unsigned y = 0; y < grid[1]; ++y)
      for (unsigned x = 0; x < grid[0]; ++x) {
        b.bid = uint3{x, y, z};
        const char* e = run_block(b, stacks.data(), thunk, args);
        if (e) return e;
      }
  return nullptr;
}

// A barrier-free kernel: every thread of every block in turn, as plain calls.
inline const char* launch_plain(const unsigned* grid, const unsigned* blk, void** args,
                                void (*thunk)(void*)) {
  Fiber f{};
  Block b{};
  b.bdim = dim3{blk[0], blk[1], blk[2]};
  b.gdim = dim3{grid[0], grid[1], grid[2]};
  b.n = blk[0] * blk[1] * blk[2];
  if (b.n == 0 || b.n > 1024) return "a block of 0 or more than 1024 threads";
  b.cur = &f;
  b.plain = true;
  block = &b;
  for (unsigned z = 0; z < grid[2]; ++z)
    for (unsigned y = 0; y < grid[1]; ++y)
      for (unsigned x = 0; x < grid[0]; ++x) {
        b.bid = uint3{x, y, z};
        for (unsigned i = 0; i < b.n; ++i) {
          f.tid = uint3{i % b.bdim.x, (i / b.bdim.x) % b.bdim.y, i / (b.bdim.x * b.bdim.y)};
          thunk(args);
          if (b.error) return b.error;
        }
      }
  return nullptr;
}
}  // namespace distc_emu

