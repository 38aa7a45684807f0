// Providers: where the caching allocator gets its raw memory and its stream events.
//
// A provider hands out whole segments (alloc/free) and models stream ordering with events:
// record_event(stream) marks "everything issued on `stream` so far", query_event says whether that work
// has finished, synchronize_event waits for it. The allocator never calls a provider while its own
// state is half-updated, so a provider written in Python may run arbitrary code (and release the GIL).
//
// Expandable memory (optional, for expandable segments): reserve(size) reserves a range of addresses with
// no memory behind it, map(address, size) backs part of it with physical chunks, unmap gives them back and
// release(base, size) returns the whole range, which must be unmapped by then. Addresses and sizes given to
// map/unmap are multiples of granularity(), and reserve returns a base aligned to it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>

namespace blutrain::alloc {

using StreamId = std::uint64_t;
using EventId = std::uint64_t;

// A failure the caller can act on (maps to blutrain.alloc.AllocatorError).
struct AllocatorFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct MemInfo {
  std::size_t free;
  std::size_t total;
};

class Provider {
 public:
  virtual ~Provider() = default;
  // Returns 0 when the memory is exhausted; other failures throw.
  virtual std::uintptr_t alloc(std::size_t size) = 0;
  virtual void free(std::uintptr_t ptr) = 0;
  // False for providers without stream events: the allocator then refuses cross-stream use.
  virtual bool has_events() const = 0;
  virtual EventId record_event(StreamId stream) = 0;
  virtual bool query_event(EventId event) = 0;
  virtual void synchronize_event(EventId event) = 0;
  virtual void release_event(EventId event) = 0;
  virtual std::optional<MemInfo> mem_info() = 0;

  // Expandable memory; a provider without it keeps these defaults.
  virtual bool has_expandable_memory() const { return false; }
  // Returns 0 when no range of that size can be reserved; other failures throw.
  virtual std::uintptr_t reserve(std::size_t size);
  // Returns false when the memory is exhausted (nothing is mapped then); other failures throw.
  virtual bool map(std::uintptr_t address, std::size_t size);
  virtual void unmap(std::uintptr_t address, std::size_t size);
  virtual void release(std::uintptr_t base, std::size_t size);
  virtual std::size_t granularity();
};

// Plain host memory (512-byte aligned, like cudaMalloc's) with an optional byte limit, and a fake stream
// clock: each stream is a queue of work that only advances when complete(stream) or synchronize_event
// says so, which lets tests decide exactly when cross-stream frees become reusable.
//
// Its expandable memory is real virtual memory: reserve() maps an inaccessible range (mmap PROT_NONE),
// map() makes 2 MiB chunks of it readable and writable, unmap() drops their pages and makes them
// inaccessible again. Mapped chunks count against the limit like alloc()'s bytes; mapping a chunk twice,
// unmapping one that is not mapped and releasing a range with chunks still mapped throw.
class HostProvider final : public Provider {
 public:
  static constexpr std::size_t kGranularity = 2u << 20;

  explicit HostProvider(std::optional<std::size_t> limit) : limit_(limit) {}
  ~HostProvider() override;
  HostProvider(const HostProvider&) = delete;
  HostProvider& operator=(const HostProvider&) = delete;

  std::uintptr_t alloc(std::size_t size) override;
  void free(std::uintptr_t ptr) override;
  bool has_events() const override { return true; }
  EventId record_event(StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void release_event(EventId event) override;
  std::optional<MemInfo> mem_info() override;

  bool has_expandable_memory() const override { return true; }
  std::uintptr_t reserve(std::size_t size) override;
  bool map(std::uintptr_t address, std::size_t size) override;
  void unmap(std::uintptr_t address, std::size_t size) override;
  void release(std::uintptr_t base, std::size_t size) override;
  std::size_t granularity() override { return kGranularity; }

  // Finishes every piece of work issued on `stream` so far.
  void complete(StreamId stream);
  std::optional<std::size_t> limit() const { return limit_; }
  // Bytes of alloc() plus mapped chunks: what counts against the limit.
  std::size_t used_bytes() const { return used_; }
  std::size_t live_allocations() const { return sizes_.size(); }
  std::size_t outstanding_events() const { return events_.size(); }
  std::size_t mapped_bytes() const { return mapped_.size() * kGranularity; }
  std::size_t live_reservations() const { return reservations_.size(); }
  std::size_t reservation_count() const { return reservation_count_; }

 private:
  struct StreamClock {
    std::uint64_t recorded = 0;
    std::uint64_t completed = 0;
  };
  struct Event {
    StreamId stream;
    std::uint64_t tick;
  };
  struct Reservation {
    std::size_t size;
    void* mapping;  // what mmap returned (before aligning the base up)
    std::size_t mapping_size;
  };
  const Event& find_event(EventId event, const char* op) const;
  // The reservation holding [address, address + size), checked for alignment; throws naming `op`.
  void check_range(std::uintptr_t address, std::size_t size, const char* op) const;

  std::optional<std::size_t> limit_;
  std::size_t used_ = 0;
  std::unordered_map<std::uintptr_t, std::size_t> sizes_;
  std::unordered_map<std::uintptr_t, Reservation> reservations_;  // by aligned base
  std::set<std::uintptr_t> mapped_;                                // mapped chunks, by address
  std::size_t reservation_count_ = 0;                              // reserve() calls that succeeded
  std::unordered_map<StreamId, StreamClock> streams_;
  std::unordered_map<EventId, Event> events_;
  EventId next_event_ = 1;
};

// A pair of C functions, void* alloc(size_t) and void free(void*), given by address (ctypes, cffi, a
// library's exported symbols). It has no stream events, so its blocks stay on the stream they came from.
class FunctionProvider final : public Provider {
 public:
  using AllocFn = void* (*)(std::size_t);
  using FreeFn = void (*)(void*);
  FunctionProvider(std::uintptr_t alloc_address, std::uintptr_t free_address);

  std::uintptr_t alloc(std::size_t size) override;
  void free(std::uintptr_t ptr) override;
  bool has_events() const override { return false; }
  EventId record_event(StreamId stream) override;
  bool query_event(EventId event) override;
  void synchronize_event(EventId event) override;
  void release_event(EventId event) override;
  std::optional<MemInfo> mem_info() override { return std::nullopt; }

 private:
  AllocFn alloc_;
  FreeFn free_;
};

}  // namespace blutrain::alloc
