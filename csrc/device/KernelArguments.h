#pragma once
// One op call as the vendor's kernel sees it. Each dipu argument (lists included) is re-viewed as
// a tensor of the kernel device (CPU for emu) over the same bytes; after the kernel, arguments it
// wrote are brought back to the caller's tensors and its results become dipu tensors: no copies.
// Where device memory is protected from the host, all of it stays open until the call ends.
#include "device/MemoryWindow.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/MaybeOwned.h>
#include <c10/util/SmallVector.h>

#include <utility>

namespace ditorch {

class KernelArguments {
 public:
  explicit KernelArguments(int device) : device_(device) {}
  ~KernelArguments();  // keeps spare alias tensors for the next op
  KernelArguments(const KernelArguments&) = delete;
  KernelArguments& operator=(const KernelArguments&) = delete;

  // Rewrites `op`'s arguments on `stack` for the vendor's kernel: dipu tensors become kernel-device
  // aliases, and dipu devices and generators (an absent generator included) the kernel device's;
  // with `keep_generators`, generators stay as given (dipu's counter-based draws read them).
  void rewrite(const c10::OperatorHandle& op, torch::jit::Stack& stack, bool keep_generators = false);
  // Arguments up to this many keep their aliases in place: the references borrowArgument returns
  // stay valid for the whole call.
  static constexpr size_t kInlineArguments = 8;
  // One dipu tensor argument of an unboxed call, as the kernel sees it: a reference to the alias
  // this call holds (valid while it lasts, for the first kInlineArguments arguments). `t` is
  // borrowed: the caller holds it for the call (no reference is taken, so a tensor Python owns
  // costs no GIL round trip).
  at::Tensor& borrowArgument(const at::Tensor& t, bool written) {
    return alias(c10::MaybeOwned<at::Tensor>::borrowed(t), written);
  }
  // The kernel's only result as the caller's dipu tensor (what adoptResults does for each): with no
  // other result to share its storage, it is not recorded, nor listed in freshResults().
  at::Tensor adoptResult(const at::Tensor& k) { return toDipu(k, /*remember=*/false); }
  // After the kernel: in-place and out= arguments (list items too) it regrew or re-strided carry
  // their new bytes and geometry back to the caller's tensors.
  void syncWritten();
  // After the kernel: its results on the top of `stack` become dipu tensors (the caller's own tensor
  // for an in-place or out= result, a view of it for a view, an adopted block otherwise).
  void adoptResults(size_t returns, torch::jit::Stack& stack);

  // Calls `f` with each caller tensor the kernel may have written.
  template <typename F>
  void forEachWritten(F&& f) const {
    for (const Alias& a : aliases_)
      if (a.written) f(*a.original);
  }
  // Results born in this kernel: neither an argument nor a view of one.
  const c10::SmallVector<at::Tensor, 4>& freshResults() const { return fresh_; }

 private:
  // One dipu argument re-viewed for the kernel. The references are owning: an argument may be
  // replaced on the stack (a chip rounds matmul inputs into a copy), and its alias must outlive the
  // kernel so results can still be matched against it.
  struct Alias {
    Alias(c10::Storage storage, at::Tensor tensor, c10::MaybeOwned<at::Tensor> caller, void* data, bool write)
        : kernel_storage(std::move(storage)),
          kernel_tensor(std::move(tensor)),
          original(std::move(caller)),
          original_data(data),
          written(write) {}
    c10::Storage kernel_storage;  // the alias storage the kernel saw
    at::Tensor kernel_tensor;     // the alias tensor the kernel saw
    c10::MaybeOwned<at::Tensor> original;  // the caller's dipu tensor (borrowed from an unboxed call)
    void* original_data;
    bool written;                 // an in-place or out= argument
  };

  // The kernel's view of `t`, recorded in aliases_ (the returned reference is that record's).
  at::Tensor& alias(c10::MaybeOwned<at::Tensor> t, bool written);
  // `remember`: record the result's storage (for the call's other results) and list it as fresh.
  at::Tensor toDipu(const at::Tensor& k, bool remember = true);
  // Turns a kernel result into a dipu tensor in place when nothing else holds it (no new tensor
  // and storage to build and free); false when it must be re-wrapped instead.
  bool becomeDipu(const at::Tensor& k);

  MemoryWindow window_;  // the memory the kernel (and the chip's numerics after it) work on
  int device_;
  bool any_written_ = false;  // an alias is of an in-place or out= argument
  c10::SmallVector<Alias, kInlineArguments> aliases_;
  // Kernel result storages already given a dipu storage (a list's items may share one).
  c10::SmallVector<std::pair<c10::StorageImpl*, c10::Storage>, 4> adopted_;
  c10::SmallVector<at::Tensor, 4> fresh_;
};

// Whether `t` is a (defined) dipu tensor.
inline bool isDipu(const at::Tensor& t) { return t.defined() && t.device().type() == c10::DeviceType::PrivateUse1; }

// A tensor of the vendor's kernel device over `t`'s storage (same bytes, sizes, strides).
at::Tensor asKernelTensor(const at::Tensor& t);

}  // namespace ditorch
