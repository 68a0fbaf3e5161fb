// The boxed fallback: device checks, generators, and the copying or zero-copy CPU path.
#include "fallback.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <torch/library.h>

#include <mutex>
#include <set>

namespace torch_dmabuf {

c10::DeviceIndex check_same_device(const char* op, const std::vector<at::Tensor>& tensors) {
  std::optional<c10::Device> seen;
  for (const auto& t : tensors) {
    if (!t.defined()) {
      continue;
    }
    if (t.device().type() == kDmabuf) {
      if (!seen) {
        seen = t.device();
      } else if (*seen != t.device()) {
        TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", *seen,
                    " and ", t.device(), " (in ", op, ")");
      }
    } else if (!(t.is_cpu() && t.dim() == 0)) {
      TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                  seen ? *seen : c10::Device(kDmabuf, 0), " and ", t.device(), " (in ", op,
                  "; only 0-dim CPU tensors may be mixed with dmabuf tensors)");
    }
  }
  TORCH_CHECK(seen.has_value(), op, ": no dmabuf tensor among the arguments");
  return seen->index();
}

CpuAccess::CpuAccess(const std::vector<at::Tensor>& tensors, bool write) : write_(write) {
  std::set<c10::DeviceIndex> devices;
  for (const auto& t : tensors) {
    if (t.defined() && t.device().type() == kDmabuf) {
      devices.insert(t.device().index());
    }
  }
  for (auto d : devices) {
    synchronize_stream(current_stream(d));
  }
  try {
    for (const auto& t : tensors) {
      if (t.defined() && t.device().type() == kDmabuf) {
        entry(t.storage());
      }
    }
  } catch (...) {
    // The destructor does not run for a constructor that throws: end what was begun.
    for (auto& e : entries_) {
      if (e.bracket) {
        (void)dmabuf_rt_cpu_access_end(e.device.device().index(), e.ptr, e.bytes, write_);
      }
    }
    throw;
  }
}

CpuAccess::~CpuAccess() {
  for (auto& e : entries_) {
    if (e.bracket) {
      (void)dmabuf_rt_cpu_access_end(e.device.device().index(), e.ptr, e.bytes, write_);
    }
  }
}

CpuAccess::Entry& CpuAccess::entry(const at::Storage& device) {
  for (auto& e : entries_) {
    if (e.device.is_alias_of(device)) {
      return e;
    }
  }
  const size_t n = device.nbytes();
  void* ptr = const_cast<void*>(device.data());
  bool bracket = n > 0 && ptr != nullptr;
  if (bracket) {
    check(dmabuf_rt_cpu_access_begin(device.device().index(), ptr, n, write_), "CPU access to device memory");
  }
  // The CPU storage borrows the pages (its DataPtr has no deleter; the device storage, kept
  // in the entry and by the tensors, owns them). A kernel that resizes it (an out= argument)
  // gets a new block of the same device, which `adopt_resized` hands to the device storage.
  at::Storage host(at::Storage::use_byte_size_t(), n, at::DataPtr(ptr, c10::Device(c10::kCPU)),
                   device_backed_cpu_allocator(device.device().index()), true);
  entries_.push_back({device, std::move(host), ptr, n, bracket});
  return entries_.back();
}

void CpuAccess::adopt_resized() {
  for (auto& e : entries_) {
    void* now = const_cast<void*>(e.host.data());
    if (now == e.ptr) {
      continue;
    }
    const auto device = e.device.device().index();
    if (e.bracket) {
      (void)dmabuf_rt_cpu_access_end(device, e.ptr, e.bytes, write_);
    }
    // The CPU storage lets go of the block without freeing it; the device storage takes it
    // (its old block is freed as the old DataPtr goes).
    auto owned = e.host.set_data_ptr(at::DataPtr(now, c10::Device(c10::kCPU)));
    (void)owned.release_context();
    const size_t n = e.host.nbytes();
    e.device.set_data_ptr_noswap(device_data_ptr(now, device));
    e.device.set_nbytes(n);
    // The new block was opened for CPU writes when it was allocated: this access ends it.
    e.ptr = now;
    e.bytes = n;
    e.bracket = now != nullptr && n > 0;
  }
}

at::Tensor CpuAccess::cpu(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kDmabuf) {
    return t;
  }
  // A tensor whose storage was shrunk under it would read (and, through set_, regrow)
  // past its storage: refuse it as the CPU path of a copy does.
  const auto needed = at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.itemsize(), t.storage_offset());
  TORCH_CHECK(t.numel() == 0 || needed <= t.storage().nbytes(), "a ", t.device(), " tensor of shape ", t.sizes(),
              " needs ", needed, " bytes of its storage, which has only ", t.storage().nbytes(),
              " (was the storage resized under it?)");
  auto& e = entry(t.storage());
  auto out = at::empty({0}, t.options().device(c10::kCPU));
  out.set_(e.host, t.storage_offset(), t.sizes(), t.strides());
  // Lazy conjugation and negation stay with the view: CPU kernels honour them.
  out._set_conj(t.is_conj());
  out._set_neg(t.is_neg());
  return out;
}

std::optional<at::Storage> CpuAccess::device_storage(const at::Storage& cpu) const {
  for (const auto& e : entries_) {
    if (e.host.is_alias_of(cpu)) {
      return e.device;
    }
  }
  return std::nullopt;
}

namespace {

// Calls `f` on every tensor an IValue holds (a tensor, a list of tensors, a list of optional
// tensors).
template <typename F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const auto& t : v.toTensorVector()) {
      f(t);
    }
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) {
      if (e.isTensor()) {
        f(e.toTensor());
      }
    }
  }
}

// Rebuilds an IValue with each tensor replaced by `f(tensor)`.
template <typename F>
c10::IValue map_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    return f(v.toTensor());
  }
  if (v.isTensorList()) {
    c10::List<at::Tensor> out;
    for (const auto& t : v.toTensorVector()) {
      out.push_back(f(t));
    }
    return out;
  }
  if (v.isList()) {
    auto in = v.toList();
    c10::impl::GenericList out(in.elementType());
    for (const auto& e : v.toListRef()) {
      out.push_back(e.isTensor() ? c10::IValue(f(e.toTensor())) : e);
    }
    return out;
  }
  return v;
}

bool is_generator_arg(const c10::Argument& a) {
  return a.type()->str().find("Generator") != std::string::npos;
}

// A device generator lent to a CPU kernel: its state moves into a CPU generator for the
// call and back after it, under the device generator's lock.
struct LentGenerator {
  at::Generator device;
  at::Generator cpu;
  std::unique_lock<std::mutex> lock;
};

void zero_copy_fallback_run(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first,
                            const std::vector<at::Tensor>& on_dev, c10::DeviceIndex device) {
  const auto& schema = op.schema();
  CpuAccess access(on_dev, /*write=*/true);
  for (size_t i = first; i < stack->size(); i++) {
    if ((*stack)[i].isDevice() && (*stack)[i].toDevice().type() == kDmabuf) {
      (*stack)[i] = c10::IValue(c10::Device(c10::kCPU));
    }
  }
  // Each argument's CPU view, remembered by TensorImpl so that a returned argument (an
  // in-place or out= op) is returned as the original device tensor.
  std::vector<std::pair<at::Tensor, at::Tensor>> originals;  // (CPU view, device tensor)
  for (size_t i = first; i < stack->size(); i++) {
    (*stack)[i] = map_tensors((*stack)[i], [&](const at::Tensor& t) {
      if (!t.defined() || t.device().type() != kDmabuf) {
        return t;
      }
      auto c = access.cpu(t);
      originals.emplace_back(c, t);
      return c;
    });
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  access.adopt_resized();
  // An argument the kernel resized or restrided (an out= argument) takes the CPU view's
  // geometry.
  for (auto& [c, orig] : originals) {
    if (c.sizes() != orig.sizes() || c.strides() != orig.strides() || c.storage_offset() != orig.storage_offset()) {
      at::cpu::set_(orig, orig.storage(), c.storage_offset(), c.sizes(), c.strides());
    }
  }
  const size_t nret = schema.returns().size();
  const auto dev = c10::Device(kDmabuf, device);
  for (size_t i = stack->size() - nret; i < stack->size(); i++) {
    (*stack)[i] = map_tensors((*stack)[i], [&](const at::Tensor& r) -> at::Tensor {
      if (!r.defined() || !r.is_cpu()) {
        return r;
      }
      for (const auto& [c, orig] : originals) {
        if (c.unsafeGetTensorImpl() == r.unsafeGetTensorImpl()) {
          return orig;
        }
      }
      if (auto st = access.device_storage(r.storage())) {
        // A view of an argument: the same view of the device storage.
        auto v = at::empty({0}, r.options().device(dev));
        v.set_(*st, r.storage_offset(), r.sizes(), r.strides());
        return v;
      }
      // A new result computed on the CPU: it moves to the device (one copy).
      return r.to(dev);
    });
  }
}

} // namespace

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> all;
  for (size_t i = first; i < stack->size(); i++) {
    each_tensor((*stack)[i], [&](const at::Tensor& t) { all.push_back(t); });
  }
  std::optional<c10::DeviceIndex> device;
  for (const auto& t : all) {
    if (t.defined() && t.device().type() == kDmabuf) {
      device = check_same_device(schema.operator_name().name.c_str(), all);
      break;
    }
  }
  // A device argument (a factory on dmabuf): the CPU kernel makes CPU results, moved over.
  for (size_t i = first; i < stack->size(); i++) {
    const auto& v = (*stack)[i];
    if (!device && v.isDevice() && v.toDevice().type() == kDmabuf) {
      auto d = v.toDevice();
      device = d.has_index() ? d.index() : current_device();
      check_device(*device);
    }
  }
  TORCH_CHECK(device.has_value(), schema.operator_name().name, " reached the dmabuf fallback without a dmabuf tensor");
  // Random ops draw from the device's generator.
  std::vector<LentGenerator> lent;
  for (size_t i = 0; i < args.size(); i++) {
    auto& v = (*stack)[first + i];
    if (!is_generator_arg(args[i])) {
      continue;
    }
    at::Generator g;
    if (v.isNone()) {
      g = default_generator(*device);
    } else if (v.isGenerator() && v.toGenerator().device().type() == kDmabuf) {
      g = v.toGenerator();
    } else if (v.isGenerator()) {
      TORCH_CHECK(false, "Expected a 'dmabuf' device type for generator but found '", v.toGenerator().device().type(),
                  "' (in ", schema.operator_name().name, ")");
    } else {
      continue;
    }
    std::unique_lock<std::mutex> lock(g.mutex());
    auto cpu = at::make_generator<at::CPUGeneratorImpl>();
    cpu.set_state(g.get_state());
    v = c10::IValue(cpu);
    lent.push_back({g, cpu, std::move(lock)});
  }
  std::vector<at::Tensor> on_dev;
  for (const auto& t : all) {
    if (t.defined() && t.device().type() == kDmabuf) {
      on_dev.push_back(t);
    }
  }
  if (zero_copy_fallback()) {
    zero_copy_fallback_run(op, stack, first, on_dev, *device);
  } else {
    at::native::cpu_fallback(op, stack);
  }
  for (auto& l : lent) {
    l.device.set_state(l.cpu.get_state());
  }
}

} // namespace torch_dmabuf

// Copies handle lazy conjugation and negation themselves (ops.cpp): without these, the
// Conjugate and Negative layers materialise the source with a clone, whose copy comes back
// here, and so on until the stack overflows.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torch_dmabuf::fallback>());
}
