#include "provider.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

namespace blutrain::alloc {

namespace {

constexpr std::size_t kHostAlignment = 512;

std::string hex(std::uintptr_t value) {
  std::ostringstream out;
  out << "0x" << std::hex << value;
  return out.str();
}

}  // namespace

HostProvider::~HostProvider() {
  for (const auto& [ptr, size] : sizes_) {
    std::free(reinterpret_cast<void*>(ptr));
  }
}

std::uintptr_t HostProvider::alloc(std::size_t size) {
  if (size == 0) {
    throw std::invalid_argument("HostProvider.alloc(size): expected a size > 0 bytes, got 0");
  }
  if (limit_ && (size > *limit_ || used_ > *limit_ - size)) {
    return 0;
  }
  // aligned_alloc wants a multiple of the alignment.
  const std::size_t padded = (size + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
  void* memory = std::aligned_alloc(kHostAlignment, padded);
  if (memory == nullptr) {
    return 0;
  }
  const auto ptr = reinterpret_cast<std::uintptr_t>(memory);
  sizes_.emplace(ptr, size);
  used_ += size;
  return ptr;
}

void HostProvider::free(std::uintptr_t ptr) {
  auto it = sizes_.find(ptr);
  if (it == sizes_.end()) {
    throw std::invalid_argument("HostProvider.free(ptr): expected a pointer returned by alloc() and not yet freed, got " +
                                hex(ptr));
  }
  used_ -= it->second;
  sizes_.erase(it);
  std::free(reinterpret_cast<void*>(ptr));
}

EventId HostProvider::record_event(StreamId stream) {
  StreamClock& clock = streams_[stream];
  clock.recorded += 1;
  const EventId id = next_event_++;
  events_.emplace(id, Event{stream, clock.recorded});
  return id;
}

const HostProvider::Event& HostProvider::find_event(EventId event, const char* op) const {
  auto it = events_.find(event);
  if (it == events_.end()) {
    throw std::invalid_argument(std::string("HostProvider.") + op +
                                "(event): expected an event returned by record_event() and not yet released, got " +
                                std::to_string(event));
  }
  return it->second;
}

bool HostProvider::query_event(EventId event) {
  const Event& e = find_event(event, "query_event");
  return streams_[e.stream].completed >= e.tick;
}

void HostProvider::synchronize_event(EventId event) {
  const Event& e = find_event(event, "synchronize_event");
  StreamClock& clock = streams_[e.stream];
  clock.completed = std::max(clock.completed, e.tick);
}

void HostProvider::release_event(EventId event) {
  find_event(event, "release_event");
  events_.erase(event);
}

std::optional<MemInfo> HostProvider::mem_info() {
  if (!limit_) {
    return std::nullopt;
  }
  return MemInfo{*limit_ - used_, *limit_};
}

void HostProvider::complete(StreamId stream) {
  StreamClock& clock = streams_[stream];
  clock.completed = clock.recorded;
}

FunctionProvider::FunctionProvider(std::uintptr_t alloc_address, std::uintptr_t free_address) {
  if (alloc_address == 0) {
    throw std::invalid_argument("FunctionProvider(alloc_address): expected the address of void* alloc(size_t), got 0");
  }
  if (free_address == 0) {
    throw std::invalid_argument("FunctionProvider(free_address): expected the address of void free(void*), got 0");
  }
  alloc_ = reinterpret_cast<AllocFn>(alloc_address);
  free_ = reinterpret_cast<FreeFn>(free_address);
}

std::uintptr_t FunctionProvider::alloc(std::size_t size) { return reinterpret_cast<std::uintptr_t>(alloc_(size)); }

void FunctionProvider::free(std::uintptr_t ptr) { free_(reinterpret_cast<void*>(ptr)); }

EventId FunctionProvider::record_event(StreamId) {
  throw AllocatorFailure("FunctionProvider has no stream events: record_stream() across streams needs a provider with events");
}

bool FunctionProvider::query_event(EventId) {
  throw AllocatorFailure("FunctionProvider has no stream events");
}

void FunctionProvider::synchronize_event(EventId) {
  throw AllocatorFailure("FunctionProvider has no stream events");
}

void FunctionProvider::release_event(EventId) {
  throw AllocatorFailure("FunctionProvider has no stream events");
}

}  // namespace blutrain::alloc
