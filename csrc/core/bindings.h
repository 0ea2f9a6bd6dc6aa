// The parts of the Python module kvtool._core, one per concept, each in its bind_*.cpp file.
// bindings.cpp calls them in the order the types are defined in Python (the order of _core.pyi).
#pragma once

#include <nanobind/nanobind.h>

#include <exception>

namespace kvtool {

// Python sees the C++ error type Error (an unknown id) as KeyError.
template <typename Error>
void translate_to_key_error() {
  nanobind::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    }
  });
}

// KV cache manager
void bind_cache_enums(nanobind::module_& m);    // PoolKind, KvCacheEventKind (bind_cache_config.cpp)
void bind_cache_config(nanobind::module_& m);   // CacheConfig (bind_cache_config.cpp)
void bind_copy_ops(nanobind::module_& m);       // CopyOp, CopyOpArrays (bind_copy_ops.cpp)
void bind_cache_results(nanobind::module_& m);  // MatchResult, MissReasons, AddSequenceResult (bind_cache_results.cpp)
void bind_cache_stats(nanobind::module_& m);    // PoolStats, CacheStats (bind_cache_stats.cpp)
void bind_cache_events(nanobind::module_& m);   // KvCacheEvent (bind_cache_stats.cpp)
void bind_cache_manager(nanobind::module_& m);  // KVCacheManager (bind_cache_manager.cpp)
void bind_retention(nanobind::module_& m);        // RetentionRange (bind_retention.cpp)
void bind_retention_clock(nanobind::module_& m);  // KVCacheManager.set_time / time (bind_retention.cpp)
void bind_tiers(nanobind::module_& m);            // the third tier's types and methods (bind_tiers.cpp)

// Scheduler
void bind_scheduler_config(nanobind::module_& m);   // policies, RequestState, SchedulerConfig (bind_scheduler_config.cpp)
void bind_scheduler_results(nanobind::module_& m);  // ScheduledRequest, ScheduledBatch, RequestStats (bind_scheduler_results.cpp)
void bind_scheduler(nanobind::module_& m);          // Scheduler (bind_scheduler.cpp)

// Simulation
void bind_step_simulator(nanobind::module_& m);  // StepCosts, SimulatedSteps, StepSimulator (bind_step_simulator.cpp)

}  // namespace kvtool
