// Process groups released without the GIL (zero_ext/group_release.py).
//
// Before torch 2.8, a ProcessGroup's destructor runs with the GIL held when its last Python
// reference goes. A gloo group's destructor joins its worker threads; a worker that is still
// dropping a finished collective, whose tensors' Python objects were let go first, needs the
// GIL to free them: the two wait for each other forever. Ops called from Python run without
// the GIL, so a reference kept here and dropped inside an op lets the destructor run there.
//
//   zero_ext::hold_process_group(Any group) -> ()   a group, boxed (ProcessGroup.boxed())
//   zero_ext::release_held_process_groups() -> int  drops every reference held; returns
//                                                   how many there were
//
// The held list is never destroyed itself: a group still held when the process exits stays
// alive to the end (no destructor runs after Python is gone).
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <vector>

namespace {

std::mutex& held_mutex() {
  static auto* m = new std::mutex();
  return *m;
}

std::vector<c10::IValue>& held() {
  static auto* v = new std::vector<c10::IValue>();
  return *v;
}

void hold_process_group(const c10::IValue& group) {
  TORCH_CHECK(group.isCustomClass() || group.isObject(),
              "hold_process_group: expected a boxed process group (ProcessGroup.boxed()), got ",
              group.tagKind());
  std::lock_guard<std::mutex> lock(held_mutex());
  held().push_back(group);
}

int64_t release_held_process_groups() {
  std::vector<c10::IValue> out;
  {
    std::lock_guard<std::mutex> lock(held_mutex());
    out.swap(held());
  }
  const auto n = static_cast<int64_t>(out.size());
  out.clear();  // the destructors of groups nobody else holds run here, without the GIL
  return n;
}

// A fragment of the namespace, registered once per process (a second copy of the library,
// another build of these sources, finds the ops there and leaves them: torch refuses a second
// definition with an exception, which a static initializer cannot pass on).
struct RegisterProcessGroupOps {
  std::unique_ptr<torch::Library> lib;
  RegisterProcessGroupOps() {
    if (c10::Dispatcher::singleton().findSchema({"zero_ext::hold_process_group", ""})) return;
    lib = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "zero_ext", std::nullopt,
                                           __FILE__, __LINE__);
    lib->def("hold_process_group(Any group) -> ()", &hold_process_group);
    lib->def("release_held_process_groups() -> int", &release_held_process_groups);
  }
} register_process_group_ops;

}  // namespace
