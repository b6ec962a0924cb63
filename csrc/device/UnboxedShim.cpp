// The shim's unboxed entry for the ops small models call most.
//
// The boxed shim (Shim.cpp) receives every argument boxed, and PyTorch's boxing copies each tensor
// into an IValue. For a tensor a Python object owns, that copy takes the GIL to keep the object
// alive (TensorImpl::incref_pyobject, and its decref after): on a one-element add, that and the
// boxing are about a third of what the shim costs beyond the CPU's own call. The ops below take
// the shim's path unboxed instead, their arguments borrowed, not copied.
//
// Only the plain case is served here: the tensors on one dipu device (0-dim CPU scalars allowed),
// a vendor kernel for the op, a chip without numerics of its own and no bf16 matmul run in fp32.
// Anything else is boxed and handed to the boxed shim, which runs, reproduces or refuses it
// exactly as it does every op.
#include "device/AutogradThreads.h"
#include "device/ChipNumerics.h"
#include "device/ChipProfile.h"
#include "device/CpuFallback.h"
#include "device/KernelArguments.h"
#include "device/Allocator.h"
#include "device/Shim.h"
#include "device/SpeedEmulation.h"
#include "device/vendor/Vendor.h"

#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/ops/add_ops.h>
#include <ATen/ops/addcdiv_ops.h>
#include <ATen/ops/addcmul_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/bmm_ops.h>
#include <ATen/ops/div_ops.h>
#include <ATen/ops/exp_ops.h>
#include <ATen/ops/fill_ops.h>
#include <ATen/ops/lerp_ops.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/neg_ops.h>
#include <ATen/ops/pow_ops.h>
#include <ATen/ops/rsqrt_ops.h>
#include <ATen/ops/sqrt_ops.h>
#include <ATen/ops/sub_ops.h>
#include <ATen/ops/sum_ops.h>
#include <ATen/ops/mean_ops.h>
#include <ATen/ops/where_ops.h>
#include <ATen/ops/zero_ops.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace ditorch {
namespace {

template <class T>
constexpr bool kIsTensor = std::is_same_v<std::decay_t<T>, at::Tensor>;

// A written argument is a non-const tensor reference (in-place self, out=).
template <class T>
constexpr bool kIsWritten = std::is_same_v<T, at::Tensor&>;

// Folds one argument (of declared type T) into the op's device: -1 before the first dipu tensor, -2
// once the call is not plain (tensors on two devices, a host tensor that is not a scalar the op
// only reads).
template <class T>
void joinDevice(int& device, const std::remove_reference_t<T>& arg) {
  if constexpr (kIsTensor<T>) {
    if (device == -2 || !arg.defined()) return;
    if (isDipu(arg)) {
      const int d = arg.device().index();
      device = device == -1 || device == d ? d : -2;
    } else if (kIsWritten<T> || !(arg.device().is_cpu() && arg.dim() == 0)) {
      device = -2;
    }
  }
}

// Folds one argument into the kernel's signature (see SpeedEmulation.h).
template <class T>
void addToSignature(KernelSignature& signature, const T& arg) {
  using D = std::decay_t<T>;
  if constexpr (kIsTensor<T>) {
    signature.addTensor(arg);
  } else if constexpr (std::is_integral_v<D>) {
    signature.addInt(int64_t(arg));
  } else if constexpr (std::is_same_v<D, at::IntArrayRef>) {
    for (const int64_t v : arg) signature.addInt(v);
  } else if constexpr (std::is_same_v<D, at::OptionalIntArrayRef>) {
    if (arg.has_value())
      for (const int64_t v : *arg) signature.addInt(v);
  }
}

// How the kernel takes an argument declared `Arg`: a tensor by reference (to the call's alias of a
// dipu tensor, else to the caller's own), anything else by value.
template <class Arg>
using KernelArgument = std::conditional_t<kIsTensor<Arg>, std::conditional_t<kIsWritten<Arg>, at::Tensor&, const at::Tensor&>,
                                          std::decay_t<Arg>>;

template <class Arg, class T>
KernelArgument<Arg> toKernel(KernelArguments& call, T& arg) {
  if constexpr (kIsTensor<Arg>)
    return isDipu(arg) ? call.borrowArgument(arg, kIsWritten<Arg>) : arg;
  else
    return std::decay_t<Arg>(arg);
}

template <class Op, class Signature = typename Op::schema>
struct UnboxedShim;

template <class Op, class Ret, class... Args>
struct UnboxedShim<Op, Ret(Args...)> {
  static const c10::OperatorHandle& handle() {
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    return op;
  }

  static Ret call(c10::DispatchKeySet keys, Args... args) {
    static_assert((size_t(0) + ... + size_t(kIsTensor<Args>)) <= KernelArguments::kInlineArguments,
                  "the kernel's tensor arguments are references to aliases kept in place");
    chooseBackwardThread();
    int device = -1;
    (joinDevice<Args>(device, args), ...);
    const ChipProfile& chip = chipProfile();
    if (device < 0 || chip.numerics.any() || vendorLacks(handle(), vendorHasKernel()) ||
        bf16MatmulViaFp32Covers(handle()))
      return c10::impl::BoxedKernelWrapper<Ret(Args...)>::call(c10::BoxedKernel::makeFromFunction<&shimKernel>(),
                                                                handle(), keys, std::forward<Args>(args)...);
    KernelArguments call(device);
    std::tuple<KernelArgument<Args>...> kernel_args{toKernel<Args>(call, args)...};
    const KernelClock start = kernelClockNow(chip.slowdown);
    std::optional<KernelSignature> signature;  // only where the chip's time is charged
    if (start.read) {
      static const KernelSignature op_signature(handle().schema());
      signature.emplace(op_signature);
      (addToSignature(*signature, args), ...);
    }
    if constexpr (std::is_same_v<Ret, at::Tensor>) {
      at::Tensor result;
      {
        KernelAllocationScope scope(device);
        result = runKernel(kernel_args);
      }
      if (signature) chargeKernel(start, chip.slowdown, *signature);
      call.syncWritten();
      if (start.read) paceHost();
      return call.adoptResult(result);
    } else {
      static_assert(std::is_same_v<Ret, at::Tensor&>, "unboxed shim ops return a tensor or a written argument");
      const at::Tensor* written;
      {
        KernelAllocationScope scope(device);
        written = &runKernel(kernel_args);
      }
      if (signature) chargeKernel(start, chip.slowdown, *signature);
      call.syncWritten();
      if (start.read) paceHost();
      return callerArgument(written, kernel_args, std::index_sequence_for<Args...>{}, args...);
    }
  }

  // Whether the vendor's kernel device has a kernel for the op: fixed once ditorch has loaded
  // (registrations for aten ops happen at start-up), so asked once.
  static bool vendorHasKernel() {
    static const bool has = handle().hasComputedKernelForDispatchKey(kernelDispatchKey());
    return has;
  }

 private:
  template <class Tuple>
  static decltype(auto) runKernel(Tuple& kernel_args) {
    return std::apply([](auto&... a) -> Ret { return Op::redispatch(c10::DispatchKeySet(kernelDispatchKey()), a...); },
                      kernel_args);
  }

  // The caller's argument whose kernel alias the kernel returned (an in-place op's self, an out=).
  template <class Tuple, size_t... I>
  static Ret callerArgument(const at::Tensor* returned, Tuple& kernel_args, std::index_sequence<I...>, Args... args) {
    at::Tensor* found = nullptr;
    auto match = [&](auto& kernel_arg, auto& caller_arg) {
      if constexpr (kIsWritten<std::remove_reference_t<decltype(caller_arg)>&>)
        if (!found && &kernel_arg == returned) found = &caller_arg;
    };
    (match(std::get<I>(kernel_args), args), ...);
    TORCH_INTERNAL_ASSERT(found, Op::name, ": the kernel returned a tensor that is not a written argument");
    return *found;
  }
};

template <class Op>
constexpr auto unboxed() {
  return TORCH_FN((&UnboxedShim<Op>::call));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  namespace ops = at::_ops;
  m.impl("add.Tensor", unboxed<ops::add_Tensor>());
  m.impl("add_.Tensor", unboxed<ops::add__Tensor>());
  m.impl("sub.Tensor", unboxed<ops::sub_Tensor>());
  m.impl("sub_.Tensor", unboxed<ops::sub__Tensor>());
  m.impl("mul.Tensor", unboxed<ops::mul_Tensor>());
  m.impl("mul_.Tensor", unboxed<ops::mul__Tensor>());
  m.impl("mul.Scalar", unboxed<ops::mul_Scalar>());
  m.impl("mul_.Scalar", unboxed<ops::mul__Scalar>());
  m.impl("div.Tensor", unboxed<ops::div_Tensor>());
  m.impl("div_.Tensor", unboxed<ops::div__Tensor>());
  m.impl("div.Scalar", unboxed<ops::div_Scalar>());
  m.impl("neg", unboxed<ops::neg>());
  m.impl("exp", unboxed<ops::exp>());
  m.impl("sqrt", unboxed<ops::sqrt>());
  m.impl("rsqrt", unboxed<ops::rsqrt>());
  m.impl("pow.Tensor_Scalar", unboxed<ops::pow_Tensor_Scalar>());
  m.impl("addcmul_", unboxed<ops::addcmul_>());
  m.impl("addcdiv_", unboxed<ops::addcdiv_>());
  m.impl("lerp_.Scalar", unboxed<ops::lerp__Scalar>());
  m.impl("mm", unboxed<ops::mm>());
  m.impl("addmm", unboxed<ops::addmm>());
  m.impl("bmm", unboxed<ops::bmm>());
  m.impl("sum.dim_IntList", unboxed<ops::sum_dim_IntList>());
  m.impl("mean.dim", unboxed<ops::mean_dim>());
  m.impl("where.self", unboxed<ops::where_self>());
  m.impl("fill_.Scalar", unboxed<ops::fill__Scalar>());
  m.impl("zero_", unboxed<ops::zero_>());
}

}  // namespace ditorch
