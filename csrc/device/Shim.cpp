#include "device/Shim.h"

#include "device/Allocator.h"
#include "device/ChipNumerics.h"
#include "device/ChipProfile.h"
#include "device/Generator.h"
#include "device/Guard.h"
#include "device/SpeedEmulation.h"
#include "device/vendor/Vendor.h"

#include <ATen/native/CPUFallback.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <mutex>
#include <set>

namespace ditorch {
namespace {

constexpr c10::DeviceType kDipu = c10::DeviceType::PrivateUse1;

c10::Device dipuDevice(int index) { return c10::Device(kDipu, static_cast<c10::DeviceIndex>(index)); }

// One dipu argument re-viewed for the kernel: kept so results can be mapped back to it.
// The references are owning: an argument the chip rounds is replaced on the stack by a copy, and
// its alias must outlive the kernel so that results can still be matched against it.
struct Alias {
  c10::Storage kernel_storage;  // the alias storage the kernel saw
  at::Tensor kernel_tensor;     // the alias tensor the kernel saw (undefined for list items)
  at::Tensor original;          // the caller's dipu tensor
  void* original_data;
};

using AliasTable = c10::SmallVector<Alias, 8>;

at::Tensor makeTensor(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like_geometry) {
  c10::DispatchKeySet keys(key);
  if (like_geometry._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);  // (settable only at birth)
  auto impl = c10::make_intrusive<c10::TensorImpl>(std::move(storage), keys, like_geometry.dtype());
  impl->set_sizes_and_strides(like_geometry.sizes(), like_geometry.strides(), like_geometry.storage_offset());
  // The lazy conjugate, negative and zero bits are part of the value: kernels that reach the shim
  // with them set (mm, copy_, clone, views...) resolve them, so the re-viewed tensor must carry them.
  impl->_set_conj(like_geometry.is_conj());
  impl->_set_neg(like_geometry.is_neg());
  return at::Tensor(std::move(impl));
}

// Non-owning, resizable storage over a dipu storage's bytes. Resizable so that out= kernels
// may grow it: the new bytes come from the kernel allocation scope and are moved back.
c10::Storage kernelStorageOver(c10::StorageImpl* s) {
  c10::Device kernel_device(vendor().kernelDeviceType());
  return c10::Storage(c10::Storage::use_byte_size_t(), s->nbytes(), c10::DataPtr(s->mutable_data(), kernel_device),
                      c10::GetAllocator(vendor().kernelDeviceType()), /*resizable=*/true);
}

at::Tensor aliasFor(const at::Tensor& t, AliasTable& table, bool keep_identity) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  c10::Storage storage;
  for (const Alias& a : table) {
    if (a.original.storage().unsafeGetStorageImpl() == s) {
      // Two views of one storage share one alias storage, so kernels see them overlap.
      storage = a.kernel_storage;
      break;
    }
  }
  if (!storage) storage = kernelStorageOver(s);
  at::Tensor k = makeTensor(storage, c10::computeDispatchKey(std::nullopt, std::nullopt, vendor().kernelDeviceType()), t);
  table.push_back(Alias{storage, keep_identity ? k : at::Tensor(), t, s->mutable_data()});
  return k;
}

bool isDipu(const at::Tensor& t) { return t.defined() && t.device().type() == kDipu; }

[[noreturn]] void mixedDevices(const c10::OperatorHandle& op, const c10::Argument& arg, const at::Tensor& t, int device) {
  TORCH_CHECK(false, op.schema().name(), ": expected all tensors to be on the same device, but found at least two "
              "devices, dipu:", device, " and ", t.device(), " (argument '", arg.name(), "' with shape ", t.sizes(),
              "). Move it with .to('dipu') first.");
}

// The result `k` of a kernel, as a dipu tensor.
// Kernel result storages already given a dipu storage in this op (a list's items may share one).
using Adopted = c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 4>;

at::Tensor fromKernel(const at::Tensor& k, const AliasTable& table, int device, Adopted& adopted) {
  if (!k.defined() || k.device().type() != vendor().kernelDeviceType()) return k;
  TORCH_CHECK(k.layout() == c10::kStrided, "dipu holds only strided tensors, but the '", vendor().name(),
              "' vendor's kernel returned a ", k.layout(), " tensor (sparse and other layouts are not supported on dipu)");
  c10::StorageImpl* ks = k.storage().unsafeGetStorageImpl();
  for (const Alias& a : table) {
    if (a.kernel_storage.unsafeGetStorageImpl() != ks) continue;
    // In-place and out= results are the caller's own tensor; views share its storage.
    if (a.kernel_tensor.unsafeGetTensorImpl() == k.unsafeGetTensorImpl()) return a.original;
    return makeTensor(a.original.storage(), c10::DispatchKey::PrivateUse1, k);
  }
  for (auto& [kernel_storage, storage] : adopted)
    if (kernel_storage == ks) return makeTensor(storage, c10::DispatchKey::PrivateUse1, k);
  c10::Storage storage;
  void* data = ks->mutable_data();
  if (data == nullptr) {
    // A ZeroTensor (its storage has a size but no bytes) or an empty result: nothing to move.
    storage = c10::Storage(c10::Storage::use_byte_size_t(), ks->nbytes(), c10::DataPtr(nullptr, dipuDevice(device)),
                           &deviceAllocator(), true);
  } else if (DeviceAllocator::isBlock(ks->data_ptr())) {
    // Born in device memory inside the kernel scope: adopt the block, no copy.
    c10::DataPtr block = ks->set_data_ptr(c10::DataPtr(nullptr, ks->device()));
    block.unsafe_set_device(dipuDevice(device));
    storage = c10::Storage(c10::Storage::use_byte_size_t(), ks->nbytes(), std::move(block), &deviceAllocator(), true);
  } else {
    // Memory the kernel did not allocate through us (a cached constant, say): copy it over.
    c10::DataPtr block = deviceAllocator().allocateOn(ks->nbytes(), device, dipuDevice(device));
    vendor().memcpy(block.get(), ks->data(), ks->nbytes(), CopyKind::DeviceToDevice, device);
    storage = c10::Storage(c10::Storage::use_byte_size_t(), ks->nbytes(), std::move(block), &deviceAllocator(), true);
  }
  adopted.emplace_back(ks, storage);
  return makeTensor(storage, c10::DispatchKey::PrivateUse1, k);
}

// After the kernel: out= arguments it resized or re-strided carry that back to the dipu tensor.
void syncWrittenArguments(const AliasTable& table, int device) {
  for (const Alias& a : table) {
    if (!a.kernel_tensor.defined()) continue;
    c10::StorageImpl* ks = a.kernel_storage.unsafeGetStorageImpl();
    c10::StorageImpl* orig = a.original.storage().unsafeGetStorageImpl();
    // (A storage shared by two arguments is moved once; the second sees it already empty.)
    if (ks->data() != a.original_data && ks->data() != nullptr && ks->nbytes() > 0) {
      c10::DataPtr grown = ks->set_data_ptr(c10::DataPtr(nullptr, ks->device()));
      if (DeviceAllocator::isBlock(grown)) {
        grown.unsafe_set_device(dipuDevice(device));
        orig->set_data_ptr_noswap(std::move(grown));
      } else {
        c10::DataPtr block = deviceAllocator().allocateOn(ks->nbytes(), device, dipuDevice(device));
        vendor().memcpy(block.get(), grown.get(), ks->nbytes(), CopyKind::DeviceToDevice, device);
        orig->set_data_ptr_noswap(std::move(block));
      }
      orig->set_nbytes(ks->nbytes());
    }
    c10::TensorImpl* ot = a.original.unsafeGetTensorImpl();
    const c10::TensorImpl* kt = a.kernel_tensor.unsafeGetTensorImpl();
    if (ot->sizes() != kt->sizes() || ot->strides() != kt->strides() || ot->storage_offset() != kt->storage_offset())
      ot->set_sizes_and_strides(kt->sizes(), kt->strides(), kt->storage_offset());
  }
}

// Ops the vendor lacks: CPU with copies, counted, warned once.
struct FallbackRegistry {
  std::mutex mu;
  std::map<std::string, int64_t> counts;
  std::set<std::string> unsupported;
};
FallbackRegistry& fallbacks() {
  static FallbackRegistry r;
  return r;
}

bool vendorLacks(const c10::OperatorHandle& op, c10::DispatchKey kernel_key) {
  // A composite kernel counts: ops routed whole to the vendor (below) may have only that.
  if (!op.hasComputedKernelForDispatchKey(kernel_key)) return true;
  FallbackRegistry& r = fallbacks();
  if (r.unsupported.empty()) return false;  // racy read is fine: the set is configured at start-up
  std::lock_guard<std::mutex> lock(r.mu);
  return r.unsupported.count(op.schema().name() + (op.schema().overload_name().empty() ? "" : "." + op.schema().overload_name())) ||
         r.unsupported.count(op.schema().name());
}

void cpuFallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  std::string name = op.schema().operator_name().name;
  if (!op.schema().overload_name().empty()) name += "." + op.schema().overload_name();
  bool first;
  {
    FallbackRegistry& r = fallbacks();
    std::lock_guard<std::mutex> lock(r.mu);
    first = r.counts[name]++ == 0;
  }
  if (first)
    TORCH_WARN("ditorch: ", name, " is not supported by the '", vendor().name(),
               "' vendor; running it on the CPU with copies (warned once; see ditorch_ext.cpu_fallback_counts())");
  TORCH_CHECK(op.hasKernelForDispatchKey(c10::DispatchKey::CPU), name, " has no kernel for the '", vendor().name(),
              "' vendor and none on the CPU to fall back to");
  at::native::cpu_fallback(op, stack);
}


}  // namespace

at::Tensor asKernelTensor(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  return makeTensor(kernelStorageOver(s), c10::computeDispatchKey(std::nullopt, std::nullopt, vendor().kernelDeviceType()), t);
}

void shimKernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const c10::DeviceType kernel_type = vendor().kernelDeviceType();
  const c10::DispatchKey kernel_key = c10::computeDispatchKey(std::nullopt, std::nullopt, kernel_type);
  if (vendorLacks(op, kernel_key)) return cpuFallback(op, stack);

  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t n = args.size();
  const size_t base = stack->size() - n;

  // The op's device: its first dipu tensor, else a dipu device argument, else the current one.
  int device = -1;
  bool has_dipu_tensor = false;
  for (size_t i = 0; i < n && !has_dipu_tensor; ++i) {
    const c10::IValue& v = (*stack)[base + i];
    if (v.isTensor() && isDipu(v.toTensor())) {
      device = v.toTensor().device().index();
      has_dipu_tensor = true;
    } else if (device >= 0) continue;
    else if (v.isDevice() && v.toDevice().type() == kDipu) device = v.toDevice().has_index() ? v.toDevice().index() : currentDevice();
    else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor() && isDipu(e.toTensor())) {
          device = e.toTensor().device().index();
          has_dipu_tensor = true;
          break;
        }
    }
  }
  if (device < 0) device = currentDevice();

  const ChipProfile& chip = chipProfile();
  const bool round_inputs = chip.matmul_mantissa_bits < 23 && isMatmulOp(schema.operator_name().name);

  AliasTable table;
  for (size_t i = 0; i < n; ++i) {
    c10::IValue& v = (*stack)[base + i];
    const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      if (isDipu(t)) {
        at::Tensor k = aliasFor(t, table, /*keep_identity=*/true);
        if (round_inputs && !written) k = roundMantissa(k, chip.matmul_mantissa_bits);
        v = std::move(k);
      } else if (has_dipu_tensor && t.defined() && t.dim() > 0) {
        // 0-dim CPU tensors are scalars and allowed, as on CUDA; anything larger is a mistake.
        mixedDevices(op, args[i], t, device);
      }
    } else if (v.isList()) {
      // Tensor[] and Tensor?[] arguments (cat, index, ...). Index lists may hold CPU tensors,
      // as on CUDA; the kernel device reads them in place.
      c10::List<c10::IValue> list = v.toList();
      bool any = false;
      for (const c10::IValue& e : list) any |= e.isTensor() && isDipu(e.toTensor());
      if (!any) continue;
      c10::impl::GenericList out(list.elementType());
      out.reserve(list.size());
      for (const c10::IValue& e : list) {
        if (e.isTensor() && isDipu(e.toTensor())) out.push_back(aliasFor(e.toTensor(), table, /*keep_identity=*/false));
        else out.push_back(e);
      }
      v = c10::IValue(std::move(out));
    } else if (v.isDevice() && v.toDevice().type() == kDipu) {
      v = c10::Device(kernel_type);
    } else if (v.isGenerator() && v.toGenerator().device().type() == kDipu) {
      v = static_cast<DipuGenerator*>(v.toGenerator().unsafeGetGeneratorImpl())->kernelGenerator();
    } else if (v.isNone() && args[i].type()->kind() == c10::TypeKind::OptionalType &&
               args[i].type()->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType) {
      // Default randomness comes from the dipu device's generator, not the CPU one.
      v = static_cast<DipuGenerator*>(defaultGenerator(device).unsafeGetGeneratorImpl())->kernelGenerator();
    }
  }

  const KernelClock start = kernelClockNow(chip.slowdown);
  {
    KernelAllocationScope scope(device);
    op.redispatchBoxed(c10::DispatchKeySet(kernel_key), stack);
  }
  chargeKernel(start, chip.slowdown);

  syncWrittenArguments(table, device);
  Adopted adopted;
  const size_t returns = schema.returns().size();
  for (size_t r = stack->size() - returns; r < stack->size(); ++r) {
    c10::IValue& v = (*stack)[r];
    if (v.isTensor()) {
      at::Tensor t = fromKernel(v.toTensor(), table, device, adopted);
      if (chip.flush_denormals) flushDenormals(asKernelTensor(t));
      v = std::move(t);
    } else if (v.isTensorList()) {
      c10::List<at::Tensor> list = v.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(list.size());
      for (const at::Tensor& t : list) out.push_back(fromKernel(t, table, device, adopted));
      v = std::move(out);
    }
  }
}

std::map<std::string, int64_t> cpuFallbackCounts() {
  std::lock_guard<std::mutex> lock(fallbacks().mu);
  return fallbacks().counts;
}

void resetCpuFallbackCounts() {
  std::lock_guard<std::mutex> lock(fallbacks().mu);
  fallbacks().counts.clear();
}

void setUnsupportedOps(const std::string& names) {
  std::lock_guard<std::mutex> lock(fallbacks().mu);
  fallbacks().unsupported.clear();
  size_t start = 0;
  while (start <= names.size()) {
    size_t end = names.find(',', start);
    if (end == std::string::npos) end = names.size();
    std::string name = names.substr(start, end - start);
    if (!name.empty()) fallbacks().unsupported.insert(name.find("::") == std::string::npos ? "aten::" + name : name);
    start = end + 1;
  }
}

}  // namespace ditorch
