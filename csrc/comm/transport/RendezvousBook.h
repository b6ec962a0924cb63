// The receiving side's book of rendezvous transfers: payloads this end asked the peer to send
// (it answered the peer's request-to-send with clear-to-send), by the peer's sequence number,
// with where each lands and how many bytes are still due. It checks every data frame against
// what was asked for, so a peer cannot write outside a landing, write a byte twice (two lanes'
// threads would race on it) or complete a transfer twice. No lock of its own: the pair changes
// it under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "comm/transport/Transport.h"

namespace dicomm {

class RendezvousBook {
 public:
  // Records that `nbytes` for sequence `seq` will land in `landing`; false (and `landing` is
  // left with the caller) when that sequence is already pending.
  bool expect(uint64_t seq, Landing& landing, size_t nbytes);
  bool pending(uint64_t seq) const { return open_.count(seq) > 0; }

  // A whole payload of `nbytes` for `seq` arrived: its landing, taken out of the book.
  // Throws std::invalid_argument saying what does not match when nothing of that size is due.
  Landing takeWhole(uint64_t seq, size_t nbytes);

  // A part [offset, offset + nbytes) of `seq` arrived: claims those bytes and returns where they
  // go, or nullptr when the landing dropped the message (its bytes are read and discarded).
  // Throws std::invalid_argument when the part is empty, lies outside what is due, starts off a
  // kPartAlign boundary or overlaps a part claimed before.
  char* claimPart(uint64_t seq, size_t offset, size_t nbytes);
  // Senders cut payloads into parts at multiples of this (StreamPair::sendRendezvousPayload),
  // which also bounds the claims a transfer can hold to one per page.
  static constexpr size_t kPartAlign = 4096;
  // `nbytes` of `seq` are in place. When they were the last, the landing (taken out of the book)
  // goes to `complete` and the result is true. False also when `seq` is no longer in the book
  // (the pair failed meanwhile and completed it with the failure).
  bool partLanded(uint64_t seq, size_t nbytes, Landing* complete);

  // Every pending landing, taken out of the book (to be failed).
  std::vector<Landing> takeAll();

 private:
  struct Transfer {
    Landing landing;
    size_t nbytes = 0;
    size_t left = 0;
    std::map<size_t, size_t> claimed;  // parts received or being read: offset -> end
  };
  std::map<uint64_t, Transfer> open_;
};

}  // namespace dicomm
