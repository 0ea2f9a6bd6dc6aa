// The Python module kvtool._core. Each concept binds itself in its own bind_*.cpp file (bindings.h);
// the order here is the order of the types in Python, and of kvtool/_core.pyi.
#include "bindings.h"

NB_MODULE(_core, m) {
  m.doc() = "kvtool's C++ host runtime: KV cache manager and scheduler.";
  kvtool::bind_cache_enums(m);
  kvtool::bind_retention(m);  // before the manager and the scheduler, whose methods take RetentionRange
  kvtool::bind_cache_config(m);
  kvtool::bind_copy_ops(m);
  kvtool::bind_cache_results(m);
  kvtool::bind_cache_stats(m);
  kvtool::bind_cache_events(m);
  kvtool::bind_cache_manager(m);
  kvtool::bind_retention_clock(m);
  kvtool::bind_tiers(m);
  kvtool::bind_scheduler_config(m);
  kvtool::bind_scheduler_results(m);
  kvtool::bind_scheduler(m);
  kvtool::bind_step_simulator(m);
}
