// An allocator for the cache manager's large per-block arrays (nodes, stored token ids, hash
// index slots). Lookups touch them at random, one cache line per block: with 4 KiB pages nearly
// every touch also misses the TLB. Allocations of 2 MiB and more are 2 MiB aligned and, on
// Linux, advised to use transparent huge pages, which removes most of those TLB misses.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <new>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace kvtool {

template <typename T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr size_t kHugePage = size_t{2} << 20;

  HugePageAllocator() noexcept = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}

  T* allocate(size_t n) {
    const size_t bytes = n * sizeof(T);
    if (bytes < kHugePage) return static_cast<T*>(::operator new(bytes, std::align_val_t{alignof(T) < 64 ? 64 : alignof(T)}));
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = std::aligned_alloc(kHugePage, rounded);
    if (p == nullptr) throw std::bad_alloc();
#ifdef __linux__
    madvise(p, rounded, MADV_HUGEPAGE);  // a hint: without THP it is simply ignored
#endif
    return static_cast<T*>(p);
  }

  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) < kHugePage) {
      ::operator delete(p, std::align_val_t{alignof(T) < 64 ? 64 : alignof(T)});
    } else {
      std::free(p);
    }
  }

  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const noexcept { return true; }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const noexcept { return false; }
};

}  // namespace kvtool
