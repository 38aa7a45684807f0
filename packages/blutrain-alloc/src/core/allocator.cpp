#include "allocator.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace blutrain::alloc {

namespace {

// Larger requests cannot be rounded without overflow; no provider could serve them anyway.
constexpr std::size_t kMaxRequest = std::numeric_limits<std::size_t>::max() / 4;

struct FlagGuard {
  bool& flag;
  explicit FlagGuard(bool& f) : flag(f) { flag = true; }
  ~FlagGuard() { flag = false; }
  FlagGuard(const FlagGuard&) = delete;
  FlagGuard& operator=(const FlagGuard&) = delete;
};

}  // namespace

std::size_t round_size(std::size_t size) {
  if (size < kMinBlockSize) {
    return kMinBlockSize;
  }
  return (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

std::size_t segment_size_for(std::size_t rounded) {
  if (rounded <= kSmallSize) {
    return kSmallSegment;
  }
  if (rounded < kMinLargeAlloc) {
    return kLargeSegment;
  }
  return (rounded + kLargeRounding - 1) / kLargeRounding * kLargeRounding;
}

CachingAllocator::CachingAllocator(std::shared_ptr<Provider> provider) : provider_(std::move(provider)) {
  if (!provider_) {
    throw std::invalid_argument("CachingAllocator(provider): expected a provider, got none");
  }
}

CachingAllocator::~CachingAllocator() {
  // Every segment goes back to the provider; pointers still held by callers become invalid. Waiting for
  // the outstanding events first keeps a device from reusing memory that queued work still reads.
  try {
    process_events(true);
  } catch (...) {
  }
  for (const auto& [stream, queue] : pending_) {
    for (const PendingEvent& entry : queue) {
      try {
        provider_->release_event(entry.event);
      } catch (...) {
      }
    }
  }
  for (const auto& [ptr, head] : segments_) {
    for (Block* block = head; block != nullptr;) {
      Block* next = block->next;
      delete block;
      block = next;
    }
    try {
      provider_->free(ptr);
    } catch (...) {
    }
  }
}

std::uintptr_t CachingAllocator::malloc(std::size_t size, StreamId stream) {
  process_events(false);
  if (size > kMaxRequest) {
    stats_.oom_count += 1;
    throw OutOfMemory(size, size, stats_.allocated_bytes, stats_.reserved_bytes, largest_free_block(),
                      provider_mem_info());
  }
  const std::size_t rounded = round_size(size);
  BlockPool& pool = rounded <= kSmallSize ? small_pool_ : large_pool_;
  Block* block = take_free_block(pool, stream, rounded);
  bool from_cache = block != nullptr;
  if (block == nullptr) {
    block = alloc_segment(pool, stream, segment_size_for(rounded));
  }
  if (block == nullptr) {
    // The provider is out of memory: give back every cached segment (after waiting for pending events,
    // which may free whole segments) and try once more.
    stats_.oom_retries += 1;
    release_cached_blocks();
    block = take_free_block(pool, stream, rounded);
    from_cache = block != nullptr;
    if (block == nullptr) {
      block = alloc_segment(pool, stream, segment_size_for(rounded));
    }
    if (block == nullptr) {
      stats_.oom_count += 1;
      record(TraceAction::Oom, 0, rounded, stream);
      throw OutOfMemory(size, rounded, stats_.allocated_bytes, stats_.reserved_bytes, largest_free_block(),
                        provider_mem_info());
    }
  }
  if (from_cache) {
    stats_.cache_hits += 1;
  }
  split(block, rounded);
  block->allocated = true;
  block->requested = size;
  live_.emplace(block->ptr, block);

  stats_.alloc_count += 1;
  stats_.allocation_count += 1;
  stats_.allocated_bytes += block->size;
  stats_.requested_bytes += size;
  stats_.allocated_bytes_peak = std::max(stats_.allocated_bytes_peak, stats_.allocated_bytes);
  stats_.requested_bytes_peak = std::max(stats_.requested_bytes_peak, stats_.requested_bytes);
  stats_.active_bytes_peak = std::max(stats_.active_bytes_peak, stats_.allocated_bytes + stats_.pending_bytes);
  if (capture_) {
    block->stack = capture_();
  }
  record(TraceAction::Alloc, block->ptr, block->size, stream);
  return block->ptr;
}

void CachingAllocator::free(std::uintptr_t ptr) {
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw InvalidPointer("free", ptr);
  }
  // Record the events first: they are the only calls out, and the block stays live meanwhile.
  const std::vector<StreamId> streams = it->second->used_on;
  std::vector<std::pair<StreamId, EventId>> events;
  if (!streams.empty()) {
    auto release_recorded = [&]() {
      for (const auto& recorded : events) {
        try {
          provider_->release_event(recorded.second);
        } catch (...) {
        }
      }
    };
    try {
      for (StreamId used : streams) {
        events.emplace_back(used, provider_->record_event(used));
      }
    } catch (...) {
      release_recorded();
      throw;
    }
    it = live_.find(ptr);
    if (it == live_.end()) {  // freed by another thread while we were out
      release_recorded();
      throw InvalidPointer("free", ptr);
    }
  }

  Block* block = it->second;
  live_.erase(it);
  block->allocated = false;
  block->used_on.clear();
  block->stack.reset();
  stats_.free_count += 1;
  stats_.allocation_count -= 1;
  stats_.allocated_bytes -= block->size;
  stats_.requested_bytes -= block->requested;
  block->requested = 0;
  if (events.empty()) {
    record(TraceAction::Free, block->ptr, block->size, block->stream);
    free_block(block);
    return;
  }
  block->pending_events = static_cast<int>(events.size());
  stats_.pending_bytes += block->size;
  stats_.pending_block_count += 1;
  for (const auto& [used, event] : events) {
    pending_[used].push_back(PendingEvent{event, block});
  }
  pending_event_count_ += events.size();
  record(TraceAction::Free, block->ptr, block->size, block->stream);
}

void CachingAllocator::record_stream(std::uintptr_t ptr, StreamId stream) {
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    throw InvalidPointer("record_stream", ptr);
  }
  Block* block = it->second;
  if (stream == block->stream) {
    return;  // its own stream already orders reuse
  }
  if (!provider_->has_events()) {
    throw AllocatorFailure(
        "record_stream(stream): this provider has no stream events, so a block can only be used on the stream it "
        "was allocated on (" +
        std::to_string(block->stream) + "), got stream " + std::to_string(stream));
  }
  if (std::find(block->used_on.begin(), block->used_on.end(), stream) == block->used_on.end()) {
    block->used_on.push_back(stream);
  }
}

void CachingAllocator::empty_cache() { release_cached_blocks(); }

Block* CachingAllocator::take_free_block(BlockPool& pool, StreamId stream, std::size_t size) {
  auto it = pool.free_blocks.lower_bound(BlockKey{stream, size, 0});
  if (it == pool.free_blocks.end() || (*it)->stream != stream) {
    return nullptr;
  }
  Block* block = *it;
  pool.free_blocks.erase(it);
  return block;
}

Block* CachingAllocator::alloc_segment(BlockPool& pool, StreamId stream, std::size_t size) {
  auto block = std::make_unique<Block>();
  const std::uintptr_t ptr = provider_->alloc(size);
  if (ptr == 0) {
    return nullptr;
  }
  block->ptr = ptr;
  block->size = size;
  block->stream = stream;
  block->pool = &pool;
  block->segment_size = size;
  segments_.emplace(ptr, block.get());
  stats_.reserved_bytes += size;
  stats_.reserved_bytes_peak = std::max(stats_.reserved_bytes_peak, stats_.reserved_bytes);
  stats_.segment_count += 1;
  stats_.segment_count_peak = std::max(stats_.segment_count_peak, stats_.segment_count);
  stats_.block_count += 1;
  stats_.segment_alloc_count += 1;
  record(TraceAction::SegmentAlloc, ptr, size, stream);
  return block.release();
}

void CachingAllocator::split(Block* block, std::size_t size) {
  const std::size_t remaining = block->size - size;
  // Small-pool leftovers are always worth keeping; a large-pool leftover of 1 MiB or less would only ever
  // serve small requests, which come from the small pool, so it stays with the allocation instead.
  const bool worth_it = block->pool->small ? remaining >= kMinBlockSize : remaining > kSmallSize;
  if (!worth_it) {
    return;
  }
  auto* rest = new Block();
  rest->ptr = block->ptr + size;
  rest->size = remaining;
  rest->stream = block->stream;
  rest->pool = block->pool;
  rest->prev = block;
  rest->next = block->next;
  if (block->next != nullptr) {
    block->next->prev = rest;
  }
  block->next = rest;
  block->size = size;
  rest->pool->free_blocks.insert(rest);
  stats_.splits += 1;
  stats_.block_count += 1;
}

void CachingAllocator::free_block(Block* block) {
  BlockPool& pool = *block->pool;
  if (block->prev != nullptr && is_free(block->prev)) {
    Block* prev = block->prev;
    pool.free_blocks.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next != nullptr) {
      block->next->prev = prev;
    }
    delete block;
    block = prev;
    stats_.block_count -= 1;
    stats_.merges += 1;
  }
  if (block->next != nullptr && is_free(block->next)) {
    Block* next = block->next;
    pool.free_blocks.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) {
      next->next->prev = block;
    }
    delete next;
    stats_.block_count -= 1;
    stats_.merges += 1;
  }
  pool.free_blocks.insert(block);
}

void CachingAllocator::process_events(bool synchronize) {
  // One caller drains at a time; a nested or concurrent caller leaves the work to it.
  if (pending_event_count_ == 0 || processing_events_) {
    return;
  }
  FlagGuard busy(processing_events_);
  for (auto& [stream, queue] : pending_) {
    // Events of one stream complete in recording order: stop at the first one still running.
    while (!queue.empty()) {
      const PendingEvent entry = queue.front();
      if (synchronize) {
        provider_->synchronize_event(entry.event);
      } else if (!provider_->query_event(entry.event)) {
        break;
      }
      queue.pop_front();
      pending_event_count_ -= 1;
      Block* block = entry.block;
      block->pending_events -= 1;
      if (block->pending_events == 0) {
        stats_.pending_bytes -= block->size;
        stats_.pending_block_count -= 1;
        record(TraceAction::FreeCompleted, block->ptr, block->size, block->stream);
        free_block(block);
      }
      provider_->release_event(entry.event);
    }
  }
}

void CachingAllocator::release_cached_blocks() {
  process_events(true);
  std::vector<Block*> whole;
  for (BlockPool* pool : {&small_pool_, &large_pool_}) {
    for (Block* block : pool->free_blocks) {
      if (block->prev == nullptr && block->next == nullptr) {
        whole.push_back(block);
      }
    }
  }
  for (Block* block : whole) {
    block->pool->free_blocks.erase(block);
    segments_.erase(block->ptr);
    stats_.reserved_bytes -= block->size;
    stats_.segment_count -= 1;
    stats_.block_count -= 1;
    stats_.segment_free_count += 1;
    record(TraceAction::SegmentFree, block->ptr, block->size, block->stream);
  }
  // The bookkeeping is done; only now call out, so a reentrant caller sees a consistent allocator.
  std::exception_ptr first_error;
  for (Block* block : whole) {
    const std::uintptr_t ptr = block->ptr;
    delete block;
    try {
      provider_->free(ptr);
    } catch (...) {
      if (!first_error) {
        first_error = std::current_exception();
      }
    }
  }
  if (first_error) {
    std::rethrow_exception(first_error);
  }
}

std::size_t CachingAllocator::largest_free_block() const {
  std::size_t largest = 0;
  for (const BlockPool* pool : {&small_pool_, &large_pool_}) {
    for (const Block* block : pool->free_blocks) {
      largest = std::max(largest, block->size);
    }
  }
  return largest;
}

std::optional<MemInfo> CachingAllocator::provider_mem_info() noexcept {
  // Only for the out-of-memory message: a provider that cannot tell must not hide the real error.
  try {
    return provider_->mem_info();
  } catch (...) {
    return std::nullopt;
  }
}

Stats CachingAllocator::stats() const {
  Stats out = stats_;
  out.largest_free_block = largest_free_block();
  out.free_block_count = small_pool_.free_blocks.size() + large_pool_.free_blocks.size();
  return out;
}

void CachingAllocator::reset_peak() {
  stats_.allocated_bytes_peak = stats_.allocated_bytes;
  stats_.requested_bytes_peak = stats_.requested_bytes;
  stats_.reserved_bytes_peak = stats_.reserved_bytes;
  stats_.active_bytes_peak = stats_.allocated_bytes + stats_.pending_bytes;
  stats_.segment_count_peak = stats_.segment_count;
}

std::vector<SegmentInfo> CachingAllocator::snapshot() const {
  std::vector<SegmentInfo> out;
  out.reserve(segments_.size());
  for (const auto& [ptr, head] : segments_) {
    SegmentInfo segment{ptr, head->segment_size, head->stream, head->pool->small, {}};
    for (const Block* block = head; block != nullptr; block = block->next) {
      const BlockState state = block->allocated           ? BlockState::Allocated
                               : block->pending_events > 0 ? BlockState::PendingEvent
                                                           : BlockState::Free;
      segment.blocks.push_back(BlockInfo{block->ptr, block->size, block->requested, state, block->stack});
    }
    out.push_back(std::move(segment));
  }
  return out;
}

void CachingAllocator::set_trace_capacity(std::size_t capacity) {
  trace_capacity_ = capacity;
  trace_.clear();
  trace_.reserve(std::min<std::size_t>(capacity, 1u << 16));
  trace_next_ = 0;
}

void CachingAllocator::record(TraceAction action, std::uintptr_t ptr, std::size_t size, StreamId stream) {
  if (trace_capacity_ == 0) {
    return;
  }
  const TraceEntry entry{trace_seq_++,          action, ptr, size, stream, stats_.allocated_bytes, stats_.reserved_bytes,
                         stats_.allocated_bytes + stats_.pending_bytes};
  if (trace_.size() < trace_capacity_) {
    trace_.push_back(entry);
  } else {
    trace_[trace_next_] = entry;
  }
  trace_next_ = (trace_next_ + 1) % trace_capacity_;
}

std::vector<TraceEntry> CachingAllocator::trace() const {
  if (trace_.size() < trace_capacity_) {
    return trace_;
  }
  std::vector<TraceEntry> out;
  out.reserve(trace_.size());
  out.insert(out.end(), trace_.begin() + static_cast<std::ptrdiff_t>(trace_next_), trace_.end());
  out.insert(out.end(), trace_.begin(), trace_.begin() + static_cast<std::ptrdiff_t>(trace_next_));
  return out;
}

}  // namespace blutrain::alloc
