#include "comm/transport/GreetingBound.h"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>

namespace dicomm {

void GreetingBound::exhausted(size_t held) { cap_ = std::max(kFloor, held / 2); }

void GreetingBound::accepted(size_t groupBound, size_t freeDescriptors) {
  if (!lowered()) return;
  if (freeDescriptors >= groupBound) {
    cap_ = SIZE_MAX;
  } else {
    cap_ = std::max(cap_, std::max(kFloor, freeDescriptors / 2));
  }
}

size_t freeDescriptors() {
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return SIZE_MAX;
  size_t open = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++open;
  }
  closedir(dir);
  // The directory's own descriptor was counted and is closed again.
  open = open > 0 ? open - 1 : 0;
  return open >= limit.rlim_cur ? 0 : static_cast<size_t>(limit.rlim_cur) - open;
}

}  // namespace dicomm
