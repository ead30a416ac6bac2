// The emulated GPU: every thread of every block a fiber (ucontext), run one at a time in a chosen
// order (ascending, descending or seeded random thread index) from one barrier to the next.
//
// - __syncthreads releases a block when all its threads wait at the same one; the grid barrier
//   releases when every thread waits there; a warp exchange (shuffle, vote) when every lane of
//   its mask has deposited. A barrier that not every thread can reach is reported, naming the
//   kernel, block and threads, instead of hanging.
// - Shared memory is the module's thread-local block (souffle_emulated.h makes __shared__
//   thread_local); the scheduler keeps one copy per block and swaps it in when it switches block.
//   Every copy starts poisoned (0xff bytes: NaN floats).
// - The kernel is compiled with -fsanitize=thread and -fsanitize=bounds; the hooks below receive
//   every memory access: an access outside every buffer is an error, and so is a race, two
//   threads touching one 2-byte granule (one of them writing; a half, the smallest element, is
//   one granule, so threads writing neighbouring halves do not race) with no barrier ordering
//   them: the same __syncthreads interval for threads of one block, the same grid-barrier interval otherwise.
#include <dlfcn.h>
#include <link.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

struct souffle_dim3 {
  unsigned int x, y, z;
};

extern "C" {
souffle_dim3 souffle_thread_idx, souffle_block_idx, souffle_block_dim, souffle_grid_dim;
}

namespace {

enum State { RUNNABLE, AT_SYNCTHREADS, AT_GRID_SYNC, AT_WARP, DONE };
enum Order { ASCENDING = 0, DESCENDING = 1, RANDOM = 2 };
enum WarpOp { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR, BALLOT, ALL, ANY, SYNCWARP };
const char* const WARP_OP_NAMES[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                     "__ballot_sync", "__all_sync", "__any_sync", "__syncwarp"};

// Persistent kernels may need hundreds of blocks (on-chip weight slices), so tens of thousands
// of fibers: their stacks are one mapping, touched only as deep as a thread goes, each with a
// canary at its bottom checked whenever the thread yields. A thread's wmma fragments are on its
// stack, whole (1 KiB per float32 accumulator): a 128 x 128 tensor-core tile's 8 accumulators and
// 6 operand fragments take 11 KiB, and each tensor-core stage of a kernel declares its own, so a
// BERT layer of six such stages overflowed 64 KiB.
constexpr size_t STACK_BYTES = 256 * 1024;
constexpr uint64_t CANARY = 0x5eedf00dcafebabeull;
constexpr int NOBODY = -1;

// A cp.async copy in flight: its source read when issued, its destination written only when a
// cp.async.wait_group retires its group (the latest a GPU may land it).
struct AsyncCopy {
  char* destination;
  unsigned char data[16];
  int bytes;
  int group;  // -1 until committed
  uintptr_t pc;  // the issue, for a report
};

struct Fiber {
  ucontext_t context;
  char* stack = nullptr;  // STACK_BYTES, the canary at the bottom
  int block = 0, thread = 0;  // thread: linear index in the block
  souffle_dim3 thread_idx{}, block_idx{};
  State state = RUNNABLE;
  int line = 0;  // of the barrier or warp operation it waits at
  int warp_op = 0, warp_arg = 0, warp_width = 32;
  unsigned warp_mask = 0;
  uint64_t deposit = 0, result = 0;
  std::vector<AsyncCopy> copies;  // its cp.async copies not yet waited on, oldest first
  int groups = 0;  // cp.async groups it has committed
};


// Memory is tracked in granules of the smallest element's size; a race names the granule's byte offset.
constexpr uintptr_t GRANULE = 2;

// One access to a granule: who, and in which barrier intervals.
struct Access {
  int thread = NOBODY;  // global thread index: block * threads + linear thread index
  uint32_t grid_epoch = 0, block_epoch = 0;
  uintptr_t pc = 0;  // the instruction, for the report
};

struct Granule {
  Access write, read, other_read;  // other_read: the last reader other than read.thread
};

struct Region {
  uintptr_t begin, end;
  std::string name;
  std::vector<Granule> granules;
};

struct Launch {
  void (*entry)(void**) = nullptr;
  void** args = nullptr;
  std::string kernel;
  int grid = 0, threads = 0;
  souffle_dim3 block_dim{};
  std::vector<Fiber> fibers;
  char* stacks = nullptr;  // every fiber's stack
  ucontext_t scheduler;
  Fiber* current = nullptr;
  std::vector<uint32_t> block_epochs;  // barriers each block has passed (its __syncthreads and grid barriers)
  uint32_t grid_epoch = 0;
  std::vector<Region> regions;  // sorted by begin
  // Shared memory: the module's thread-local block, one saved copy per block.
  char* tls = nullptr;
  size_t tls_bytes = 0;
  std::vector<std::vector<char>> shared_copies;
  std::vector<std::vector<Granule>> shared_granules;
  int resident_block = 0;
  std::string error;
  std::string error_pcs;  // "pc pc": the accesses an error names, resolved to lines by the caller
};

Launch* launch = nullptr;

// An instruction's offset in this module, which addr2line turns into a line of the kernel.
std::string module_offset(uintptr_t pc) {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(pc), &info)) return "0";
  return std::to_string(pc - reinterpret_cast<uintptr_t>(info.dli_fbase));
}

thread_local volatile char tls_anchor;  // written first: makes sure this module's thread-local block exists

void fail(const char* format, ...) {
  if (!launch->error.empty()) return;
  char text[2048];
  va_list args;
  va_start(args, format);
  vsnprintf(text, sizeof text, format, args);
  va_end(args);
  launch->error = text;
}

std::string thread_name(int block, int thread) {
  const souffle_dim3& d = launch->block_dim;
  char text[96];
  snprintf(text, sizeof text, "block %d thread (%d,%d,%d)", block, thread % d.x, thread / d.x % d.y,
           thread / (d.x * d.y));
  return text;
}

// "threads 0-31, 64 (x + y * blockDim.x)" for a sorted list of linear thread indices.
std::string thread_ranges(const std::vector<int>& threads) {
  std::string text;
  for (size_t i = 0; i < threads.size();) {
    size_t j = i;
    while (j + 1 < threads.size() && threads[j + 1] == threads[j] + 1) ++j;
    if (!text.empty()) text += ", ";
    text += std::to_string(threads[i]);
    if (j > i) text += "-" + std::to_string(threads[j]);
    i = j + 1;
  }
  return text;
}

// ---- the module's thread-local block (shared memory) ------------------------------------------

int find_tls(struct dl_phdr_info* info, size_t, void* data) {
  Dl_info self;
  if (!dladdr(reinterpret_cast<void*>(&find_tls), &self)) return 0;
  if (reinterpret_cast<void*>(info->dlpi_addr) != self.dli_fbase) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    if (info->dlpi_phdr[i].p_type == PT_TLS) {
      launch->tls = static_cast<char*>(info->dlpi_tls_data);
      launch->tls_bytes = info->dlpi_phdr[i].p_memsz;
    }
  }
  return *static_cast<int*>(data) = 1;
}

void swap_shared(int block) {
  if (block == launch->resident_block || launch->tls_bytes == 0) return;
  std::memcpy(launch->shared_copies[launch->resident_block].data(), launch->tls, launch->tls_bytes);
  std::memcpy(launch->tls, launch->shared_copies[block].data(), launch->tls_bytes);
  launch->resident_block = block;
}

// ---- races ---------------------------------------------------------------------------------------

bool ordered(const Access& before, int thread) {
  if (before.thread == NOBODY || before.thread == thread) return true;
  if (launch->grid_epoch > before.grid_epoch) return true;
  int block = thread / launch->threads;
  return before.thread / launch->threads == block && launch->block_epochs[block] > before.block_epoch;
}

// A write after an unordered read: "X read it and Y writes it".
void write_after_read(const char* memory, size_t offset, const Access& read, const Fiber& writer, uintptr_t pc) {
  int read_block = read.thread / launch->threads;
  fail("kernel %s: data race on %s byte %zu: %s read it and %s writes it with no %s between them",
       launch->kernel.c_str(), memory, offset, thread_name(read_block, read.thread % launch->threads).c_str(),
       thread_name(writer.block, writer.thread).c_str(), read_block == writer.block ? "__syncthreads" : "grid barrier");
  launch->error_pcs = module_offset(read.pc) + " " + module_offset(pc);
}

void check_granule(Granule& granule, bool write, const char* memory, size_t offset, uintptr_t pc) {
  const Fiber& fiber = *launch->current;
  int me = fiber.block * launch->threads + fiber.thread;
  Access now{me, launch->grid_epoch, launch->block_epochs[fiber.block], pc};
  if (!ordered(granule.write, me)) {
    // A read or write after an unordered write: "X wrote it and Y reads/writes it".
    int first_block = granule.write.thread / launch->threads;
    fail("kernel %s: data race on %s byte %zu: %s wrote it and %s %s it with no %s between them",
         launch->kernel.c_str(), memory, offset, thread_name(first_block, granule.write.thread % launch->threads).c_str(),
         thread_name(fiber.block, fiber.thread).c_str(), write ? "writes" : "reads",
         first_block == fiber.block ? "__syncthreads" : "grid barrier");
    launch->error_pcs = module_offset(granule.write.pc) + " " + module_offset(pc);
    return;
  }
  if (write) {
    for (const Access* reader : {&granule.read, &granule.other_read}) {
      if (!ordered(*reader, me)) {
        write_after_read(memory, offset, *reader, fiber, pc);
        return;
      }
    }
    granule.write = now;
    granule.read = granule.other_read = Access{};
    return;
  }
  if (granule.read.thread != me) granule.other_read = granule.read;
  granule.read = now;
}

void switch_to_scheduler();

// The global buffer whose bytes ``at`` to ``at + bytes`` are, or nullptr.
Region* region_of(uintptr_t at, size_t bytes) {
  auto region = std::upper_bound(launch->regions.begin(), launch->regions.end(), at,
                                 [](uintptr_t a, const Region& r) { return a < r.begin; });
  if (region == launch->regions.begin() || at + bytes > (--region)->end) return nullptr;
  return &*region;
}

// ``address``'s offset from the start of its buffer: the block's shared memory or a global buffer
// (the address itself outside them).
size_t buffer_offset(const void* address) {
  uintptr_t at = reinterpret_cast<uintptr_t>(address);
  uintptr_t tls = reinterpret_cast<uintptr_t>(launch->tls);
  if (at >= tls && at < tls + launch->tls_bytes) return at - tls;
  const Region* region = region_of(at, 1);
  return region ? at - region->begin : at;
}

void on_access(void* address, size_t bytes, bool write, void* return_address) {
  if (launch == nullptr || launch->current == nullptr || !launch->error.empty()) return;
  uintptr_t at = reinterpret_cast<uintptr_t>(address);
  uintptr_t pc = reinterpret_cast<uintptr_t>(return_address);
  const Fiber& fiber = *launch->current;
  uintptr_t stack = reinterpret_cast<uintptr_t>(fiber.stack);
  if (at >= stack && at < stack + STACK_BYTES) return;  // the thread's registers and locals
  uintptr_t tls = reinterpret_cast<uintptr_t>(launch->tls);
  if (at >= tls && at < tls + launch->tls_bytes) {
    std::vector<Granule>& granules = launch->shared_granules[fiber.block];
    for (uintptr_t g = (at - tls) / GRANULE; g <= (at + bytes - 1 - tls) / GRANULE; ++g) {
      check_granule(granules[g], write, "shared memory", g * GRANULE, pc);
    }
  } else {
    Region* region = region_of(at, bytes);
    if (region == nullptr) {
      for (const souffle_dim3* dims : {&souffle_thread_idx, &souffle_block_idx, &souffle_block_dim, &souffle_grid_dim}) {
        uintptr_t begin = reinterpret_cast<uintptr_t>(dims);
        if (at >= begin && at < begin + sizeof(souffle_dim3)) return;
      }
      fail("kernel %s: %s %s %zu bytes at %p, outside every buffer", launch->kernel.c_str(),
           thread_name(fiber.block, fiber.thread).c_str(), write ? "writes" : "reads", bytes, address);
      launch->error_pcs = module_offset(pc);
    } else {
      for (uintptr_t g = (at - region->begin) / GRANULE; g <= (at + bytes - 1 - region->begin) / GRANULE; ++g) {
        check_granule(region->granules[g], write, region->name.c_str(), g * GRANULE, pc);
      }
    }
  }
  if (!launch->error.empty()) switch_to_scheduler();
}

// ---- fibers and the scheduler ----------------------------------------------------------------

void switch_to_scheduler() {
  Fiber* fiber = launch->current;
  swapcontext(&fiber->context, &launch->scheduler);
}

void wait(State state, int line) {
  launch->current->state = state;
  launch->current->line = line;
  switch_to_scheduler();
}

void run_fiber() {
  launch->entry(launch->args);
  Fiber& fiber = *launch->current;
  if (!fiber.copies.empty() && launch->error.empty()) {
    fail("kernel %s: %s returns with %zu cp.async copies never waited on (no cp.async.wait_group retires them)",
         launch->kernel.c_str(), thread_name(fiber.block, fiber.thread).c_str(), fiber.copies.size());
    launch->error_pcs = module_offset(fiber.copies.front().pc);
  }
  fiber.state = DONE;
  switch_to_scheduler();
}

void enter(Fiber& fiber) {
  swap_shared(fiber.block);
  launch->current = &fiber;
  souffle_thread_idx = fiber.thread_idx;
  souffle_block_idx = fiber.block_idx;
  swapcontext(&launch->scheduler, &fiber.context);
  launch->current = nullptr;
  uint64_t canary;
  std::memcpy(&canary, fiber.stack, sizeof canary);
  if (canary != CANARY) {
    fail("kernel %s: %s overflowed its %zu KiB stack", launch->kernel.c_str(),
         thread_name(fiber.block, fiber.thread).c_str(), STACK_BYTES / 1024);
  }
}

// Releases every barrier all of whose threads wait at it; false when none could be.
bool release() {
  bool released = false;
  const int threads = launch->threads;
  for (int block = 0; block < launch->grid && launch->error.empty(); ++block) {
    Fiber* first = &launch->fibers[block * threads];
    int waiting = 0, done = 0;
    for (int t = 0; t < threads; ++t) {
      waiting += first[t].state == AT_SYNCTHREADS;
      done += first[t].state == DONE;
    }
    if (waiting == 0 || waiting + done < threads) continue;
    std::vector<int> at, finished;
    int line = 0;
    for (int t = 0; t < threads; ++t) {
      if (first[t].state == AT_SYNCTHREADS) {
        if (at.empty()) line = first[t].line;
        at.push_back(t);
      } else {
        finished.push_back(t);
      }
    }
    bool same_line = true;
    for (int t : at) same_line &= first[t].line == line;
    if (done > 0) {
      fail("kernel %s: block %d: threads %s wait at __syncthreads (line %d) that threads %s, which have returned, "
           "never reach", launch->kernel.c_str(), block, thread_ranges(at).c_str(), line,
           thread_ranges(finished).c_str());
      return false;
    }
    if (!same_line) {
      std::string lines;
      for (int t : at) {
        if (first[t].line != line) {
          lines = "thread " + std::to_string(t) + " at line " + std::to_string(first[t].line);
          break;
        }
      }
      fail("kernel %s: block %d: threads wait at different __syncthreads (thread %d at line %d, %s): divergent barrier",
           launch->kernel.c_str(), block, at[0], line, lines.c_str());
      return false;
    }
    for (int t = 0; t < threads; ++t) first[t].state = RUNNABLE;
    ++launch->block_epochs[block];
    released = true;
  }
  int waiting = 0, done = 0;
  for (const Fiber& fiber : launch->fibers) {
    waiting += fiber.state == AT_GRID_SYNC;
    done += fiber.state == DONE;
  }
  if (waiting > 0 && waiting + done == static_cast<int>(launch->fibers.size())) {
    if (done > 0) {
      for (int block = 0; block < launch->grid; ++block) {
        std::vector<int> finished;
        for (int t = 0; t < threads; ++t) {
          if (launch->fibers[block * threads + t].state == DONE) finished.push_back(t);
        }
        if (!finished.empty()) {
          fail("kernel %s: threads wait at the grid barrier that block %d threads %s, which have returned, never reach",
               launch->kernel.c_str(), block, thread_ranges(finished).c_str());
          return false;
        }
      }
    }
    for (Fiber& fiber : launch->fibers) fiber.state = RUNNABLE;
    ++launch->grid_epoch;
    for (uint32_t& epoch : launch->block_epochs) ++epoch;
    released = true;
  }
  // Warps: lanes warp * 32 .. of each block's linear thread index.
  for (int block = 0; block < launch->grid && launch->error.empty(); ++block) {
    for (int warp = 0; warp * 32 < threads; ++warp) {
      Fiber* lanes = &launch->fibers[block * threads + warp * 32];
      int count = std::min(32, threads - warp * 32);
      unsigned mask = 0, arrived = 0, alive = 0;
      for (int lane = 0; lane < count; ++lane) {
        if (lanes[lane].state == AT_WARP) {
          mask |= lanes[lane].warp_mask;
          arrived |= 1u << lane;
        }
        if (lanes[lane].state != DONE) alive |= 1u << lane;
      }
      if (arrived == 0) continue;
      if (mask & ~alive) {
        std::vector<int> gone;
        for (int lane = 0; lane < count; ++lane) {
          if (mask & ~alive & (1u << lane)) gone.push_back(warp * 32 + lane);
        }
        fail("kernel %s: block %d: a warp operation's mask %#x names threads %s, which have returned",
             launch->kernel.c_str(), block, mask, thread_ranges(gone).c_str());
        return false;
      }
      if ((mask & arrived) != mask) continue;  // lanes still on their way
      int op = -1, line = 0;
      for (int lane = 0; lane < count; ++lane) {
        if (!(arrived & (1u << lane))) continue;
        Fiber& f = lanes[lane];
        if (op >= 0 && (f.warp_op != op || f.line != line)) {
          fail("kernel %s: block %d warp %d: lanes meet at different warp operations (%s at line %d, %s at line %d)",
               launch->kernel.c_str(), block, warp, WARP_OP_NAMES[op], line, WARP_OP_NAMES[f.warp_op], f.line);
          return false;
        }
        op = f.warp_op;
        line = f.line;
      }
      uint64_t ballot = 0;
      bool all = true, any = false;
      for (int lane = 0; lane < count; ++lane) {
        if (!(arrived & (1u << lane))) continue;
        bool set = lanes[lane].deposit != 0;
        ballot |= static_cast<uint64_t>(set) << lane;
        all &= set;
        any |= set;
      }
      for (int lane = 0; lane < count; ++lane) {
        if (!(arrived & (1u << lane))) continue;
        Fiber& f = lanes[lane];
        int width = f.warp_width, base = lane / width * width, within = lane % width, source = lane;
        switch (op) {
          case SHFL_IDX: source = base + (f.warp_arg % width + width) % width; break;
          case SHFL_UP: source = within - f.warp_arg >= 0 ? lane - f.warp_arg : lane; break;
          case SHFL_DOWN: source = within + f.warp_arg < width ? lane + f.warp_arg : lane; break;
          case SHFL_XOR: source = (within ^ f.warp_arg) < width ? base + (within ^ f.warp_arg) : lane; break;
        }
        if (op == BALLOT) f.result = ballot;
        else if (op == ALL) f.result = all;
        else if (op == ANY) f.result = any;
        else if (op == SYNCWARP) f.result = 0;
        // Reading a lane outside the exchange is undefined on a GPU: poison it.
        else f.result = source < count && (arrived & (1u << source)) ? lanes[source].deposit : ~uint64_t{0};
        f.state = RUNNABLE;
      }
      released = true;
    }
  }
  return released;
}

const char* state_name(const Fiber& fiber, char* text, size_t size) {
  switch (fiber.state) {
    case AT_SYNCTHREADS: snprintf(text, size, "wait at __syncthreads (line %d)", fiber.line); break;
    case AT_GRID_SYNC: snprintf(text, size, "wait at the grid barrier"); break;
    case AT_WARP: snprintf(text, size, "wait at %s (line %d, mask %#x)", WARP_OP_NAMES[fiber.warp_op], fiber.line,
                           fiber.warp_mask); break;
    case DONE: snprintf(text, size, "have returned"); break;
    default: snprintf(text, size, "run"); break;
  }
  return text;
}

void report_deadlock() {
  std::string text = "kernel " + launch->kernel + ": deadlock, no barrier can be released:";
  for (int block = 0; block < launch->grid; ++block) {
    std::vector<std::pair<std::string, std::vector<int>>> groups;
    for (int t = 0; t < launch->threads; ++t) {
      char what[160];
      std::string state = state_name(launch->fibers[block * launch->threads + t], what, sizeof what);
      if (groups.empty() || groups.back().first != state) groups.push_back({state, {}});
      groups.back().second.push_back(t);
    }
    text += " block " + std::to_string(block) + ":";
    for (auto& [state, threads] : groups) text += " threads " + thread_ranges(threads) + " " + state + ";";
  }
  fail("%s", text.c_str());
}

void schedule(int order, uint64_t seed) {
  std::vector<int> sequence(launch->fibers.size());
  for (size_t i = 0; i < sequence.size(); ++i) sequence[i] = static_cast<int>(i);
  if (order == DESCENDING) std::reverse(sequence.begin(), sequence.end());
  std::mt19937_64 random(seed);
  for (;;) {
    if (order == RANDOM) std::shuffle(sequence.begin(), sequence.end(), random);
    bool ran = false;
    for (int i : sequence) {
      Fiber& fiber = launch->fibers[i];
      if (fiber.state != RUNNABLE) continue;
      enter(fiber);
      ran = true;
      if (!launch->error.empty()) return;
    }
    bool all_done = std::all_of(launch->fibers.begin(), launch->fibers.end(),
                                [](const Fiber& f) { return f.state == DONE; });
    if (all_done) return;
    bool released = release();
    if (!launch->error.empty()) return;
    if (!ran && !released) {
      report_deadlock();
      return;
    }
  }
}

}  // namespace

extern "C" {

void souffle_syncthreads(int line) { wait(AT_SYNCTHREADS, line); }

void souffle_grid_sync() { wait(AT_GRID_SYNC, 0); }

// cp.async: the source was read (and checked) by the kernel's own instrumented code; the copy
// lands in shared memory when a wait retires its group, checked as this thread's write there.
// Both addresses must be on a multiple of the copy's bytes (PTX ISA, cp.async), counted from the
// start of their buffers, which a GPU allocates on 256 bytes: else the GPU's misaligned address.
void souffle_cp_async_issue(void* destination, const void* source, const void* data, int bytes) {
  for (const void* address : {static_cast<const void*>(destination), source}) {
    if (buffer_offset(address) % bytes) {
      const Fiber& fiber = *launch->current;
      fail("kernel %s: %s: a cp.async of %d bytes %s %p, %zu bytes past a multiple of %d: a misaligned address",
           launch->kernel.c_str(), thread_name(fiber.block, fiber.thread).c_str(), bytes,
           address == source ? "from" : "to", address, buffer_offset(address) % bytes, bytes);
      launch->error_pcs = module_offset(reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
      switch_to_scheduler();
      return;
    }
  }
  AsyncCopy copy{static_cast<char*>(destination), {}, bytes, -1,
                 reinterpret_cast<uintptr_t>(__builtin_return_address(0))};
  std::memcpy(copy.data, data, bytes);
  launch->current->copies.push_back(copy);
}

void souffle_cp_async_commit() {
  Fiber& fiber = *launch->current;
  for (AsyncCopy& copy : fiber.copies) {
    if (copy.group < 0) copy.group = fiber.groups;
  }
  ++fiber.groups;
}

void souffle_cp_async_wait(int pending) {
  void* pc = __builtin_return_address(0);
  Fiber& fiber = *launch->current;
  std::vector<AsyncCopy> kept;
  for (const AsyncCopy& copy : fiber.copies) {
    if (copy.group < 0 || copy.group >= fiber.groups - pending) {
      kept.push_back(copy);
      continue;
    }
    on_access(copy.destination, copy.bytes, true, pc);
    if (!launch->error.empty()) return;
    std::memcpy(copy.destination, copy.data, copy.bytes);
  }
  fiber.copies = kept;
}

uint64_t souffle_warp_exchange(int line, int kind, unsigned mask, uint64_t value, int arg, int width) {
  Fiber& fiber = *launch->current;
  fiber.warp_op = kind;
  fiber.warp_mask = mask;
  fiber.warp_arg = arg;
  fiber.warp_width = width;
  fiber.deposit = value;
  wait(AT_WARP, line);
  return fiber.result;
}

unsigned souffle_activemask() {
  const Fiber& fiber = *launch->current;
  const Fiber* lanes = &launch->fibers[fiber.block * launch->threads + fiber.thread / 32 * 32];
  int count = std::min(32, launch->threads - fiber.thread / 32 * 32);
  unsigned mask = 0;
  for (int lane = 0; lane < count; ++lane) mask |= static_cast<unsigned>(lanes[lane].state != DONE) << lane;
  return mask;
}

// Runs ``entry(args)`` as the kernel ``kernel`` on ``grid`` blocks of ``block_dim`` threads.
// ``regions`` (``count`` of them: begin, bytes) are the buffers it may touch, named by ``names``
// (separated by '\n'). Returns 0, or 1 with the problem in ``error`` and the program counters
// of the accesses it names in ``pcs`` (offsets in this module).
int souffle_emulate(void (*entry)(void**), void** args, const char* kernel, int grid, unsigned bx, unsigned by,
                    unsigned bz, const uintptr_t* regions, int count, const char* names, int order, uint64_t seed,
                    char* error, size_t error_bytes, char* pcs, size_t pcs_bytes) {
  Launch state;
  launch = &state;
  state.entry = entry;
  state.args = args;
  state.kernel = kernel;
  state.grid = grid;
  state.block_dim = {bx, by, bz};
  state.threads = static_cast<int>(bx * by * bz);
  souffle_block_dim = state.block_dim;
  souffle_grid_dim = {static_cast<unsigned>(grid), 1, 1};
  std::string all_names = names;
  for (int i = 0; i < count; ++i) {
    size_t end = all_names.find('\n');
    Region region{regions[2 * i], regions[2 * i] + regions[2 * i + 1], all_names.substr(0, end), {}};
    region.granules.resize((regions[2 * i + 1] + GRANULE - 1) / GRANULE);
    all_names = end == std::string::npos ? "" : all_names.substr(end + 1);
    state.regions.push_back(std::move(region));
  }
  std::sort(state.regions.begin(), state.regions.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
  tls_anchor = 1;
  int found = 0;
  dl_iterate_phdr(find_tls, &found);
  if (state.tls == nullptr && state.tls_bytes > 0) fail("kernel %s: the emulator cannot find its shared memory", kernel);
  state.shared_copies.assign(grid, std::vector<char>(state.tls_bytes, static_cast<char>(0xff)));
  state.shared_granules.assign(grid, std::vector<Granule>((state.tls_bytes + GRANULE - 1) / GRANULE));
  if (state.tls != nullptr) std::memset(state.tls, 0xff, state.tls_bytes);
  state.block_epochs.assign(grid, 0);
  state.fibers.resize(static_cast<size_t>(grid) * state.threads);
  void* stacks = mmap(nullptr, state.fibers.size() * STACK_BYTES, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (stacks == MAP_FAILED) {
    fail("kernel %s: cannot map the stacks of %zu threads", kernel, state.fibers.size());
    state.fibers.clear();
  } else {
    state.stacks = static_cast<char*>(stacks);
  }
  for (int block = 0; block < grid && state.stacks != nullptr; ++block) {
    for (int t = 0; t < state.threads; ++t) {
      Fiber& fiber = state.fibers[block * state.threads + t];
      fiber.block = block;
      fiber.thread = t;
      fiber.thread_idx = {t % bx, t / bx % by, t / (bx * by)};
      fiber.block_idx = {static_cast<unsigned>(block), 0, 0};
      fiber.stack = state.stacks + (static_cast<size_t>(block) * state.threads + t) * STACK_BYTES;
      std::memcpy(fiber.stack, &CANARY, sizeof CANARY);
      getcontext(&fiber.context);
      fiber.context.uc_stack.ss_sp = fiber.stack;
      fiber.context.uc_stack.ss_size = STACK_BYTES;
      fiber.context.uc_link = nullptr;
      makecontext(&fiber.context, run_fiber, 0);
    }
  }
  if (state.error.empty()) schedule(order, seed);
  if (state.stacks != nullptr) munmap(state.stacks, state.fibers.size() * STACK_BYTES);
  launch = nullptr;
  snprintf(error, error_bytes, "%s", state.error.c_str());
  snprintf(pcs, pcs_bytes, "%s", state.error_pcs.c_str());
  return state.error.empty() ? 0 : 1;
}

// The hooks -fsanitize=thread puts at every memory access and function entry of the kernel.
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit(void*) {}
#define SOUFFLE_ACCESS_HOOKS(bytes)                                            \
  void __tsan_read##bytes(void* p) { on_access(p, bytes, false, __builtin_return_address(0)); }             \
  void __tsan_write##bytes(void* p) { on_access(p, bytes, true, __builtin_return_address(0)); }             \
  void __tsan_unaligned_read##bytes(void* p) { on_access(p, bytes, false, __builtin_return_address(0)); }   \
  void __tsan_unaligned_write##bytes(void* p) { on_access(p, bytes, true, __builtin_return_address(0)); }   \
  void __tsan_volatile_read##bytes(void* p) { on_access(p, bytes, false, __builtin_return_address(0)); }    \
  void __tsan_volatile_write##bytes(void* p) { on_access(p, bytes, true, __builtin_return_address(0)); }
SOUFFLE_ACCESS_HOOKS(1)
SOUFFLE_ACCESS_HOOKS(2)
SOUFFLE_ACCESS_HOOKS(4)
SOUFFLE_ACCESS_HOOKS(8)
SOUFFLE_ACCESS_HOOKS(16)
void __tsan_read_range(void* p, unsigned long bytes) { on_access(p, bytes, false, __builtin_return_address(0)); }
void __tsan_write_range(void* p, unsigned long bytes) { on_access(p, bytes, true, __builtin_return_address(0)); }

// -fsanitize=bounds: an index past the end of an array of known size (a register array).
struct SourceLocation {
  const char* file;
  uint32_t line, column;
};
struct TypeDescriptor {
  uint16_t kind, info;
  char name[1];
};
struct OutOfBoundsData {
  SourceLocation location;
  const TypeDescriptor* array_type;
  const TypeDescriptor* index_type;
};

void __ubsan_handle_out_of_bounds(OutOfBoundsData* data, uintptr_t index) {
  if (launch == nullptr || launch->current == nullptr) return;
  const Fiber& fiber = *launch->current;
  fail("kernel %s: %s indexes %s with %lld, out of bounds (line %u)", launch->kernel.c_str(),
       thread_name(fiber.block, fiber.thread).c_str(), data->array_type->name, static_cast<long long>(index),
       data->location.line);
  switch_to_scheduler();
}
void __ubsan_handle_out_of_bounds_abort(OutOfBoundsData* data, uintptr_t index) {
  __ubsan_handle_out_of_bounds(data, index);
}

}  // extern "C"
