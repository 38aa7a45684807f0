#include "provider.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
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

std::uintptr_t Provider::reserve(std::size_t) {
  throw AllocatorFailure("this provider has no expandable memory (reserve/map/unmap/release/granularity)");
}

bool Provider::map(std::uintptr_t, std::size_t) {
  throw AllocatorFailure("this provider has no expandable memory (reserve/map/unmap/release/granularity)");
}

void Provider::unmap(std::uintptr_t, std::size_t) {
  throw AllocatorFailure("this provider has no expandable memory (reserve/map/unmap/release/granularity)");
}

void Provider::release(std::uintptr_t, std::size_t) {
  throw AllocatorFailure("this provider has no expandable memory (reserve/map/unmap/release/granularity)");
}

std::size_t Provider::granularity() {
  throw AllocatorFailure("this provider has no expandable memory (reserve/map/unmap/release/granularity)");
}

HostProvider::~HostProvider() {
  for (const auto& [ptr, size] : sizes_) {
    std::free(reinterpret_cast<void*>(ptr));
  }
  for (const auto& [base, reservation] : reservations_) {
    ::munmap(reservation.mapping, reservation.mapping_size);
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

std::uintptr_t HostProvider::reserve(std::size_t size) {
  if (size == 0 || size % kGranularity != 0) {
    throw std::invalid_argument("HostProvider.reserve(size): expected a multiple of " + std::to_string(kGranularity) +
                                " bytes > 0, got " + std::to_string(size));
  }
  if (size > std::numeric_limits<std::size_t>::max() / 2) {
    return 0;
  }
  // mmap aligns to pages only: reserve one chunk more and start at the first chunk boundary.
  const std::size_t mapping_size = size + kGranularity;
  int flags = MAP_PRIVATE | MAP_ANONYMOUS;
#ifdef MAP_NORESERVE
  flags |= MAP_NORESERVE;
#endif
  void* mapping = ::mmap(nullptr, mapping_size, PROT_NONE, flags, -1, 0);
  if (mapping == MAP_FAILED) {
    return 0;
  }
  const auto start = reinterpret_cast<std::uintptr_t>(mapping);
  const std::uintptr_t base = (start + kGranularity - 1) / kGranularity * kGranularity;
  reservations_.emplace(base, Reservation{size, mapping, mapping_size});
  reservation_count_ += 1;
  return base;
}

void HostProvider::check_range(std::uintptr_t address, std::size_t size, const char* op) const {
  const std::string call = std::string("HostProvider.") + op + "(address, size): ";
  if (size == 0 || size % kGranularity != 0 || address % kGranularity != 0) {
    throw std::invalid_argument(call + "expected an address and a size that are multiples of " +
                                std::to_string(kGranularity) + " bytes, got " + hex(address) + " and " +
                                std::to_string(size));
  }
  for (const auto& [base, reservation] : reservations_) {
    if (base <= address && address - base <= reservation.size && size <= reservation.size - (address - base)) {
      return;
    }
  }
  throw std::invalid_argument(call + "expected a range inside one reserved range, got " + hex(address) + " + " +
                              std::to_string(size) + " bytes");
}

bool HostProvider::map(std::uintptr_t address, std::size_t size) {
  check_range(address, size, "map");
  for (std::uintptr_t chunk = address; chunk < address + size; chunk += kGranularity) {
    if (mapped_.count(chunk) != 0) {
      throw std::invalid_argument("HostProvider.map(address, size): the chunk at " + hex(chunk) + " is already mapped");
    }
  }
  if (limit_ && (size > *limit_ || used_ > *limit_ - size)) {
    return false;
  }
  if (::mprotect(reinterpret_cast<void*>(address), size, PROT_READ | PROT_WRITE) != 0) {
    return false;
  }
  for (std::uintptr_t chunk = address; chunk < address + size; chunk += kGranularity) {
    mapped_.insert(chunk);
  }
  used_ += size;
  return true;
}

void HostProvider::unmap(std::uintptr_t address, std::size_t size) {
  check_range(address, size, "unmap");
  for (std::uintptr_t chunk = address; chunk < address + size; chunk += kGranularity) {
    if (mapped_.count(chunk) == 0) {
      throw std::invalid_argument("HostProvider.unmap(address, size): the chunk at " + hex(chunk) + " is not mapped");
    }
  }
  // Drops the pages (the memory goes back to the system, a later map reads zeros) and forbids access.
  ::madvise(reinterpret_cast<void*>(address), size, MADV_DONTNEED);
  ::mprotect(reinterpret_cast<void*>(address), size, PROT_NONE);
  for (std::uintptr_t chunk = address; chunk < address + size; chunk += kGranularity) {
    mapped_.erase(chunk);
  }
  used_ -= size;
}

void HostProvider::release(std::uintptr_t base, std::size_t size) {
  auto it = reservations_.find(base);
  if (it == reservations_.end() || it->second.size != size) {
    throw std::invalid_argument("HostProvider.release(base, size): expected a base and size returned by reserve() and "
                                "not yet released, got " + hex(base) + " and " + std::to_string(size));
  }
  auto first = mapped_.lower_bound(base);
  if (first != mapped_.end() && *first < base + size) {
    throw std::invalid_argument("HostProvider.release(base, size): the chunk at " + hex(*first) +
                                " is still mapped; unmap it first");
  }
  ::munmap(it->second.mapping, it->second.mapping_size);
  reservations_.erase(it);
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
