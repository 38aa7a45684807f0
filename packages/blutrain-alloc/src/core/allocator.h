// The caching allocator: blocks carved out of provider segments, kept per stream, reused best-fit.
//
// Semantics follow PyTorch's CUDA caching allocator: requests are rounded to 512 B; requests up to 1 MiB
// come from 2 MiB "small" segments, larger ones from the "large" pool (20 MiB segments below 10 MiB, an
// own segment rounded to 2 MiB from 10 MiB up). A free block is reused only for a request on its own stream
// (the stream orders the reuse after every earlier use), unless record_stream() named other streams: then the
// block waits until an event recorded on each of them at free time has completed.
//
// Expandable segments (optional, as PyTorch's expandable_segments:True): instead of new segments, each
// stream and pool has one reserved range of addresses (ExpandableSegment) that grows by mapping physical
// chunks of the provider's granularity behind its blocks. Free space at the end of the mapped memory
// merges with the new chunks, so a request that fits no cached block costs only the missing chunks, and
// empty_cache() unmaps every chunk that lies wholly inside a free block. Unmapped parts of the range are
// blocks too (Backing::Unmapped), never free and never merged with mapped ones; a maximal run of mapped
// blocks is what statistics and snapshots call a segment.
//
// Reentrancy: every call to the provider happens while the allocator's state is consistent, and no
// iterator or block pointer that another caller could invalidate is held across it. A Python provider may
// therefore release the GIL, or trigger a __del__ that frees another block, in the middle of an operation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "provider.h"

namespace blutrain::alloc {

constexpr std::size_t kMinBlockSize = 512;           // every block is a multiple of this
constexpr std::size_t kSmallSize = 1u << 20;         // requests up to this come from the small pool
constexpr std::size_t kSmallSegment = 2u << 20;      // small-pool segment size
constexpr std::size_t kLargeSegment = 20u << 20;     // segment for requests in (1 MiB, 10 MiB)
constexpr std::size_t kMinLargeAlloc = 10u << 20;    // from here on a request gets its own segment
constexpr std::size_t kLargeRounding = 2u << 20;     // own segments are rounded to this

struct StackFrame {
  std::string filename;
  std::string name;
  int line;
};
using StackTrace = std::vector<StackFrame>;
using StackCapture = std::function<std::shared_ptr<const StackTrace>()>;

enum class BlockState : int { Free = 0, Allocated = 1, PendingEvent = 2 };
enum class TraceAction : int { Alloc = 0, Free = 1, FreeCompleted = 2, SegmentAlloc = 3, SegmentFree = 4, Oom = 5 };

struct BlockPool;
struct ExpandableSegment;

// Whether memory is behind a block. Classic segments are always Mapped; Changing marks a range of an
// expandable segment while the provider maps or unmaps it, so that no one else touches it meanwhile.
enum class Backing : unsigned char { Mapped, Unmapped, Changing };

struct Block {
  std::uintptr_t ptr;
  std::size_t size;
  StreamId stream;
  BlockPool* pool;
  Block* prev = nullptr;  // neighbours inside the segment, by address
  Block* next = nullptr;
  std::size_t segment_size = 0;  // set on a segment's first block only
  std::size_t requested = 0;     // the caller's size while allocated
  bool allocated = false;
  int pending_events = 0;              // events that must complete before the block is free again
  std::vector<StreamId> used_on;       // streams other than `stream` named by record_stream()
  std::shared_ptr<const StackTrace> stack;
  ExpandableSegment* expandable = nullptr;  // the range this block belongs to, if any
  Backing backing = Backing::Mapped;
};

// One reserved range of addresses, tiled by blocks from `head` on (mapped, unmapped and changing ones).
struct ExpandableSegment {
  std::uintptr_t base;
  std::size_t size;
  StreamId stream;
  BlockPool* pool;
  Block* head;
};

struct BlockKey {
  StreamId stream;
  std::size_t size;
  std::uintptr_t ptr;
};

// Orders free blocks by (stream, size, address): lower_bound gives the smallest fitting block of a stream.
struct BlockOrder {
  using is_transparent = void;
  static BlockKey key(const Block* b) { return {b->stream, b->size, b->ptr}; }
  static bool less(const BlockKey& a, const BlockKey& b) {
    if (a.stream != b.stream) return a.stream < b.stream;
    if (a.size != b.size) return a.size < b.size;
    return a.ptr < b.ptr;
  }
  bool operator()(const Block* a, const Block* b) const { return less(key(a), key(b)); }
  bool operator()(const Block* a, const BlockKey& b) const { return less(key(a), b); }
  bool operator()(const BlockKey& a, const Block* b) const { return less(a, key(b)); }
};

struct BlockPool {
  explicit BlockPool(bool is_small) : small(is_small) {}
  std::set<Block*, BlockOrder> free_blocks;
  bool small;
};

struct Stats {
  std::size_t allocated_bytes = 0, allocated_bytes_peak = 0;
  std::size_t requested_bytes = 0, requested_bytes_peak = 0;
  std::size_t reserved_bytes = 0, reserved_bytes_peak = 0;
  std::size_t pending_bytes = 0;  // freed by the caller, waiting for events
  std::size_t active_bytes_peak = 0;
  std::size_t segment_count = 0, segment_count_peak = 0;
  std::size_t block_count = 0, allocation_count = 0, pending_block_count = 0;
  std::uint64_t alloc_count = 0, free_count = 0, cache_hits = 0;
  std::uint64_t segment_alloc_count = 0, segment_free_count = 0;
  std::uint64_t splits = 0, merges = 0, oom_retries = 0, oom_count = 0;
  std::size_t largest_free_block = 0;  // filled in by CachingAllocator::stats()
  std::size_t free_block_count = 0;    // likewise
};

struct OutOfMemory : std::exception {
  std::size_t requested, rounded, allocated, reserved, largest_free_block;
  std::optional<MemInfo> provider;
  OutOfMemory(std::size_t requested_, std::size_t rounded_, std::size_t allocated_, std::size_t reserved_,
              std::size_t largest_free_block_, std::optional<MemInfo> provider_)
      : requested(requested_), rounded(rounded_), allocated(allocated_), reserved(reserved_),
        largest_free_block(largest_free_block_), provider(provider_) {}
  const char* what() const noexcept override { return "out of memory"; }
};

struct InvalidPointer : std::exception {
  std::string op;
  std::uintptr_t ptr;
  InvalidPointer(std::string operation, std::uintptr_t pointer) : op(std::move(operation)), ptr(pointer) {}
  const char* what() const noexcept override { return "invalid pointer"; }
};

struct BlockInfo {
  std::uintptr_t ptr;
  std::size_t size;
  std::size_t requested;
  BlockState state;
  std::shared_ptr<const StackTrace> stack;
};

struct SegmentInfo {
  std::uintptr_t ptr;
  std::size_t size;
  StreamId stream;
  bool small;
  bool expandable;  // a mapped run of an expandable segment
  std::vector<BlockInfo> blocks;
};

struct TraceEntry {
  std::uint64_t seq;
  TraceAction action;
  std::uintptr_t ptr;
  std::size_t size;
  StreamId stream;
  std::size_t allocated_bytes, reserved_bytes, active_bytes;
};

std::size_t round_size(std::size_t size);
std::size_t segment_size_for(std::size_t rounded);

class CachingAllocator {
 public:
  // Throws AllocatorFailure when expandable_segments is asked of a provider without expandable memory.
  CachingAllocator(std::shared_ptr<Provider> provider, bool expandable_segments);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  std::uintptr_t malloc(std::size_t size, StreamId stream);
  void free(std::uintptr_t ptr);
  void record_stream(std::uintptr_t ptr, StreamId stream);
  void empty_cache();
  Stats stats() const;
  void reset_peak();
  std::vector<SegmentInfo> snapshot() const;
  std::vector<TraceEntry> trace() const;

  void set_stack_capture(StackCapture capture) { capture_ = std::move(capture); }
  bool records_stacks() const { return static_cast<bool>(capture_); }
  void set_trace_capacity(std::size_t capacity);
  std::size_t trace_capacity() const { return trace_capacity_; }
  const std::shared_ptr<Provider>& provider() const { return provider_; }
  bool expandable_segments() const { return granularity_ != 0; }

 private:
  struct PendingEvent {
    EventId event;
    Block* block;
  };

  Block* take_free_block(BlockPool& pool, StreamId stream, std::size_t size);
  Block* alloc_segment(BlockPool& pool, StreamId stream, std::size_t size);
  Block* alloc_expandable(BlockPool& pool, StreamId stream, std::size_t size);
  bool grow(BlockPool& pool, StreamId stream, std::size_t size);
  ExpandableSegment* reserve_segment(BlockPool& pool, StreamId stream, std::size_t size);
  void split(Block* block, std::size_t size);
  void free_block(Block* block);
  void process_events(bool synchronize);
  void release_cached_blocks();
  void release_expandable_memory(std::exception_ptr& first_error, bool keep_tails);
  void merge_unmapped(Block* block);
  void count_mapped_runs(const Block* block, bool mapping);
  std::size_t largest_free_block() const;
  std::optional<MemInfo> provider_mem_info() noexcept;
  void record(TraceAction action, std::uintptr_t ptr, std::size_t size, StreamId stream);
  static bool is_free(const Block* block) {
    return !block->allocated && block->pending_events == 0 && block->backing == Backing::Mapped;
  }
  static bool is_mapped(const Block* block) { return block != nullptr && block->backing == Backing::Mapped; }

  std::shared_ptr<Provider> provider_;
  std::size_t granularity_ = 0;  // the provider's mapping unit; 0 without expandable segments
  std::vector<std::unique_ptr<ExpandableSegment>> expandable_;
  BlockPool small_pool_{true};
  BlockPool large_pool_{false};
  std::map<std::uintptr_t, Block*> segments_;          // first block of each segment, by address
  std::unordered_map<std::uintptr_t, Block*> live_;    // allocated blocks, by pointer
  std::map<StreamId, std::deque<PendingEvent>> pending_;  // per stream, in recording order
  std::size_t pending_event_count_ = 0;
  bool processing_events_ = false;
  Stats stats_;
  StackCapture capture_;
  std::vector<TraceEntry> trace_;
  std::size_t trace_capacity_ = 0;
  std::size_t trace_next_ = 0;
  std::uint64_t trace_seq_ = 0;
};

}  // namespace blutrain::alloc
