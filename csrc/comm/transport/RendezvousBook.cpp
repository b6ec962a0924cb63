#include "comm/transport/RendezvousBook.h"

#include <iterator>
#include <stdexcept>

namespace dicomm {

bool RendezvousBook::expect(uint64_t seq, Landing& landing, size_t nbytes) {
  if (open_.count(seq)) return false;
  open_.emplace(seq, Transfer{std::move(landing), nbytes, nbytes});
  return true;
}

Landing RendezvousBook::takeWhole(uint64_t seq, size_t nbytes) {
  auto it = open_.find(seq);
  if (it == open_.end() || it->second.nbytes != nbytes || it->second.left != nbytes) {
    throw std::invalid_argument(
        std::to_string(nbytes) + " bytes of data for sequence " + std::to_string(seq) +
        (it == open_.end() ? ", which was never asked for"
                           : ", which was asked for " + std::to_string(it->second.nbytes) +
                                 " bytes with " + std::to_string(it->second.left) + " still due"));
  }
  Landing landing = std::move(it->second.landing);
  open_.erase(it);
  return landing;
}

char* RendezvousBook::claimPart(uint64_t seq, size_t offset, size_t nbytes) {
  auto it = open_.find(seq);
  const auto refuse = [&](const char* why) {
    throw std::invalid_argument("part [" + std::to_string(offset) + ", +" + std::to_string(nbytes) +
                                ") of sequence " + std::to_string(seq) + " " + why);
  };
  if (it == open_.end()) refuse("was not expected");
  Transfer& t = it->second;
  if (nbytes == 0 || offset > t.nbytes || nbytes > t.nbytes - offset || nbytes > t.left) refuse("was not expected");
  if (offset % kPartAlign != 0) refuse("does not start at a page boundary");
  auto next = t.claimed.lower_bound(offset);
  if ((next != t.claimed.end() && next->first < offset + nbytes) ||
      (next != t.claimed.begin() && std::prev(next)->second > offset)) {
    refuse("overlaps a part received before");
  }
  t.claimed.emplace_hint(next, offset, offset + nbytes);
  const Landing& l = t.landing;
  return l.data && l.capacity >= t.nbytes ? static_cast<char*>(l.data) + offset : nullptr;
}

bool RendezvousBook::partLanded(uint64_t seq, size_t nbytes, Landing* complete) {
  auto it = open_.find(seq);
  if (it == open_.end()) return false;
  it->second.left -= std::min(nbytes, it->second.left);
  if (it->second.left > 0) return false;
  *complete = std::move(it->second.landing);
  open_.erase(it);
  return true;
}

std::vector<Landing> RendezvousBook::takeAll() {
  std::vector<Landing> all;
  for (auto& kv : open_) all.push_back(std::move(kv.second.landing));
  open_.clear();
  return all;
}

}  // namespace dicomm
