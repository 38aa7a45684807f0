// blutrain.alloc._core: the Python face of the native allocator and providers.
//
// Every method runs with the GIL held; the allocator relies on it (and on calling providers only while
// its state is consistent) instead of a mutex, so a Python provider may release the GIL safely.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <iterator>
#include <sstream>
#include <unordered_map>

#include "allocator.h"
#include "provider.h"

namespace py = pybind11;
using namespace blutrain::alloc;

namespace {

constexpr int kMaxStackDepth = 64;

// A provider written in Python: any object with the methods of blutrain.alloc.Provider.
class PyProvider final : public Provider {
 public:
  explicit PyProvider(const py::object& provider) {
    const char* methods[] = {"alloc",          "free",          "record_event", "query_event",
                             "synchronize_event", "release_event", "mem_info"};
    std::string missing;
    for (const char* name : methods) {
      if (!py::hasattr(provider, name)) {
        missing += missing.empty() ? name : std::string(", ") + name;
      }
    }
    if (!missing.empty()) {
      throw py::type_error("CachingAllocator(provider): expected an object with the blutrain.alloc.Provider methods, got " +
                           std::string(py::str(py::type::of(provider).attr("__qualname__"))) + " missing " + missing);
    }
    alloc_ = provider.attr("alloc");
    free_ = provider.attr("free");
    record_event_ = provider.attr("record_event");
    query_event_ = provider.attr("query_event");
    synchronize_event_ = provider.attr("synchronize_event");
    release_event_ = provider.attr("release_event");
    mem_info_ = provider.attr("mem_info");
    // Expandable memory is optional: all five methods, or none used.
    const char* expandable[] = {"reserve", "map", "unmap", "release", "granularity"};
    expandable_ = std::all_of(std::begin(expandable), std::end(expandable),
                              [&](const char* name) { return py::hasattr(provider, name); });
    if (expandable_) {
      reserve_ = provider.attr("reserve");
      map_ = provider.attr("map");
      unmap_ = provider.attr("unmap");
      release_ = provider.attr("release");
      granularity_ = provider.attr("granularity");
    }
  }

  std::uintptr_t alloc(std::size_t size) override {
    py::object result = alloc_(size);
    if (result.is_none()) {
      return 0;
    }
    if (!py::isinstance<py::int_>(result) || result.cast<py::int_>() < py::int_(0)) {
      throw py::type_error("provider.alloc(size): expected to return a pointer as an int >= 0 (0 when out of memory), got " +
                           std::string(py::repr(result)));
    }
    return result.cast<std::uintptr_t>();
  }

  void free(std::uintptr_t ptr) override { free_(ptr); }
  bool has_events() const override { return true; }

  EventId record_event(StreamId stream) override {
    py::object event = record_event_(stream);
    const EventId id = next_event_++;
    events_.emplace(id, std::move(event));
    return id;
  }

  bool query_event(EventId id) override {
    py::object event = events_.at(id);  // a new reference: the call below may run anything
    return py::bool_(query_event_(event));
  }

  void synchronize_event(EventId id) override {
    py::object event = events_.at(id);
    synchronize_event_(event);
  }

  void release_event(EventId id) override {
    auto node = events_.extract(id);
    if (!node.empty()) {
      release_event_(node.mapped());
    }
  }

  std::optional<MemInfo> mem_info() override {
    py::object info = mem_info_();
    if (info.is_none()) {
      return std::nullopt;
    }
    auto pair = info.cast<std::pair<std::size_t, std::size_t>>();
    return MemInfo{pair.first, pair.second};
  }

  bool has_expandable_memory() const override { return expandable_; }

  std::uintptr_t reserve(std::size_t size) override {
    py::object result = reserve_(size);
    if (result.is_none()) {
      return 0;
    }
    if (!py::isinstance<py::int_>(result) || result.cast<py::int_>() < py::int_(0)) {
      throw py::type_error("provider.reserve(size): expected to return an address as an int >= 0 (0 when no range "
                           "can be reserved), got " + std::string(py::repr(result)));
    }
    return result.cast<std::uintptr_t>();
  }

  bool map(std::uintptr_t address, std::size_t size) override { return py::bool_(map_(address, size)); }
  void unmap(std::uintptr_t address, std::size_t size) override { unmap_(address, size); }
  void release(std::uintptr_t base, std::size_t size) override { release_(base, size); }
  std::size_t granularity() override { return granularity_().cast<std::size_t>(); }

 private:
  py::object alloc_, free_, record_event_, query_event_, synchronize_event_, release_event_, mem_info_;
  bool expandable_ = false;
  py::object reserve_, map_, unmap_, release_, granularity_;
  std::unordered_map<EventId, py::object> events_;
  EventId next_event_ = 1;
};

// The allocator plus the Python object it was built from, so `provider` returns what the caller passed.
class BoundAllocator : public CachingAllocator {
 public:
  BoundAllocator(std::shared_ptr<Provider> provider, py::object provider_object, bool expandable_segments)
      : CachingAllocator(std::move(provider), expandable_segments), provider_object_(std::move(provider_object)) {}
  const py::object& provider_object() const { return provider_object_; }

 private:
  py::object provider_object_;
};

std::string utf8(PyObject* text) {
  const char* chars = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
  if (chars == nullptr) {
    PyErr_Clear();
    return "?";
  }
  return chars;
}

// The caller's Python stack, outermost frame first (like traceback.extract_stack).
std::shared_ptr<const StackTrace> capture_python_stack() {
  auto trace = std::make_shared<StackTrace>();
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  while (frame != nullptr && static_cast<int>(trace->size()) < kMaxStackDepth) {
    PyCodeObject* code = PyFrame_GetCode(frame);  // new reference
    trace->push_back(StackFrame{utf8(code->co_filename), utf8(code->co_name), PyFrame_GetLineNumber(frame)});
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);  // new reference
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  std::reverse(trace->begin(), trace->end());
  return trace;
}

py::object error_type(const char* name) { return py::module_::import("blutrain.alloc.errors").attr(name); }

void set_python_error(const py::object& exception) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
}

void translate(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const OutOfMemory& e) {
    try {
      py::object provider_free = py::none(), provider_total = py::none();
      if (e.provider) {
        provider_free = py::int_(e.provider->free);
        provider_total = py::int_(e.provider->total);
      }
      set_python_error(error_type("OutOfMemoryError")(
          py::arg("requested") = e.requested, py::arg("rounded") = e.rounded, py::arg("allocated") = e.allocated,
          py::arg("reserved") = e.reserved, py::arg("largest_free_block") = e.largest_free_block,
          py::arg("provider_free") = provider_free, py::arg("provider_total") = provider_total));
    } catch (py::error_already_set& failure) {
      failure.restore();
    }
  } catch (const InvalidPointer& e) {
    try {
      set_python_error(error_type("InvalidPointerError")(e.op, e.ptr));
    } catch (py::error_already_set& failure) {
      failure.restore();
    }
  } catch (const AllocatorFailure& e) {
    try {
      set_python_error(error_type("AllocatorError")(e.what()));
    } catch (py::error_already_set& failure) {
      failure.restore();
    }
  }
}

py::dict stats_dict(const Stats& s) {
  py::dict d;
  d["allocated_bytes"] = s.allocated_bytes;
  d["allocated_bytes_peak"] = s.allocated_bytes_peak;
  d["requested_bytes"] = s.requested_bytes;
  d["requested_bytes_peak"] = s.requested_bytes_peak;
  d["reserved_bytes"] = s.reserved_bytes;
  d["reserved_bytes_peak"] = s.reserved_bytes_peak;
  d["active_bytes"] = s.allocated_bytes + s.pending_bytes;
  d["active_bytes_peak"] = s.active_bytes_peak;
  d["pending_bytes"] = s.pending_bytes;
  d["segment_count"] = s.segment_count;
  d["segment_count_peak"] = s.segment_count_peak;
  d["block_count"] = s.block_count;
  d["allocation_count"] = s.allocation_count;
  d["free_block_count"] = s.free_block_count;
  d["pending_block_count"] = s.pending_block_count;
  d["alloc_count"] = s.alloc_count;
  d["free_count"] = s.free_count;
  d["cache_hits"] = s.cache_hits;
  d["segment_alloc_count"] = s.segment_alloc_count;
  d["segment_free_count"] = s.segment_free_count;
  d["splits"] = s.splits;
  d["merges"] = s.merges;
  d["oom_retries"] = s.oom_retries;
  d["oom_count"] = s.oom_count;
  d["largest_free_block"] = s.largest_free_block;
  return d;
}

py::object stack_list(const std::shared_ptr<const StackTrace>& stack) {
  if (!stack) {
    return py::none();
  }
  py::list frames;
  for (const StackFrame& f : *stack) {
    frames.append(py::make_tuple(f.filename, f.name, f.line));
  }
  return std::move(frames);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "Native core of blutrain.alloc: the caching allocator and the host and function-pointer providers.";
  m.attr("MIN_BLOCK_SIZE") = kMinBlockSize;
  m.attr("SMALL_SIZE") = kSmallSize;
  m.attr("SMALL_SEGMENT_SIZE") = kSmallSegment;
  m.attr("LARGE_SEGMENT_SIZE") = kLargeSegment;
  m.attr("MIN_LARGE_ALLOC") = kMinLargeAlloc;
  m.attr("LARGE_ROUNDING") = kLargeRounding;

  py::register_exception_translator(&translate);

  py::class_<Provider, std::shared_ptr<Provider>>(
      m, "NativeProvider", "Base of the providers implemented in C++; the allocator calls them without Python.");

  py::class_<HostProvider, Provider, std::shared_ptr<HostProvider>>(m, "HostProvider", py::is_final())
      .def(py::init<std::optional<std::size_t>>(), py::arg("limit") = py::none())
      .def("alloc", &HostProvider::alloc, py::arg("size"))
      .def("free", &HostProvider::free, py::arg("ptr"))
      .def("record_event", &HostProvider::record_event, py::arg("stream"))
      .def("query_event", &HostProvider::query_event, py::arg("event"))
      .def("synchronize_event", &HostProvider::synchronize_event, py::arg("event"))
      .def("release_event", &HostProvider::release_event, py::arg("event"))
      .def("mem_info",
           [](HostProvider& p) -> py::object {
             auto info = p.mem_info();
             if (!info) return py::none();
             return py::make_tuple(info->free, info->total);
           })
      .def("reserve", &HostProvider::reserve, py::arg("size"))
      .def("map", &HostProvider::map, py::arg("address"), py::arg("size"))
      .def("unmap", &HostProvider::unmap, py::arg("address"), py::arg("size"))
      .def("release", &HostProvider::release, py::arg("base"), py::arg("size"))
      .def("granularity", &HostProvider::granularity)
      .def("complete", &HostProvider::complete, py::arg("stream"))
      .def_property_readonly("limit", &HostProvider::limit)
      .def_property_readonly("used_bytes", &HostProvider::used_bytes)
      .def_property_readonly("live_allocations", &HostProvider::live_allocations)
      .def_property_readonly("outstanding_events", &HostProvider::outstanding_events)
      .def_property_readonly("mapped_bytes", &HostProvider::mapped_bytes)
      .def_property_readonly("live_reservations", &HostProvider::live_reservations)
      .def_property_readonly("reservation_count", &HostProvider::reservation_count);

  py::class_<FunctionProvider, Provider, std::shared_ptr<FunctionProvider>>(m, "FunctionProvider", py::is_final())
      .def(py::init<std::uintptr_t, std::uintptr_t>(), py::arg("alloc_address"), py::arg("free_address"))
      .def("alloc", &FunctionProvider::alloc, py::arg("size"))
      .def("free", &FunctionProvider::free, py::arg("ptr"))
      .def("record_event", &FunctionProvider::record_event, py::arg("stream"))
      .def("query_event", &FunctionProvider::query_event, py::arg("event"))
      .def("synchronize_event", &FunctionProvider::synchronize_event, py::arg("event"))
      .def("release_event", &FunctionProvider::release_event, py::arg("event"))
      .def("mem_info", [](FunctionProvider&) { return py::none(); });

  py::class_<BoundAllocator>(m, "AllocatorCore")
      .def(py::init([](const py::object& provider, bool record_stacks, std::size_t trace_capacity,
                       bool expandable_segments) {
             std::shared_ptr<Provider> native;
             if (py::isinstance<Provider>(provider)) {
               native = provider.cast<std::shared_ptr<Provider>>();
             } else {
               native = std::make_shared<PyProvider>(provider);
             }
             auto allocator = std::make_unique<BoundAllocator>(std::move(native), provider, expandable_segments);
             if (record_stacks) allocator->set_stack_capture(&capture_python_stack);
             allocator->set_trace_capacity(trace_capacity);
             return allocator;
           }),
           py::arg("provider"), py::arg("record_stacks") = false, py::arg("trace_capacity") = 0,
           py::arg("expandable_segments") = false)
      .def(
          "malloc",
          [](BoundAllocator& a, long long size, StreamId stream) {
            if (size < 0) {
              throw py::value_error("malloc(size): expected a size >= 0 bytes, got " + std::to_string(size));
            }
            return a.malloc(static_cast<std::size_t>(size), stream);
          },
          py::arg("size"), py::arg("stream") = 0)
      .def("free", &BoundAllocator::free, py::arg("ptr"))
      .def("record_stream", &BoundAllocator::record_stream, py::arg("ptr"), py::arg("stream"))
      .def("empty_cache", &BoundAllocator::empty_cache)
      .def("reset_peak", &BoundAllocator::reset_peak)
      .def("_raw_stats", [](const BoundAllocator& a) { return stats_dict(a.stats()); })
      .def(
          "_raw_snapshot",
          [](const BoundAllocator& a, bool include_stacks) {
            py::list segments;
            for (const SegmentInfo& s : a.snapshot()) {
              py::list blocks;
              for (const BlockInfo& b : s.blocks) {
                blocks.append(py::make_tuple(b.ptr, b.size, b.requested, static_cast<int>(b.state),
                                             include_stacks ? stack_list(b.stack) : py::none()));
              }
              segments.append(py::make_tuple(s.ptr, s.size, s.stream, s.small, s.expandable, blocks));
            }
            return segments;
          },
          py::arg("include_stacks"))
      .def("_raw_trace",
           [](const BoundAllocator& a) {
             py::list entries;
             for (const TraceEntry& e : a.trace()) {
               entries.append(py::make_tuple(e.seq, static_cast<int>(e.action), e.ptr, e.size, e.stream,
                                             e.allocated_bytes, e.reserved_bytes, e.active_bytes));
             }
             return entries;
           })
      .def_property(
          "record_stacks", [](const BoundAllocator& a) { return a.records_stacks(); },
          [](BoundAllocator& a, bool enabled) {
            a.set_stack_capture(enabled ? StackCapture(&capture_python_stack) : StackCapture());
          })
      .def_property("trace_capacity", &BoundAllocator::trace_capacity, &BoundAllocator::set_trace_capacity)
      .def_property_readonly("expandable_segments", &BoundAllocator::expandable_segments)
      .def_property_readonly("provider", &BoundAllocator::provider_object);
}
