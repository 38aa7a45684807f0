#include "allocator.h"

#include <algorithm>
#include <limits>
#include <utility>

namespace blutrain::alloc {

namespace {

// Larger requests cannot be rounded without overflow; no provider could serve them anyway.
constexpr std::size_t kMaxRequest = std::numeric_limits<std::size_t>::max() / 4;
// The range an expandable segment reserves when the provider cannot tell its total memory.
constexpr std::size_t kDefaultReservation = std::size_t{64} << 30;

std::size_t round_up(std::size_t value, std::size_t unit) { return (value + unit - 1) / unit * unit; }

// Splits `block` at `offset`: `block` keeps the left part, the returned block (same stream, pool, segment
// and backing, in no free set) the right one.
Block* cut(Block* block, std::size_t offset) {
  auto* rest = new Block();
  rest->ptr = block->ptr + offset;
  rest->size = block->size - offset;
  rest->stream = block->stream;
  rest->pool = block->pool;
  rest->expandable = block->expandable;
  rest->backing = block->backing;
  rest->prev = block;
  rest->next = block->next;
  if (block->next != nullptr) {
    block->next->prev = rest;
  }
  block->next = rest;
  block->size = offset;
  return rest;
}

struct FlagGuard {
  bool& flag;
  explicit FlagGuard(bool& f) : flag(f) { flag = true; }
  ~FlagGuard() { flag = false; }
  FlagGuard(const FlagGuard&) = delete;
  FlagGuard& operator=(const FlagGuard&) = delete;
};

BlockInfo block_info(const Block* block) {
  const BlockState state = block->allocated           ? BlockState::Allocated
                           : block->pending_events > 0 ? BlockState::PendingEvent
                                                       : BlockState::Free;
  return BlockInfo{block->ptr, block->size, block->requested, state, block->stack};
}

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

CachingAllocator::CachingAllocator(std::shared_ptr<Provider> provider, bool expandable_segments)
    : provider_(std::move(provider)) {
  if (!provider_) {
    throw std::invalid_argument("CachingAllocator(provider): expected a provider, got none");
  }
  if (expandable_segments) {
    if (!provider_->has_expandable_memory()) {
      throw AllocatorFailure(
          "CachingAllocator(expandable_segments=True): expected a provider with expandable memory (reserve, map, "
          "unmap, release, granularity), got one without");
    }
    const std::size_t granularity = provider_->granularity();
    if (granularity == 0 || granularity % kMinBlockSize != 0) {
      throw AllocatorFailure("CachingAllocator(expandable_segments=True): expected provider.granularity() to be a "
                             "multiple of " + std::to_string(kMinBlockSize) + " bytes > 0, got " +
                             std::to_string(granularity));
    }
    granularity_ = granularity;
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
  for (const auto& segment : expandable_) {
    std::vector<std::pair<std::uintptr_t, std::size_t>> mapped;  // runs of mapped chunks
    for (Block* block = segment->head; block != nullptr;) {
      if (block->backing != Backing::Unmapped) {
        if (!mapped.empty() && mapped.back().first + mapped.back().second == block->ptr) {
          mapped.back().second += block->size;
        } else {
          mapped.emplace_back(block->ptr, block->size);
        }
      }
      Block* next = block->next;
      delete block;
      block = next;
    }
    for (const auto& [ptr, size] : mapped) {
      try {
        provider_->unmap(ptr, size);
      } catch (...) {
      }
    }
    try {
      provider_->release(segment->base, segment->size);
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
  if (block == nullptr && expandable_segments() && stats_.reserved_bytes + rounded > stats_.reserved_bytes_peak) {
    // Growing may set a new peak of reserved memory: first give back the chunks that lie wholly inside free
    // blocks (holes left between live blocks), so that the new chunks reuse their physical memory and the
    // peak reserved follows the peak allocated. Only at a new peak: in a steady loop, no unmapping.
    std::exception_ptr error;
    release_expandable_memory(error, /*keep_tails=*/true);
    if (error) {
      std::rethrow_exception(error);
    }
    block = take_free_block(pool, stream, rounded);
    from_cache = block != nullptr;
  }
  if (block == nullptr) {
    block = expandable_segments() ? alloc_expandable(pool, stream, rounded)
                                  : alloc_segment(pool, stream, segment_size_for(rounded));
  }
  if (block == nullptr) {
    // The provider is out of memory: give back every cached segment (after waiting for pending events,
    // which may free whole segments) and try once more.
    stats_.oom_retries += 1;
    release_cached_blocks();
    block = take_free_block(pool, stream, rounded);
    from_cache = block != nullptr;
    if (block == nullptr) {
      block = expandable_segments() ? alloc_expandable(pool, stream, rounded)
                                    : alloc_segment(pool, stream, segment_size_for(rounded));
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

Block* CachingAllocator::alloc_expandable(BlockPool& pool, StreamId stream, std::size_t size) {
  // A reentrant caller (a Python provider may run anything) can take the memory just mapped before we
  // look for it; then map more.
  while (grow(pool, stream, size)) {
    if (Block* block = take_free_block(pool, stream, size)) {
      return block;
    }
  }
  return nullptr;
}

bool CachingAllocator::grow(BlockPool& pool, StreamId stream, std::size_t size) {
  const std::size_t unit = granularity_;
  // The unmapped block that needs the fewest new chunks to make a free block of `size` with its free
  // neighbours: usually the end of the range, after the free tail of the mapped memory.
  Block* target = nullptr;
  std::size_t target_bytes = 0;
  for (const auto& segment : expandable_) {
    if (segment->pool != &pool || segment->stream != stream) {
      continue;
    }
    for (Block* block = segment->head; block != nullptr; block = block->next) {
      if (block->backing != Backing::Unmapped) {
        continue;
      }
      const std::size_t before = block->prev != nullptr && is_free(block->prev) ? block->prev->size : 0;
      const std::size_t after = block->next != nullptr && is_free(block->next) ? block->next->size : 0;
      std::size_t bytes = round_up(size - std::min(size - 1, before), unit);
      if (bytes > block->size) {
        if (before + block->size + after < size) {
          continue;
        }
        bytes = block->size;
      }
      if (target == nullptr || bytes < target_bytes) {
        target = block;
        target_bytes = bytes;
      }
    }
  }
  if (target == nullptr) {
    ExpandableSegment* segment = reserve_segment(pool, stream, round_up(size, unit));
    if (segment == nullptr) {
      return false;
    }
    target = segment->head;
    target_bytes = round_up(size, unit);
  }
  // Take the chunks off the front of the unmapped block and mark them before calling out.
  if (target_bytes < target->size) {
    cut(target, target_bytes);
  }
  target->backing = Backing::Changing;
  bool mapped = false;
  try {
    mapped = provider_->map(target->ptr, target_bytes);
  } catch (...) {
    target->backing = Backing::Unmapped;
    merge_unmapped(target);
    throw;
  }
  if (!mapped) {
    target->backing = Backing::Unmapped;
    merge_unmapped(target);
    return false;
  }
  target->backing = Backing::Mapped;
  count_mapped_runs(target, true);
  stats_.reserved_bytes += target_bytes;
  stats_.reserved_bytes_peak = std::max(stats_.reserved_bytes_peak, stats_.reserved_bytes);
  stats_.block_count += 1;
  stats_.segment_alloc_count += 1;
  record(TraceAction::SegmentAlloc, target->ptr, target_bytes, stream);
  free_block(target);  // merges with the free tail before it (and a free block after a filled hole)
  return true;
}

ExpandableSegment* CachingAllocator::reserve_segment(BlockPool& pool, StreamId stream, std::size_t size) {
  // As large as the whole memory (as PyTorch does), so one range per stream and pool is enough: addresses
  // are plentiful, only mapped chunks cost memory.
  const std::optional<MemInfo> info = provider_mem_info();
  const std::size_t whole = round_up(info ? std::min(info->total, kMaxRequest) : kDefaultReservation, granularity_);
  std::size_t reserved = std::max(size, whole);
  std::uintptr_t base = provider_->reserve(reserved);
  if (base == 0 && reserved > size) {
    reserved = size;
    base = provider_->reserve(reserved);
  }
  if (base == 0) {
    return nullptr;
  }
  if (base % granularity_ != 0) {
    try {
      provider_->release(base, reserved);
    } catch (...) {
    }
    throw AllocatorFailure("provider.reserve(size): expected an address aligned to granularity() (" +
                           std::to_string(granularity_) + " bytes), got " + std::to_string(base));
  }
  auto segment = std::make_unique<ExpandableSegment>(ExpandableSegment{base, reserved, stream, &pool, nullptr});
  auto* head = new Block();
  head->ptr = base;
  head->size = reserved;
  head->stream = stream;
  head->pool = &pool;
  head->expandable = segment.get();
  head->backing = Backing::Unmapped;
  segment->head = head;
  expandable_.push_back(std::move(segment));
  return expandable_.back().get();
}

void CachingAllocator::merge_unmapped(Block* block) {
  // A segment's head is never merged away: only a block with a left neighbour, or a right neighbour, is.
  if (block->prev != nullptr && block->prev->backing == Backing::Unmapped) {
    Block* prev = block->prev;
    prev->size += block->size;
    prev->next = block->next;
    if (block->next != nullptr) {
      block->next->prev = prev;
    }
    delete block;
    block = prev;
  }
  if (block->next != nullptr && block->next->backing == Backing::Unmapped) {
    Block* next = block->next;
    block->size += next->size;
    block->next = next->next;
    if (next->next != nullptr) {
      next->next->prev = block;
    }
    delete next;
  }
}

void CachingAllocator::count_mapped_runs(const Block* block, bool mapped_now) {
  // A maximal run of mapped blocks is a segment. A block that becomes mapped starts a run, extends one or
  // joins two; one that stops being mapped ends, shortens or splits one.
  const std::size_t neighbours = (is_mapped(block->prev) ? 1 : 0) + (is_mapped(block->next) ? 1 : 0);
  if (mapped_now) {
    stats_.segment_count = stats_.segment_count + 1 - neighbours;
  } else {
    stats_.segment_count = stats_.segment_count + neighbours - 1;
  }
  stats_.segment_count_peak = std::max(stats_.segment_count_peak, stats_.segment_count);
}

void CachingAllocator::split(Block* block, std::size_t size) {
  const std::size_t remaining = block->size - size;
  // Small-pool leftovers are always worth keeping; a large-pool leftover of 1 MiB or less would only ever
  // serve small requests, which come from the small pool, so it stays with the allocation instead --
  // unless it ends the mapped memory of an expandable segment, where the next growth merges it.
  const bool keep_small = block->pool->small || (block->expandable != nullptr && !is_mapped(block->next));
  const bool worth_it = keep_small ? remaining >= kMinBlockSize : remaining > kSmallSize;
  if (!worth_it) {
    return;
  }
  Block* rest = cut(block, size);
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
      if (block->prev == nullptr && block->next == nullptr && block->expandable == nullptr) {
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
  if (expandable_segments()) {
    release_expandable_memory(first_error, /*keep_tails=*/false);
  }
  if (first_error) {
    std::rethrow_exception(first_error);
  }
}

void CachingAllocator::release_expandable_memory(std::exception_ptr& first_error, bool keep_tails) {
  const std::size_t unit = granularity_;
  // Every chunk that lies wholly inside a free block is unmapped; the free block keeps the partial chunks
  // at its ends, which allocated neighbours share. With keep_tails (before a growth), a free block that ends
  // its run of mapped memory stays, as do ranges: the growth merges with the one and maps into the other.
  std::vector<Block*> candidates;
  for (BlockPool* pool : {&small_pool_, &large_pool_}) {
    for (Block* block : pool->free_blocks) {
      if (block->expandable != nullptr && !(keep_tails && !is_mapped(block->next))) {
        candidates.push_back(block);
      }
    }
  }
  std::vector<Block*> unmapping;
  for (Block* block : candidates) {
    const std::uintptr_t start = round_up(block->ptr, unit);
    const std::uintptr_t end = (block->ptr + block->size) / unit * unit;
    if (start >= end) {
      continue;
    }
    BlockPool& pool = *block->pool;
    pool.free_blocks.erase(block);
    Block* chunks = block;
    if (start > block->ptr) {
      chunks = cut(block, start - block->ptr);
      pool.free_blocks.insert(block);
      stats_.block_count += 1;
    }
    if (end < chunks->ptr + chunks->size) {
      pool.free_blocks.insert(cut(chunks, end - chunks->ptr));
      stats_.block_count += 1;
    }
    count_mapped_runs(chunks, false);
    chunks->backing = Backing::Changing;
    stats_.block_count -= 1;
    stats_.reserved_bytes -= chunks->size;
    stats_.segment_free_count += 1;
    record(TraceAction::SegmentFree, chunks->ptr, chunks->size, chunks->stream);
    unmapping.push_back(chunks);
  }
  // The bookkeeping is done; the blocks being unmapped are Changing, so nobody touches them meanwhile.
  for (Block* block : unmapping) {
    try {
      provider_->unmap(block->ptr, block->size);
    } catch (...) {
      if (!first_error) {
        first_error = std::current_exception();
      }
    }
    block->backing = Backing::Unmapped;
    merge_unmapped(block);
  }
  if (keep_tails) {
    return;
  }
  // A range with nothing mapped goes back too; the next growth reserves a new one.
  std::vector<std::pair<std::uintptr_t, std::size_t>> released;
  for (auto it = expandable_.begin(); it != expandable_.end();) {
    Block* head = (*it)->head;
    if (head->backing == Backing::Unmapped && head->next == nullptr) {
      released.emplace_back((*it)->base, (*it)->size);
      delete head;
      it = expandable_.erase(it);
    } else {
      ++it;
    }
  }
  for (const auto& [base, size] : released) {
    try {
      provider_->release(base, size);
    } catch (...) {
      if (!first_error) {
        first_error = std::current_exception();
      }
    }
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
  out.reserve(segments_.size() + expandable_.size());
  for (const auto& [ptr, head] : segments_) {
    SegmentInfo segment{ptr, head->segment_size, head->stream, head->pool->small, false, {}};
    for (const Block* block = head; block != nullptr; block = block->next) {
      segment.blocks.push_back(block_info(block));
    }
    out.push_back(std::move(segment));
  }
  for (const auto& expandable : expandable_) {
    SegmentInfo* run = nullptr;  // the mapped run being listed
    for (const Block* block = expandable->head; block != nullptr; block = block->next) {
      if (block->backing != Backing::Mapped) {
        run = nullptr;
        continue;
      }
      if (run == nullptr) {
        out.push_back(SegmentInfo{block->ptr, 0, block->stream, block->pool->small, true, {}});
        run = &out.back();
      }
      run->size += block->size;
      run->blocks.push_back(block_info(block));
    }
  }
  std::sort(out.begin(), out.end(), [](const SegmentInfo& a, const SegmentInfo& b) { return a.ptr < b.ptr; });
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
