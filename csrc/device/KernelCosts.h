#pragma once
// The machine's kernel costs: what each kernel signature costs the host, measured once per
// machine and shared by every process that names one file (`DITORCH_KERNEL_COSTS`).
//
// A kernel's host time drifts with the host (a VM's neighbours, its clock) and swells when
// ranks contend for caches and memory bandwidth; the emulated device magnifies both by the
// chip's slowdown. The least of a signature's recent runs in one process filters contention
// only when some recent run had the caches to itself, and a profile taken at one minute and a
// pipeline run at the next still charge different costs for the same kernel; the least of all
// runs ever is no fix either, as it keeps falling the more a kernel runs (a pipeline runs it
// thousands of times, a profile dozens). So a signature's cost is the least of its first
// kKernelCostSamples runs on the machine (a profile's, taken alone, when the profile runs
// first) and is fixed from then on: the profile, every rank and every later run charge it, and
// emulated chips keep one speed across processes and minutes.
//
// File: "DTKCOST2", a little-endian uint64 count, then count entries (uint64 signature, int64
// nanoseconds, uint64 samples). Read when the first kernel is charged; merged back under an
// flock at exit, through a temporary file renamed over it, so a failed or torn write leaves the
// previous table.
#include <cstdint>
#include <string>
#include <unordered_map>

namespace ditorch {

// The environment variable naming the table's file; unset or empty: no shared table.
constexpr const char* kKernelCostsEnv = "DITORCH_KERNEL_COSTS";
// Bound on signatures read or kept: a model's distinct kernels are a few hundred per shape set.
constexpr uint64_t kMaxKernelCosts = 1 << 16;

// Runs of a signature whose least host time becomes its fixed cost.
constexpr uint64_t kKernelCostSamples = 32;

struct KernelCost {
  int64_t ns = 0;  // the least host time of the samples so far
  uint64_t samples = 0;  // fixed once kKernelCostSamples
  bool fixed() const { return samples >= kKernelCostSamples; }
  // One more run (ignored once fixed).
  void add(int64_t host_ns);
  // Another table's knowledge of the same signature: a fixed cost wins; else the samples pool.
  void merge(const KernelCost& other);
};

using KernelCostMap = std::unordered_map<uint64_t, KernelCost>;

// Reads `path` into `costs` (KernelCost::merge per signature). A missing file is an empty
// table; a malformed one is an error naming what is wrong (returned, `costs` untouched).
std::string readKernelCosts(const std::string& path, KernelCostMap& costs);
// Merges `costs` (the samples this process added) into `path` under its lock; returns an error
// message, or "" on success.
std::string mergeKernelCosts(const std::string& path, const KernelCostMap& costs);

// The cost of `signature` in this machine's table, this run (`host_ns`) counted while the cost
// is not fixed yet; -1 when no table is configured (the caller falls back to its own window).
int64_t leastKnownHostTime(uint64_t signature, int64_t host_ns);

}  // namespace ditorch
