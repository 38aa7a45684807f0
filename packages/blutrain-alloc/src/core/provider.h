// Providers: where the caching allocator gets its raw memory and its stream events.
//
// A provider hands out whole segments (alloc/free) and models stream ordering with events:
// record_event(stream) marks "everything issued on `stream` so far", query_event says whether that work
// has finished, synchronize_event waits for it. The allocator never calls a provider while its own
// state is half-updated, so a provider written in Python may run arbitrary code (and release the GIL).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
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
};

// Plain host memory (512-byte aligned, like cudaMalloc's) with an optional byte limit, and a fake stream
// clock: each stream is a queue of work that only advances when complete(stream) or synchronize_event
// says so, which lets tests decide exactly when cross-stream frees become reusable.
class HostProvider final : public Provider {
 public:
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

  // Finishes every piece of work issued on `stream` so far.
  void complete(StreamId stream);
  std::optional<std::size_t> limit() const { return limit_; }
  std::size_t used_bytes() const { return used_; }
  std::size_t live_allocations() const { return sizes_.size(); }
  std::size_t outstanding_events() const { return events_.size(); }

 private:
  struct StreamClock {
    std::uint64_t recorded = 0;
    std::uint64_t completed = 0;
  };
  struct Event {
    StreamId stream;
    std::uint64_t tick;
  };
  const Event& find_event(EventId event, const char* op) const;

  std::optional<std::size_t> limit_;
  std::size_t used_ = 0;
  std::unordered_map<std::uintptr_t, std::size_t> sizes_;
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
