#include "device/Shim.h"

#include "device/Allocator.h"
#include "device/AutogradThreads.h"
#include "device/ChipNumerics.h"
#include "device/ChipProfile.h"
#include "device/CounterRandom.h"
#include "device/CpuFallback.h"
#include "device/Generator.h"
#include "device/Guard.h"
#include "device/KernelArguments.h"
#include "device/SpeedEmulation.h"
#include "device/vendor/Vendor.h"

#include <optional>

namespace ditorch {
namespace {

constexpr c10::DeviceType kDipu = c10::DeviceType::PrivateUse1;

[[noreturn]] void mixedDevices(const c10::OperatorHandle& op, const c10::Argument& arg, const at::Tensor& t, int device) {
  TORCH_CHECK(false, op.schema().name(), ": expected all tensors to be on the same device, but found at least two "
              "devices, dipu:", device, " and ", t.device(), " (argument '", arg.name(), "' with shape ", t.sizes(),
              "). Move it with .to('dipu:", device, "') first.");
}

struct OpDevice {
  int index;
  bool from_tensor;  // else a factory op: its device argument, or the current device
};

// The device `op` runs on: its first dipu tensor (lists included), else a dipu device argument,
// else the current device.
OpDevice opDevice(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t n = op.schema().arguments().size();
  int device = -1;
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor() && isDipu(v.toTensor())) return {v.toTensor().device().index(), true};
    if (v.isList())
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor() && isDipu(e.toTensor())) return {e.toTensor().device().index(), true};
    if (device < 0 && v.isDevice() && v.toDevice().type() == kDipu)
      device = v.toDevice().has_index() ? v.toDevice().index() : currentDevice();
  }
  return {device >= 0 ? device : currentDevice(), false};
}

// Whether `t` may sit beside tensors of dipu:`device`, as CUDA decides it: tensors of that device,
// 0-dim CPU tensors (scalars) the op only reads, and, in Tensor?[] index lists, CPU index tensors.
bool mayJoin(const at::Tensor& t, int device, bool index_list, bool written) {
  if (!t.defined()) return true;
  if (isDipu(t)) return t.device().index() == device;
  return t.device().is_cpu() && !written && (t.dim() == 0 || index_list);
}

// Refuses an op whose tensors, list items included, are on different devices (CUDA refuses it; the
// kernel here would read host memory and work, hiding the bug until real hardware). Factory ops are
// not checked: their tensors, if any, are host inputs.
void checkOneDevice(const c10::OperatorHandle& op, const torch::jit::Stack& stack, int device) {
  const auto& args = op.schema().arguments();
  const size_t base = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[base + i];
    const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (v.isTensor() && !mayJoin(v.toTensor(), device, false, written)) mixedDevices(op, args[i], v.toTensor(), device);
    if (!v.isList()) continue;
    const bool index_list = !v.isTensorList();  // Tensor?[] (index, index_put_) holds CPU indices on CUDA too
    for (const c10::IValue& e : v.toListRef())
      if (e.isTensor() && !mayJoin(e.toTensor(), device, index_list, written))
        mixedDevices(op, args[i], e.toTensor(), device);
  }
}

// A chip that keeps fewer mantissa bits rounds the inputs of matrix multiplies (not what they write).
void roundMatmulInputs(const c10::OperatorHandle& op, torch::jit::Stack& stack, int mantissa_bits) {
  const auto& args = op.schema().arguments();
  const size_t base = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& v = stack[base + i];
    const bool written = args[i].alias_info() && args[i].alias_info()->isWrite();
    if (v.isTensor() && !written) v = roundMantissa(v.toTensor(), mantissa_bits);
  }
}

// Whether the chip's result of an op in `role` differs from the kernel's, so it must be recomputed
// from the op's inputs.
bool recomputes(NumericsRole role, const Numerics& n) {
  switch (role) {
    case NumericsRole::Matmul: return n.emulatesAccumulation();
    case NumericsRole::SpecialFunction: return n.emulatesSpecialFunctions();
    default: return false;
  }
}

// A chip that flushes denormals flushes what the kernel produced: the arguments it wrote and its
// fresh results, never a view's base (an input the kernel only read).
void flushProducedDenormals(const KernelArguments& call) {
  call.forEachWritten([](const at::Tensor& t) { flushDenormals(asKernelTensor(t)); });
  for (const at::Tensor& t : call.freshResults()) flushDenormals(asKernelTensor(t));
}

// The op and the arguments on the stack that its cost depends on.
KernelSignature signatureOf(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  KernelSignature signature(op.schema());
  const size_t n = op.schema().arguments().size();
  for (auto it = stack.end() - n; it != stack.end(); ++it) {
    if (it->isTensor()) {
      signature.addTensor(it->toTensor());
    } else if (it->isTensorList()) {
      for (const at::Tensor& t : it->toTensorList().vec()) signature.addTensor(t);
    } else if (it->isInt()) {
      signature.addInt(it->toInt());
    } else if (it->isIntList()) {
      for (const int64_t v : it->toIntList()) signature.addInt(v);
    } else if (it->isBool()) {
      signature.addInt(it->toBool());
    }
  }
  return signature;
}

// Whether dipu draws `op` itself from its counter-based generator: a random op ditorch draws, on a
// kernel device whose generators are not the vendor's (the CPU), given no generator or a dipu one
// (a CPU generator handed to a dipu op keeps the vendor's kernel, as before).
bool drawnCounterBased(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  if (kernelDeviceType() != c10::DeviceType::CPU || !drawsCounterBased(op)) return false;
  const auto& args = op.schema().arguments();
  const size_t base = stack.size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& v = stack[base + i];
    if (v.isGenerator() && v.toGenerator().device().type() != kDipu) return false;
  }
  return true;
}

}  // namespace

void shimKernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  chooseBackwardThread();
  const OpDevice where = opDevice(op, *stack);
  const int device = where.index;
  if (where.from_tensor) checkOneDevice(op, *stack, device);
  if (vendorLacks(op)) return cpuFallback(op, stack);

  const ChipProfile& chip = chipProfile();
  const Numerics& numerics = chip.numerics;
  const NumericsRole role = numerics.any() ? numericsRole(op) : NumericsRole::None;
  const bool counter_random = drawnCounterBased(op, *stack);
  KernelArguments call(device);
  call.rewrite(op, *stack, /*keep_generators=*/counter_random);
  if (numerics.matmul_input_bits < 23 && (role == NumericsRole::Matmul || role == NumericsRole::MatmulInputs))
    roundMatmulInputs(op, *stack, numerics.matmul_input_bits);
  std::vector<c10::IValue> inputs;  // kept only when the chip's result is recomputed from them
  if (recomputes(role, numerics)) inputs.assign(stack->end() - op.schema().arguments().size(), stack->end());

  const KernelClock start = kernelClockNow(chip.slowdown);
  std::optional<KernelSignature> signature;  // only where the chip's time is charged
  if (start.read) signature = signatureOf(op, *stack);
  {
    KernelAllocationScope scope(device);
    // A matmul the chip accumulates its own way: its result alone is computed (below), into the
    // tensor the kernel would have returned.
    const at::Tensor chip_result =
        role == NumericsRole::Matmul && !inputs.empty() ? emptyMatmulResult(op.schema(), *stack) : at::Tensor();
    if (chip_result.defined()) {
      torch::jit::drop(*stack, op.schema().arguments().size());
      torch::jit::push(*stack, chip_result);
    } else if (counter_random) {
      drawCounterBased(op, stack, device);
    } else if (!runBf16MatmulViaFp32(op, stack)) {
      op.redispatchBoxed(c10::DispatchKeySet(kernelDispatchKey()), stack);
    }
  }
  if (signature) chargeKernel(start, chip.slowdown, *signature);  // the device time is the kernel's; the numerics below overlap it

  if (!inputs.empty() && stack->back().isTensor()) reproduceChipResult(role, op, inputs, stack->back().toTensor(), numerics);
  call.syncWritten();
  call.adoptResults(op.schema().returns().size(), *stack);
  if (numerics.flush_denormals) flushProducedDenormals(call);
  if (start.read) paceHost();
}

}  // namespace ditorch
