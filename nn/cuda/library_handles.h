// Per-thread, per-device handles of a CUDA library (cuBLAS, cuDNN).
// Such handles must not be used by two threads at once, and creating one
// costs milliseconds: each thread keeps one per device and hands it back to
// a shared pool when it exits. Handles are never destroyed (the CUDA
// runtime may already be gone at process exit).
#pragma once

#include <mutex>
#include <unordered_map>
#include <vector>

#include "nn/cuda/stream.h"
#include "nn/tensor/device.h"

namespace ddp::nn::cuda {

/// `Create(Handle*)` makes a new handle on the current device (throws on
/// failure). One instantiation per library.
template <typename Handle, void (*Create)(Handle*)>
class LibraryHandles {
 public:
  /// This thread's handle for `device`, created (or taken from the pool) on
  /// first use.
  static Handle For(Device device) {
    ThreadHandles& mine = Mine();
    auto it = mine.handles.find(device.index);
    if (it != mine.handles.end()) return it->second;
    Handle handle = nullptr;
    {
      Pool& pool = SharedPool();
      std::lock_guard<std::mutex> lock(pool.mu);
      auto& list = pool.free[device.index];
      if (!list.empty()) {
        handle = list.back();
        list.pop_back();
      }
    }
    if (handle == nullptr) {
      DeviceGuard guard(device.index);
      Create(&handle);
    }
    mine.handles[device.index] = handle;
    return handle;
  }

 private:
  struct Pool {
    std::mutex mu;
    std::unordered_map<int, std::vector<Handle>> free;
  };
  static Pool& SharedPool() {
    static Pool* pool = new Pool();  // outlives every thread's return
    return *pool;
  }
  struct ThreadHandles {
    std::unordered_map<int, Handle> handles;
    ~ThreadHandles() {
      Pool& pool = SharedPool();
      std::lock_guard<std::mutex> lock(pool.mu);
      for (const auto& [device, handle] : handles) pool.free[device].push_back(handle);
    }
  };
  static ThreadHandles& Mine() {
    thread_local ThreadHandles handles;
    return handles;
  }
};

}  // namespace ddp::nn::cuda
